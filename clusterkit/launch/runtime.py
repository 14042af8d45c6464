"""The launcher side of one job attempt as one pure state machine (issue 23 item 1).

:class:`Runtime` is the attempt's whole state (every node's exit, tail and failure
report, the folded gate, the progress watchdog, the stacks, the teardown, the
console phase, the checkpoint replicas); ``Runtime.on(event, now) -> actions`` is
every decision. No I/O, no clock, no sink, no transport: the orchestrator
(:mod:`clusterkit.launch.orchestrator`) feeds it the events with the time they
happened (the agents' lines decoded by :func:`read_line`, their ends, the start
results, signals, a tick at least every 0.1 s) and performs the actions (write a
control word, close a channel, print, save the stacks, sweep). It composes the
two older pure machines, :class:`~clusterkit.launch.teardown.Teardown` and
:class:`~clusterkit.launch.watchdog.Watchdog`, and repeats neither.

:attr:`Runtime.stage` is stored, and every handler reads it before it acts: each
row of the table in docs/architecture.md ("The launch runtime") is one place here,
marked ``# row <id>``, and at least one row of tests/process/test_runtime.py (a test holds
the three together). The agents' messages are matched exhaustively: a kind added to
``protocol.AnyEvent`` without its case here fails mypy.
"""

from __future__ import annotations

import signal
from typing import Any, assert_never

from clusterkit.hostrange import folded_lines
from clusterkit.launch import teardown
from clusterkit.launch.jobspec import JobSpec
from clusterkit.launch.outcome import JobOutcome, RankFailure, describe_failure, exit_status
from clusterkit.launch.replica_events import ReplicaLedger
from clusterkit.launch.runtime_io import (
    Action,
    AgentEnded,
    AgentOutput,
    Close,
    ConsolePhase,
    Drained,
    Event,
    FailedFirst,
    Finish,
    Info,
    NodeDone,
    NodeUp,
    Phase,
    Received,
    ReportStacks,
    Send,
    Show,
    Signalled,
    Spawned,
    Starting,
    Tick,
    Unreadable,
    parse_json,
)
from clusterkit.launch.runtime_state import GateState, NodeState, Stage
from clusterkit.launch.stacks import RankStack, StackSummary, read_stack, summarize
from clusterkit.launch.watchdog import DUMP_COLLECT_S, Watchdog, ping_interval
from clusterkit.node import protocol
from clusterkit.node.contract import SUMMARY_PREFIX, JobDir, with_job_id
from clusterkit.node.hangrule import step_of
from clusterkit.node.protocol import Control

# The signals the launcher forwards to every node's ranks, as the agents' control words.
FORWARDED = {signal.SIGUSR1: Control.USR1, signal.SIGUSR2: Control.USR2}
STAGES = list(Stage)  # in the order an attempt passes them
REPLICA_TAGS_SHOWN = 3  # the end-of-job replica line names the newest few checkpoints


