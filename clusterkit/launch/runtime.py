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

Every transition is a row of the table in docs/architecture.md ("The launch
runtime") and of tests/test_runtime.py; :attr:`Runtime.stage` names the rows' states.
"""

from __future__ import annotations

from typing import Any, assert_never

from clusterkit.contract import SUMMARY_PREFIX
from clusterkit.hostrange import folded_lines
from clusterkit.launch import teardown
from clusterkit.launch.console import PHASES
from clusterkit.launch.jobspec import JobSpec
from clusterkit.launch.outcome import JobOutcome, RankFailure, describe_failure, exit_status
from clusterkit.launch.replica_events import ReplicaLedger, replica_line
from clusterkit.launch.runtime_io import (
    Action,
    AgentEnded,
    AgentOutput,
    Close,
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
from clusterkit.launch.watchdog import DUMP_COLLECT_S, Watchdog, ping_interval, step_of
from clusterkit.node import protocol
from clusterkit.node.contract import JobDir, with_job_id
from clusterkit.node.protocol import Control

REPLICA_TAGS_SHOWN = 3  # the end-of-job replica line names the newest few checkpoints


class Runtime:
    """The attempt's state; :meth:`on` is the one way it changes."""

    def __init__(self, job: JobSpec, now: float, *, fork_import: str = "") -> None:
        self.job = job
        # The first module the fork servers import (the "starting ranks" phase says so:
        # torch takes 10 s on a loaded machine). Read from the environment by the caller.
        self.fork_import = fork_import
        self.nodes = {t.node: NodeState(t) for t in job.tasks}
        self.spawned = False
        self.unstarted: set[str] = set()  # nodes whose agent could not be started
        self.gate = GateState(job.gate_need, now, same_python=job.gate_same_python)
        self.watchdog = Watchdog(job.hang_timeout_s, now)
        self.teardown = teardown.Teardown(job.grace_s)
        self.next_ping = 0.0
        self.failure: RankFailure | None = None
        self.interrupts = 0
        self.summary: dict[str, Any] | None = None
        self.stacks: dict[int, RankStack] = {}
        self.stack_nodes: set[str] = set()
        self.stack_summary: StackSummary | None = None
        self.phase = -1  # index into console.PHASES: the status line only moves forward
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
                self._received(event, now)
            case AgentOutput():
                self._agent_output(event)
            case Unreadable():
                self._say(f"{event.node}: unreadable agent event: {event.error}")
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
        return self._out

    @property
    def stage(self) -> Stage:
        """The state column of the table, read off the state (stored nowhere else)."""
        if self.finished:
            return Stage.FINISHED
        if self.teardown.begun:
            return Stage.STOPPING
        if self.watchdog.fired_at is not None:
            return Stage.COLLECTING
        if not self.spawned:
            return Stage.CONNECTING
        return Stage.RUNNING if self.gate.passed else Stage.GATE

    @property
    def finished(self) -> bool:
        return all(s.code is not None for s in self.nodes.values())

    # ---------------------------------------------------------------- the start

    def _starting(self, now: float) -> None:
        self.gate.last = now
        attempt = self.job.attempt
        self._say(f"job {self.job.job_id}: starting {len(self.nodes)} node agents"
                  + (f" (attempt {attempt + 1})" if attempt else ""))
        self._set_phase("connecting", f"attempt {attempt + 1}" if attempt else "")

    def _spawned(self, ev: Spawned, now: float) -> None:
        self.spawned = True
        self.unstarted = set(ev.failed)
        if self.gate.need is None:  # no gate: the agents start their ranks at once
            self._ranks_starting(now)
        for node, message in ev.failed.items():
            self._start_failed(self.nodes[node], message, now)

    def _start_failed(self, state: NodeState, message: str, now: float) -> None:
        state.code = -1
        state.tail.append(message)
        if self.gate.waits_for(state.task.node):
            self.gate.problems[state.task.node] = message
            self._decide_gate(now)
            return
        self._say(f"{state.task.node}: could not start the agent: {message}")
        self._fail(state, "start-failed", -1, now)

    def _ranks_starting(self, now: float) -> None:
        self.watchdog.begin(now)
        self._set_phase("starting ranks", f"(fork servers import {self.fork_import})"
                        if self.fork_import else "")

    def _set_phase(self, name: str, detail: str = "") -> None:
        """Tell the console where the job is (forward only; a detail may change)."""
        index = PHASES.index(name)
        if index >= self.phase:
            self.phase = index
            self._out.append(Phase(name, detail))

    # ---------------------------------------------------------------- agent output

    def _received(self, ev: Received, now: float) -> None:
        state, msg = self.nodes[ev.node], ev.msg
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
                self._progress(state, msg, now)
            case protocol.Stacks():
                self._stacks(state, msg)
            case protocol.Error():
                self._say(f"{state.task.node}: agent error: {msg.message}")
            case protocol.Replica():
                self._say(replica_line(msg))
                self.replicas.add(msg)
            # Forwarded, Teardown, Exit: nothing (the exit code comes with AgentEnded).

    def _agent_output(self, ev: AgentOutput) -> None:
        # The agent itself (a traceback, a python that cannot find clusterkit).
        self.nodes[ev.node].tail.append(ev.text)
        self._out.append(Show(ev.node, None, ev.text, agent=True))

    def _output(self, state: NodeState, msg: protocol.Line, now: float) -> None:
        node, text = msg.node, msg.text
        rank = msg.rank(self.job.rank_offsets(), state.task.rank_offset)
        self.nodes.get(node, state).record(rank, text)
        if rank is not None:  # a rank's line is progress, a step line a sign of training
            self.watchdog.output(node, now)
            if step_of(text) is not None:
                self._training_seen(now)
        if text.startswith(SUMMARY_PREFIX) and (self.summary is None or rank == 0):
            self.summary = parse_json(text[len(SUMMARY_PREFIX):])
        self._out.append(Show(node, rank, text))

    def _training_seen(self, now: float) -> None:
        if self.watchdog.saw_training(now):
            self._set_phase("training")

    # ---------------------------------------------------------------- agent events

    def _rank_failed(self, state: NodeState, ev: protocol.RankFailed, now: float) -> None:
        target = self.nodes.get(ev.failed_node, state)
        if target.failed_rank is None:
            target.failed_rank = ev
        if state.failed_rank is None:
            state.failed_rank = ev
        # The earliest report names the culprit and starts the teardown now, before
        # the other ranks fail in their collectives and their agents exit too.
        self._fail(state, "exit", ev.code or 1, now)

    def _facts(self, state: NodeState, ev: protocol.Facts, now: float) -> None:
        self.gate.facts[state.task.node] = dict(ev.facts)
        self.gate.last = now
        self._set_phase("gate", f"{len(self.gate.facts)}/{len(self.nodes)} nodes")
        self._decide_gate(now)

    def _started(self, state: NodeState) -> None:
        self._out.append(NodeUp(state.task.node))
        state.started = True
        if all(s.started for s in self.nodes.values()):
            self._set_phase("initialising")

    def _progress(self, state: NodeState, ev: protocol.Progress, now: float) -> None:
        untrained = self.watchdog.training_at is None
        self.watchdog.report(state.task.node, {"idle_s": ev.idle_s, "step": ev.step}, now)
        # report() notes a heartbeat's step as the first sign of training itself, so
        # the phase moves here (asking saw_training() again would say "not the first").
        if untrained and self.watchdog.training_at is not None:
            self._set_phase("training")

    def _stacks(self, state: NodeState, ev: protocol.Stacks) -> None:
        self.stack_nodes.add(state.task.node)
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
        if self.gate.waits_for(ev.node):
            why = "the SSH connection dropped" if state.dropped else f"exit code {ev.code}"
            self.gate.problems[ev.node] = (
                f"the node agent ended before reporting ({why}): {state.last_words()[:200]}")
            self._decide_gate(now)
            self._out.append(NodeDone(ev.node, ev.code))
            return
        if self.gate.refused:
            pass  # the gate failed: agents that never got GO are released, not failures
        elif state.dropped:
            self._fail(state, "connection-dropped", ev.code, now)
        elif ev.code != 0:
            self._fail(state, "exit", ev.code, now)
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
        if self.teardown.begun:
            return  # stopping: a late node's facts start nothing (no GO after a stop)
        result = self.gate.decide(list(self.nodes))
        if result is None:
            return
        if result.ok:
            self._broadcast(Control.GO)
            self._ranks_starting(now)
            return
        for line in folded_lines(result.problems.items(), list(self.nodes)):
            self._say(line)  # "node[1-7]: why": nodes with one problem share a line
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
        if not self.teardown.begun:
            self._set_phase("tearing down")
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
        if ev.name in ("SIGUSR1", "SIGUSR2"):
            self._say(f"forwarding {ev.name} to every node")
            self._broadcast(Control[ev.name[3:]])
            return
        self.interrupts += 1
        if self.interrupts == 1:
            self._say(f"{ev.name}: stopping the job on every node (again to kill at once)")
            self._begin_teardown(now)
        else:
            self._teardown_did(self.teardown.on(teardown.Kill(), now))

    def _tick(self, now: float) -> None:
        if self.gate.timed_out(now, list(self.nodes)):
            self._decide_gate(now)
        self._keepalive(now)
        self._watch(now)
        self._teardown_did(self.teardown.on(teardown.Tick(), now))

    def _keepalive(self, now: float) -> None:
        """PING every agent: its dead-man switch fires only after keepalive_s of silence."""
        if self.job.keepalive_s <= 0 or now < self.next_ping:
            return
        self.next_ping = now + ping_interval(self.job.keepalive_s)
        self._broadcast(Control.PING)

    # ---------------------------------------------------------------- hangs (issue 14)

    def _watch(self, now: float) -> None:
        wd = self.watchdog
        if wd.fired_at is None:
            if self.teardown.begun or self.interrupts or not self._ranks_run():
                return
            why = wd.check(now)
            if why is not None:
                wd.fired_at = now
                self._say(f"{why}: collecting every rank's Python stacks")
                self._broadcast(Control.DUMP)
            return
        if self.stack_summary is None and not self.teardown.begun and (
                self.stack_nodes >= self._live_rank_nodes() or now - wd.fired_at > DUMP_COLLECT_S):
            self._hang_verdict(now)

    def _ranks_run(self) -> bool:
        """Past the gate (if any) and every agent started: only then can a job hang."""
        return self.gate.passed and self.spawned and not self.unstarted

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
        line = self.replica_summary()
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
        wd = self.watchdog
        return JobOutcome(
            exit_code=self.exit_code, failure=self.failure, summary=self.summary,
            node_codes={n: (s.code if s.code is not None else -1) for n, s in self.nodes.items()},
            interrupted=self.interrupts > 0, elapsed_s=elapsed_s, leftovers=leftovers,
            gate=self.gate.result, stacks=self.stack_summary, unconfirmed=list(unconfirmed),
            hang_idle_s=wd.idle(wd.fired_at) if wd.fired_at is not None else None,
            replicas=self.replicas,
        )

    def _say(self, text: str) -> None:
        self._out.append(Info(text))