class Runtime:
    """The attempt's state; :meth:`on` is the one way it changes.

    ``stage`` is stored: each handler reads it first and acts only in the stages its
    rows name (a ``# row <id>`` comment marks the one place of each row of the table
    in docs/architecture.md; tests/process/test_runtime.py checks that every row id of the
    table has a test row). A (stage, event) the table does not list does nothing.
    """

    def __init__(self, job: JobSpec, now: float, *, fork_import: str = "") -> None:
        self.job = job
        # The first module the fork servers import (the "starting ranks" phase says so:
        # torch takes 10 s on a loaded machine). Read from the environment by the caller.
        self.fork_import = fork_import
        self.stage = Stage.CONNECTING
        self.nodes = {t.node: NodeState(t) for t in job.tasks}
        self.gate = GateState(job.gate_need, now, same_python=job.gate_same_python,
                              script_here=job.gate_script_here)
        self.watchdog = Watchdog(job.hang_timeout_s, now)
        self.teardown = teardown.Teardown(job.grace_s)
        self.next_ping = 0.0
        self.failure: RankFailure | None = None
        self.interrupts = 0
        self.summary: dict[str, Any] | None = None
        self.stacks: dict[int, RankStack] = {}
        self.stack_nodes: set[str] = set()
        self.stack_summary: StackSummary | None = None
        self.phase: ConsolePhase | None = None  # the console's: it only moves forward
        self.replicas = ReplicaLedger()
        self._out: list[Action] = []

    # ---------------------------------------------------------------- the one entry

    def on(self, event: Event, now: float) -> list[Action]:
        """Apply ``event`` (happened at ``now``, the launcher's monotonic clock)."""
        self._out = []
        match event:
            case Starting():
                self._starting(now)
            case Spawned():
                self._spawned(event, now)
            case Received():
                self._received(self.nodes[event.node], event.msg, now)
            case AgentOutput():
                # row agent-output: the agent itself (a traceback, no clusterkit there)
                self.nodes[event.node].tail.append(event.text)
                self._out.append(Show(event.node, None, event.text, agent=True))
            case Unreadable():
                self._say(f"{event.node}: unreadable agent event: {event.error}")  # row unreadable
            case AgentEnded():
                self._agent_ended(event, now)
            case Signalled():
                self._signalled(event, now)
            case Tick():
                self._tick(now)
            case Drained():
                self._drained()
            case _:
                assert_never(event)  # mypy: every event of runtime_io.Event has a case
        if self.stage is not Stage.FINISHED and self.finished:
            self._enter(Stage.FINISHED, now)  # row last-ended (or the teardown gave up)
        return self._out

    @property
    def finished(self) -> bool:
        """Every agent ended (or was given up on)."""
        return all(s.code is not None for s in self.nodes.values())

    def _enter(self, stage: Stage, now: float) -> None:
        """The stage moves (forward only); the console's phase follows it."""
        assert STAGES.index(stage) > STAGES.index(self.stage), (self.stage, stage)
        self.stage = stage
        if stage is Stage.RUNNING:
            self.watchdog.begin(now)  # the start-up allowance counts from here
            self._set_phase(ConsolePhase.STARTING, f"(fork servers import {self.fork_import})"
                            if self.fork_import else "")
        elif stage is Stage.STOPPING:
            self._set_phase(ConsolePhase.TEARING_DOWN)

    def _set_phase(self, phase: ConsolePhase, detail: str = "") -> None:
        """Tell the console where the job is (forward only; a detail may change)."""
        if self.phase is None or phase.order >= self.phase.order:
            self.phase = phase
            self._out.append(Phase(phase, detail))

    # ---------------------------------------------------------------- the start

    def _starting(self, now: float) -> None:
        if self.stage is not Stage.CONNECTING:
            return
        self.gate.start(now)  # row start
        attempt = self.job.attempt
        self._say(f"job {self.job.job_id}: starting {len(self.nodes)} node agents"
                  + (f" (attempt {attempt + 1})" if attempt else ""))
        self._set_phase(ConsolePhase.CONNECTING, f"attempt {attempt + 1}" if attempt else "")

    def _spawned(self, ev: Spawned, now: float) -> None:
        if self.stage is not Stage.CONNECTING:
            return
        if self.gate.need is None:
            self._enter(Stage.RUNNING, now)  # row spawned: the agents start their ranks at once
            for node, message in ev.failed.items():  # row start-failed
                state = self._start_failed(node, message)
                self._say(f"{node}: could not start the agent: {message}")
                self._fail(state, "start-failed", -1, now)
            return
        self._enter(Stage.GATE, now)  # row spawned-gated: the agents report their facts and hold
        for node, message in ev.failed.items():  # row start-failed-gated
            self._start_failed(node, message)
            self.gate.problem(node, message)
        self._decide_gate(now)

    def _start_failed(self, node: str, message: str) -> NodeState:
        state = self.nodes[node]
        state.code = -1
        state.tail.append(message)
        return state

    # ---------------------------------------------------------------- agent messages

    def _received(self, state: NodeState, msg: protocol.Line | protocol.AnyEvent,
                  now: float) -> None:
        """One message of ``state``'s agent; every kind has its case (mypy checks)."""
        match msg:
            case protocol.Line():
                self._output(state, msg, now)
            case protocol.RankFailed():
                self._rank_failed(state, msg, now)
            case protocol.Facts():
                self._facts(state, msg, now)
            case protocol.Started():
                self._started(state)
            case protocol.Progress():
                self._progress(msg, now)
            case protocol.Stacks():
                self._stacks(state, msg)
            case protocol.Error():
                self._say(f"{state.task.node}: agent error: {msg.message}")  # row error
            case protocol.Replica():
                # row replica: a failed copy at once, a save's copies as one line
                for line in self.replicas.report(msg, len(self.nodes), self._rank_logs()):
                    self._say(line)
            case protocol.Forwarded() | protocol.Teardown() | protocol.Exit():
                pass  # row quiet: the agent's exit code comes with AgentEnded
            case _:
                assert_never(msg)  # a new protocol.AnyEvent kind needs its case here

    def _output(self, state: NodeState, msg: protocol.Line, now: float) -> None:
        node, text = msg.node, msg.text
        rank = msg.rank(self.job.rank_offsets(), state.task.rank_offset)
        self.nodes.get(node, state).record(rank, text)
        if rank is not None and self.stage is Stage.RUNNING:
            # row rank-line: a rank's line is progress, a step line a sign of training
            self.watchdog.output(node, now)
            if step_of(text) is not None and self.watchdog.saw_training(now):
                self._set_phase(ConsolePhase.TRAINING)
        if text.startswith(SUMMARY_PREFIX) and (self.summary is None or rank == 0):
            self.summary = parse_json(text[len(SUMMARY_PREFIX):])
        self._out.append(Show(node, rank, text))  # row launcher-line (and rank-line)

    # ---------------------------------------------------------------- agent events

    def _rank_failed(self, state: NodeState, ev: protocol.RankFailed, now: float) -> None:
        if self.stage not in (Stage.RUNNING, Stage.COLLECTING):
            return  # row stopping-rank-failed: collateral, the first failure stays named
        target = self.nodes.get(ev.failed_node, state)  # row rank-failed
        if target.failed_rank is None:
            target.failed_rank = ev
        if state.failed_rank is None:
            state.failed_rank = ev
        # The earliest report names the culprit and starts the teardown now, before
        # the other ranks fail in their collectives and their agents exit too.
        self._fail(state, "exit", ev.code or 1, now)

    def _facts(self, state: NodeState, ev: protocol.Facts, now: float) -> None:
        if self.stage is not Stage.GATE:
            return  # row late-facts: after a stop a late node's facts start nothing
        self.gate.report(state.task.node, ev.facts, now)  # row gate-facts
        self._set_phase(ConsolePhase.GATE, f"{len(self.gate.facts)}/{len(self.nodes)} nodes")
        self._decide_gate(now)

    def _started(self, state: NodeState) -> None:
        self._out.append(NodeUp(state.task.node))  # row started
        state.started = True
        if all(s.started for s in self.nodes.values()):
            self._set_phase(ConsolePhase.INITIALISING)

    def _progress(self, ev: protocol.Progress, now: float) -> None:
        if self.stage is not Stage.RUNNING:
            return
        if self.watchdog.report(ev, now):  # row progress: its first step ends the start-up
            self._set_phase(ConsolePhase.TRAINING)

    def _stacks(self, state: NodeState, ev: protocol.Stacks) -> None:
        if self.stage is not Stage.COLLECTING:
            return
        self.stack_nodes.add(state.task.node)  # row stacks
        for key, res in ev.ranks.items():
            if not (isinstance(res, dict) and str(key).isdigit()):
                continue
            rank = int(key)
            self.stacks[rank] = read_stack(rank, state.task.node, str(res.get("text", "")),
                                           state=str(res.get("state", "")),
                                           tool=str(res.get("tool", "")))

    # ---------------------------------------------------------------- agent ends

    def _agent_ended(self, ev: AgentEnded, now: float) -> None:
        state = self.nodes[ev.node]
        state.code = ev.code
        state.dropped = ev.dropped or ev.code == -1
        if self.stage is Stage.GATE and self.gate.waits_for(ev.node):
            why = "the SSH connection dropped" if state.dropped else f"exit code {ev.code}"
            self.gate.problem(ev.node, "the node agent ended before reporting "  # row gate-ended
                              f"({why}): {state.last_words()[:200]}")
            self._decide_gate(now)
            self._out.append(NodeDone(ev.node, ev.code))
            return
        if self.stage in (Stage.GATE, Stage.RUNNING, Stage.COLLECTING):
            if state.dropped:
                self._fail(state, "connection-dropped", ev.code, now)  # row ended-dropped
            elif ev.code != 0:
                self._fail(state, "exit", ev.code, now)  # row ended-failed
        # row ended-ok; # row stopping-ended: a refused gate's agents are released,
        # and after a failure or a signal the others' ends are collateral
        self._out.append(NodeDone(ev.node, ev.code))
        self._release_watchers()

    def _release_watchers(self) -> None:
        """Every launcher finished: the watch-only agents (pdsh peers) sweep and exit."""
        if any(s.code is None for s in self.nodes.values() if s.task.argv):
            return
        watchers = tuple(n for n, s in self.nodes.items() if not s.task.argv and s.code is None)
        if watchers:
            self._out.append(Close(watchers, terminate=False))

    # ---------------------------------------------------------------- the folded gate

    def _decide_gate(self, now: float) -> None:
        """The gate's verdict once every node reported (only while the stage is gate)."""
        if self.stage is not Stage.GATE:
            return  # issue 30: no GO after a stop
        result = self.gate.decide(list(self.nodes))
        if result is None:
            return
        if result.ok:
            self._broadcast(Control.GO)  # row gate-go
            self._enter(Stage.RUNNING, now)
            return
        for line in folded_lines(result.problems.items(), list(self.nodes)):
            self._say(line)  # row gate-refused: "node[1-7]: why", one line per problem
        self._begin_teardown(now)  # the holding agents exit without starting anything

    # ---------------------------------------------------------------- failure, teardown

    def _fail(self, state: NodeState, reason: str, code: int, now: float) -> None:
        """Name the failure (the first one only, not after a signal) and stop the job."""
        if self.failure is None and not self.interrupts:
            self.failure = self._name_failure(state, reason, code)
            if self.failure.rank is not None:  # the other ranks' tracebacks are collateral
                # (before Info, which lets out the lines still in their fold window)
                self._out.append(FailedFirst(self.failure.rank, self.failure.where(),
                                             self._rank_logs()))
            self._say(f"{self.failure.where()} failed ({describe_failure(self.failure)}): "
                      "stopping the job on every node")
        self._begin_teardown(now)

    def _name_failure(self, state: NodeState, reason: str, code: int) -> RankFailure:
        """The failed rank: the node's earliest RankFailed, else the node itself."""
        ev = state.failed_rank or protocol.RankFailed(state.task.node, code=0)
        if state.failed_rank is None and state.task.nprocs == 1 and reason == "exit":
            # One rank on the node: the launcher's exit is that rank's.
            ev = protocol.RankFailed(state.task.node, rank=state.task.rank_offset,
                                     local_rank=0, code=0)
        failed = self.nodes.get(ev.failed_node, state)
        rank = ev.rank
        tail = failed.rank_tails.get(rank, failed.tail) if rank is not None else failed.tail
        return RankFailure(node=failed.task.node, rank=rank, local_rank=ev.local_rank,
                           code=ev.code or code, reason=reason, tail=list(tail))

    def _rank_logs(self) -> str:
        """Where every rank's output is kept (the agents' per-rank logs)."""
        dirs = {with_job_id(t.job_dir, self.job.job_id) for t in self.job.tasks}
        job_dir = dirs.pop() if len(dirs) == 1 else "<job dir>"
        return JobDir(job_dir).node_log("<node>", "<N>")

    def _begin_teardown(self, now: float) -> None:
        if self.stage is not Stage.STOPPING:
            self._enter(Stage.STOPPING, now)
        self._teardown_did(self.teardown.on(teardown.Begin(), now))

    def _teardown_did(self, actions: list[teardown.Action]) -> None:
        """The teardown machine's decisions, addressed to the agents still running."""
        for action in actions:
            if isinstance(action, teardown.Send):
                self._broadcast(action.word)
            elif isinstance(action, teardown.CloseChannels):
                # Closing the channel makes the agent see EOF; it sweeps on its own.
                self._out.append(Close(self._running_nodes(), terminate=True))
            else:  # GiveUp: the agents that never answered count as dropped
                for state in self.nodes.values():
                    if state.code is None:
                        state.code, state.dropped = -1, True

    def _running_nodes(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.nodes.items() if s.code is None)

    def _broadcast(self, word: Control) -> None:
        self._out.append(Send(word, self._running_nodes()))

    # ---------------------------------------------------------------- signals, time

    def _signalled(self, ev: Signalled, now: float) -> None:
        name = ev.sig.name
        if ev.sig in FORWARDED:
            self._say(f"forwarding {name} to every node")  # row forward
            self._broadcast(FORWARDED[ev.sig])
            return
        self.interrupts += 1
        if self.stage in (Stage.GATE, Stage.RUNNING, Stage.COLLECTING):
            self._say(f"{name}: stopping the job on every node (again to kill at once)")
            self._begin_teardown(now)  # row signal
        elif self.stage is Stage.STOPPING and self.interrupts == 1:
            # row signal-stopping: a failure's teardown runs already; the next one kills
            self._say(f"{name}: stopping the job on every node (again to kill at once)")
        elif self.stage is Stage.STOPPING:
            self._teardown_did(self.teardown.on(teardown.Kill(), now))  # row signal-again

    def _tick(self, now: float) -> None:
        if self.stage is Stage.GATE and self.gate.timed_out(now, list(self.nodes)):
            self._decide_gate(now)  # row gate-timeout
        if self.stage is not Stage.FINISHED:
            self._keepalive(now)  # row keepalive
        if self.stage is Stage.RUNNING:
            self._watch(now)
        elif self.stage is Stage.COLLECTING:
            self._collect(now)
        elif self.stage is Stage.STOPPING:
            # row stopping-tick: the teardown's own table; its give-up marks them dropped
            self._teardown_did(self.teardown.on(teardown.Tick(), now))

    def _keepalive(self, now: float) -> None:
        """PING every agent: its dead-man switch fires only after keepalive_s of silence."""
        if self.job.keepalive_s <= 0 or now < self.next_ping:
            return
        self.next_ping = now + ping_interval(self.job.keepalive_s)
        self._broadcast(Control.PING)

    # ---------------------------------------------------------------- hangs (issue 14)

    def _watch(self, now: float) -> None:
        why = self.watchdog.trip(now)
        if why is None:
            return  # row tick: nothing due
        self._enter(Stage.COLLECTING, now)  # row watchdog
        self._say(f"{why}: collecting every rank's Python stacks")
        self._broadcast(Control.DUMP)

    def _collect(self, now: float) -> None:
        fired_at = self.watchdog.fired_at
        assert fired_at is not None  # the stage is collecting
        if self.stack_nodes >= self._live_rank_nodes() or now - fired_at > DUMP_COLLECT_S:
            self._hang_verdict(now)  # row verdict

    def _live_rank_nodes(self) -> set[str]:
        return {n for n, s in self.nodes.items() if s.code is None and s.task.nprocs > 0}

    def _hang_verdict(self, now: float) -> None:
        world = sum(t.nprocs for t in self.job.tasks)
        summary = summarize(self.stacks, world)
        self.stack_summary = summary
        self._out.append(ReportStacks(dict(self.stacks), summary))
        culprit = summary.culprit()
        node, rank = culprit if culprit else (self.job.tasks[0].node, None)
        state = self.nodes[node]
        state.failed_rank = protocol.RankFailed(
            node, failed_node=node, rank=rank,
            local_rank=None if rank is None else rank - state.task.rank_offset, code=124)
        self._fail(state, "hang", 124, now)

    # ---------------------------------------------------------------- the end

    def _drained(self) -> None:
        if self.stage is not Stage.FINISHED:
            return
        line = self.replica_summary()  # row drained
        if line:
            self._say(line)
        self._out.append(Finish(self._sweep()))

    def replica_summary(self) -> str:
        """``checkpoints replicated: global_step20 7/7, global_step40 7/7`` (newest last)."""
        tags = list(self.replicas.copies)[-REPLICA_TAGS_SHOWN:]
        if not tags:
            return ""
        total = len(self.nodes)
        return "checkpoints replicated: " + ", ".join(
            f"{tag} {self.replicas.replicated(tag)}/{total}" for tag in tags)

    def _sweep(self) -> tuple[str, ...]:
        """Nodes whose agent did not end cleanly after a stop: swept out of band."""
        if not (self.failure or self.interrupts) or self.gate.refused:
            return ()  # a refused gate started nothing
        return tuple(n for n, s in self.nodes.items() if s.dropped or s.code is None)

    @property
    def exit_code(self) -> int:
        if self.gate.refused:
            return 2
        if self.failure is not None:
            return exit_status(self.failure.code) or 1
        return 130 if self.interrupts else 0

    def outcome(self, elapsed_s: float, leftovers: dict[str, int],
                unconfirmed: list[str]) -> JobOutcome:
        """The attempt's result; the sweep's findings and the time come from the I/O loop."""
        return JobOutcome(
            exit_code=self.exit_code, failure=self.failure, summary=self.summary,
            node_codes={n: (s.code if s.code is not None else -1) for n, s in self.nodes.items()},
            interrupted=self.interrupts > 0, elapsed_s=elapsed_s, leftovers=leftovers,
            gate=self.gate.result, stacks=self.stack_summary, unconfirmed=list(unconfirmed),
            hang_idle_s=self.watchdog.hang_idle_s(),
            replicas=self.replicas,
        )

    def _say(self, text: str) -> None:
        self._out.append(Info(text))
