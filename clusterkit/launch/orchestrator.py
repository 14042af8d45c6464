"""The launcher side: one agent per node, their lines multiplexed, a job-wide teardown.

``Orchestrator(job, transport).run()`` starts every node's agent in parallel
(``Transport.start``), sends each its spec on stdin, prints their lines as
``[node3 r5] ...`` through a :class:`~clusterkit.launch.console.Sink`, and
watches the agents: the first one that exits non-zero, or whose connection drops,
starts the teardown of the whole job (``TERM`` to every other agent, ``KILL`` when
an agent has not finished after the grace period, then the channel is closed,
which the agent treats as a teardown too: :mod:`clusterkit.launch.teardown`, a pure
state machine this loop feeds and whose actions it performs). SIGINT/SIGTERM to the launcher do the
same; SIGUSR1/SIGUSR2 are forwarded to every agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from clusterkit.contract import SUMMARY_PREFIX
from clusterkit.errors import TransportError
from clusterkit.hostrange import folded_lines
from clusterkit.launch import teardown
from clusterkit.launch.console import PHASES, Sink
from clusterkit.launch.gate import GATE_TIMEOUT_S, GateResult, judge
from clusterkit.launch.stacks import RankStack, StackSummary, read_stack, summarize
from clusterkit.launch.teardown import Teardown
from clusterkit.launch.watchdog import DUMP_COLLECT_S, Watchdog, ping_interval, step_of
from clusterkit.node import protocol
from clusterkit.node.contract import (
    ENV_ZYGOTE,
    ENV_ZYGOTE_IMPORTS,
    JOB_ID_TOKEN,
    JobDir,
    with_job_id,
)
from clusterkit.node.protocol import Control
from clusterkit.node.ship import NodeCommand, agent_command
from clusterkit.remote.base import RemoteProcess, SSHTarget, Transport

TAIL_LINES = 15
# Native launches (issue 15): each node's agent starts a fork server that imports
# these once, then forks the ranks. CLUSTERKIT_ZYGOTE=0 switches it off (each rank
# is its own `python -u ...` again); CLUSTERKIT_ZYGOTE_IMPORTS=a,b names the modules.
ZYGOTE_ENV, ZYGOTE_IMPORTS_ENV = ENV_ZYGOTE, ENV_ZYGOTE_IMPORTS
ZYGOTE_IMPORTS = ("torch", "torch.distributed")
# The bundled workload's own modules (deepspeed stays with the ranks: on a GPU node
# its accelerator probe opens the driver, after which forking is not safe), and
# torch._dynamo: every torch optimizer imports it when it is built (2.1 s of CPU per
# rank, measured on torch 2.13 CPU; no thread, no device). Not for a user's script,
# which may never build an optimizer (the launch bench's does not).
WORKLOAD_IMPORTS = ("torch._dynamo", "clusterkit.workload.main")
_OFF = ("0", "off", "no", "false")


def zygote_imports(task: NodeTask, environ: Mapping[str, str] | None = None) -> list[str]:
    """What the task's fork server imports before forking (empty: no fork server)."""
    env = os.environ if environ is None else environ
    if task.native is None or env.get(ZYGOTE_ENV, "").strip().lower() in _OFF:
        return []
    named = env.get(ZYGOTE_IMPORTS_ENV, "").strip()
    if named:
        return [m.strip() for m in named.split(",") if m.strip()]
    workload = "clusterkit.workload" in task.argv
    return [*ZYGOTE_IMPORTS, *(WORKLOAD_IMPORTS if workload else ())]


def agent_control(python: str, *args: str) -> NodeCommand:
    """The agent's out-of-band modes (``--stop``/``--status``), shipped like the agent."""
    return agent_command(python, list(args))


@dataclass(frozen=True)
class NodeTask:
    """What one node runs. ``argv`` empty: the agent only watches (pdsh peers)."""

    node: str
    target: SSHTarget
    python: str
    argv: tuple[str, ...]
    rank_offset: int
    nprocs: int
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    files: Mapping[str, str] = field(default_factory=dict, hash=False)
    cwd: str | None = None
    prefix: str = "torchrun"  # torchrun | pdsh | single (see agent.Spec.prefix)
    job_dir: str = f"~/.cache/clusterkit/jobs/{JOB_ID_TOKEN}"  # on the node; ~ is the node's home
    rank_log_dir: str | None = None  # per-rank log files to stream (DeepSpeed's launcher)
    native: Mapping[str, Any] | None = None  # the agent starts the ranks (see agent.Spec)
    needs: tuple[str, ...] = ()  # files the gate checks on the node (the user's script)
    # Checkpoint replication (issue 22): AgentSpec.replica for this node, None: off.
    replica: Mapping[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    tasks: tuple[NodeTask, ...]
    attempt: int = 0
    grace_s: float = protocol.DEFAULT_GRACE_S
    # The pre-launch gate folded into the agents (None: no gate): packages every node
    # must have; agents report their facts and start nothing until the launcher's GO.
    gate_need: tuple[str, ...] | None = None
    # Hangs (issue 14): the agents' dead-man switch (0: off) and the progress
    # watchdog (0: off); see clusterkit.launch.watchdog.
    keepalive_s: float = 0.0
    hang_timeout_s: float = 0.0

    def rank_offsets(self) -> dict[str, int]:
        return {t.node: t.rank_offset for t in self.tasks}

    def agent_spec(self, task: NodeTask) -> protocol.AgentSpec:
        return protocol.AgentSpec(
            job_id=self.job_id, node=task.node,
            job_dir=with_job_id(task.job_dir, self.job_id),
            argv=list(task.argv), env=dict(task.env), files=dict(task.files),
            cwd=task.cwd, attempt=self.attempt, prefix=task.prefix,
            rank_offsets=self.rank_offsets(), grace_s=self.grace_s,
            rank_log_dir=task.rank_log_dir,
            native=dict(task.native) if task.native is not None else None,
            hold=self.gate_need is not None, keepalive_s=self.keepalive_s,
            local_ranks=task.nprocs, zygote=zygote_imports(task), needs=list(task.needs),
            replica=dict(task.replica) if task.replica is not None else None,
        )


@dataclass
class RankFailure:
    node: str
    rank: int | None
    local_rank: int | None
    code: int
    reason: str  # "exit" | "connection-dropped" | "start-failed" | "hang"
    tail: list[str] = field(default_factory=list)

    def where(self) -> str:
        return self.node if self.rank is None else f"{self.node} rank {self.rank}"


@dataclass
class JobOutcome:
    exit_code: int
    failure: RankFailure | None
    summary: dict[str, Any] | None
    node_codes: dict[str, int]
    interrupted: bool
    elapsed_s: float
    leftovers: dict[str, int] = field(default_factory=dict)  # node -> processes still found
    gate: GateResult | None = None  # set when the folded gate ran; not ok: nothing started
    stacks: StackSummary | None = None  # the watchdog fired: where every rank was
    unconfirmed: list[str] = field(default_factory=list)  # nodes whose teardown we could not check
    hang_idle_s: float | None = None


@dataclass
class _Node:
    task: NodeTask
    proc: RemoteProcess | None = None
    code: int | None = None
    dropped: bool = False
    failed_rank: protocol.RankFailed | None = None
    started: bool = False  # its agent reported "started" (its ranks run)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    rank_tails: dict[int, deque[str]] = field(default_factory=dict)


def exit_status(code: int) -> int:
    """A rank killed by signal N reports -N; a shell would say 128+N."""
    return 128 - code if code < 0 else code


class Orchestrator:
    def __init__(self, job: JobSpec, transport: Transport, sink: Sink,
                 *, start_timeout_s: float = 60.0, stacks_dir: str | None = None) -> None:
        self.job = job
        self.transport = transport
        self.sink = sink
        self.start_timeout_s = start_timeout_s
        self.nodes = {t.node: _Node(t) for t in job.tasks}
        self._q: queue.Queue[tuple[str, str, Any]] = queue.Queue()
        self._failure: RankFailure | None = None
        self._teardown = Teardown(job.grace_s)  # pure: this loop feeds it and acts
        self._interrupts = 0
        self._pending_signals: list[str] = []
        self._summary: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._facts: dict[str, dict[str, object]] = {}
        self._gate_problems: dict[str, str] = {}
        self._gate: GateResult | None = None
        self._gate_started = 0.0
        self._gate_last = 0.0  # when the latest node reported its facts
        self._watchdog = Watchdog(job.hang_timeout_s, time.monotonic())
        self._next_ping = 0.0
        self._stacks: dict[int, RankStack] = {}
        self._stack_nodes: set[str] = set()
        self._stack_summary: StackSummary | None = None
        self._stacks_dir = stacks_dir  # launcher side copy of the dumps (None: nodes only)
        self._unconfirmed: list[str] = []
        self._phase = -1  # index into console.PHASES: the status line only moves forward

    # -------------------------------------------------------------- public

    def run(self, *, install_signals: bool = True) -> JobOutcome:
        started = time.monotonic()
        restore = self._install_signals() if install_signals else {}
        try:
            self._start_all()
            self._loop()
        finally:
            for sig, handler in restore.items():
                signal.signal(sig, handler)
            self.sink.end_attempt()  # the collateral line, once every rank line is in
        gate_failed = self._gate is not None and not self._gate.ok  # nothing was started
        leftovers = self._verify_gone() if (self._failure or self._interrupts) and not gate_failed \
            else {}
        return JobOutcome(
            exit_code=self._exit_code(), failure=self._failure, summary=self._summary,
            node_codes={n: (s.code if s.code is not None else -1) for n, s in self.nodes.items()},
            interrupted=self._interrupts > 0, elapsed_s=time.monotonic() - started,
            leftovers=leftovers, gate=self._gate, stacks=self._stack_summary,
            unconfirmed=list(self._unconfirmed),
            hang_idle_s=self._watchdog.idle(self._watchdog.fired_at)
            if self._watchdog.fired_at is not None else None,
        )

    # -------------------------------------------------------------- start

    def _start_one(self, state: _Node) -> None:
        task = state.task
        # The agent's sources and its spec travel on the session's stdin: the node
        # needs only a Python (see clusterkit.node.ship).
        cmd = agent_command(task.python, spec=self.job.agent_spec(task))
        try:
            proc = self.transport.start(task.target, cmd.argv)
            proc.write_stdin(cmd.stdin)
        except TransportError as exc:
            self._q.put(("start-failed", task.node, exc.one_line()))
            return
        state.proc = proc
        threading.Thread(target=self._read, args=(state, proc), daemon=True,
                         name=f"clusterkit-launch-{task.node}").start()

    def _start_all(self) -> None:
        self.sink.info(f"job {self.job.job_id}: starting {len(self.nodes)} node agents"
                       + (f" (attempt {self.job.attempt + 1})" if self.job.attempt else ""))
        self._set_phase("connecting", f"attempt {self.job.attempt + 1}" if self.job.attempt
                        else "")
        self._gate_started = time.monotonic()
        with ThreadPoolExecutor(max_workers=min(64, len(self.nodes))) as pool:
            list(pool.map(self._start_one, self.nodes.values()))
        if self.job.gate_need is None:  # no gate: the agents start their ranks at once
            self._ranks_starting()

    def _ranks_starting(self) -> None:
        self._watchdog.begin(time.monotonic())
        # Native launches fork the ranks once each node's fork server has imported
        # torch (10 s on a loaded machine): say so, or the phase looks stuck.
        imports = next((m for m in map(zygote_imports, self.job.tasks) if m), [])
        self._set_phase("starting ranks", f"(fork servers import {imports[0]})" if imports
                        else "")

    def _set_phase(self, name: str, detail: str = "") -> None:
        """Tell the console where the job is (forward only; a detail may change)."""
        index = PHASES.index(name)
        if index >= self._phase:
            self._phase = index
            self.sink.phase(name, detail)

    def _training_seen(self) -> None:
        if self._watchdog.saw_training(time.monotonic()):
            self._set_phase("training")

    def _read(self, state: _Node, proc: RemoteProcess) -> None:
        for stream, line in proc.lines():
            self._q.put(("line", state.task.node, (stream, line)))
        try:
            code = proc.wait(timeout=30.0)
        except TimeoutError:
            code = -1
        self._q.put(("exit", state.task.node, (code, bool(getattr(proc, "dropped", False)))))

    # -------------------------------------------------------------- main loop

    def _loop(self) -> None:
        while any(s.code is None for s in self.nodes.values()):
            try:
                kind, node, payload = self._q.get(timeout=0.1)
            except queue.Empty:
                kind = ""
            if kind == "line":
                self._on_line(self.nodes[node], *payload)
            elif kind == "exit":
                self._on_exit(self.nodes[node], *payload)
            elif kind == "start-failed":
                self._on_start_failed(self.nodes[node], payload)
            self._handle_signals()
            self._gate_timeout()
            self._keepalive()
            self._watch()
            self._advance_teardown()
        # Lines still queued after the last exit (reader threads are done).
        while not self._q.empty():
            kind, node, payload = self._q.get_nowait()
            if kind == "line":
                self._on_line(self.nodes[node], *payload)

    def _on_line(self, state: _Node, stream: str, line: str) -> None:
        try:
            msg = protocol.decode(line)
        except protocol.ProtocolError as exc:
            self.sink.info(f"{state.task.node}: unreadable agent event: {exc}")
            return
        if isinstance(msg, protocol.Line):
            self._on_output(state, msg)
        elif msg is not None:
            self._on_event(state, msg)
        else:
            # The agent itself (a traceback, a python that cannot find clusterkit).
            state.tail.append(line)
            self.sink.line(state.task.node, None, line, agent=True)

    def _on_output(self, state: _Node, msg: protocol.Line) -> None:
        node, text = msg.node, msg.text
        rank = msg.rank(self.job.rank_offsets(), state.task.rank_offset)
        self._record_tail(self.nodes.get(node, state), rank, text)
        if rank is not None:  # a rank's line is progress, a step line a sign of training
            self._watchdog.output(node, time.monotonic())
            if step_of(text) is not None:
                self._training_seen()
        if text.startswith(SUMMARY_PREFIX) and (self._summary is None or rank == 0):
            self._summary = _parse_json(text[len(SUMMARY_PREFIX):])
        self.sink.line(node, rank, text)

    def _record_tail(self, state: _Node, rank: int | None, text: str) -> None:
        state.tail.append(text if rank is None else f"r{rank}: {text}")
        if rank is not None:
            state.rank_tails.setdefault(rank, deque(maxlen=TAIL_LINES)).append(text)

    def _on_event(self, state: _Node, ev: protocol.AgentEvent) -> None:
        if isinstance(ev, protocol.RankFailed):
            target = self.nodes.get(ev.failed_node, state)
            if target.failed_rank is None:
                target.failed_rank = ev
            if state.failed_rank is None:
                state.failed_rank = ev
            # The earliest report names the culprit and starts the teardown now, before
            # the other ranks fail in their collectives and their agents exit too.
            self._fail(state, "exit", ev.code or 1)
        elif isinstance(ev, protocol.Facts):
            self._facts[state.task.node] = dict(ev.facts)
            self._gate_last = time.monotonic()
            self._set_phase("gate", f"{len(self._facts)}/{len(self.nodes)} nodes")
            self._decide_gate()
        elif isinstance(ev, protocol.Started):
            self.sink.node_up(state.task.node)
            state.started = True
            if all(s.started for s in self.nodes.values()):
                self._set_phase("initialising")
        elif isinstance(ev, protocol.Progress):
            self._watchdog.report(state.task.node, {"idle_s": ev.idle_s, "step": ev.step},
                                  time.monotonic())
            if self._watchdog.last_step() is not None:
                self._training_seen()
        elif isinstance(ev, protocol.Stacks):
            self._on_stacks(state, ev)
        elif isinstance(ev, protocol.Error):
            self.sink.info(f"{state.task.node}: agent error: {ev.message}")

    def _on_exit(self, state: _Node, code: int, dropped: bool) -> None:
        state.code = code
        state.dropped = dropped or code == -1
        if self._gate_open(state):
            why = "the SSH connection dropped" if state.dropped else f"exit code {code}"
            last = next((ln for ln in reversed(state.tail) if ln.strip()), "no output")
            self._gate_problems[state.task.node] = (
                f"the node agent ended before reporting ({why}): {last.strip()[:200]}")
            self._decide_gate()
            self.sink.node_done(state.task.node, code)
            return
        if self._gate is not None and not self._gate.ok:
            pass  # the gate failed: agents that never got GO are released, not failures
        elif state.dropped:
            self._fail(state, "connection-dropped", code)
        elif code != 0:
            self._fail(state, "exit", code)
        self.sink.node_done(state.task.node, code)
        self._release_watchers()

    def _release_watchers(self) -> None:
        """Every launcher finished: the watch-only agents (pdsh peers) sweep and exit."""
        launchers = [s for s in self.nodes.values() if s.task.argv]
        if any(s.code is None for s in launchers):
            return
        for s in self.nodes.values():
            if not s.task.argv and s.code is None and s.proc is not None:
                s.proc.close_stdin()

    def _on_start_failed(self, state: _Node, message: str) -> None:
        state.code = -1
        state.tail.append(message)
        if self._gate_open(state):
            self._gate_problems[state.task.node] = message
            self._decide_gate()
            return
        self.sink.info(f"{state.task.node}: could not start the agent: {message}")
        self._fail(state, "start-failed", -1)

    # -------------------------------------------------------------- the folded gate

    def _gate_open(self, state: _Node) -> bool:
        """True while the gate is undecided and this node has not reported yet."""
        return (self.job.gate_need is not None and self._gate is None
                and state.task.node not in self._facts)

    def _decide_gate(self) -> None:
        if self.job.gate_need is None or self._gate is not None:
            return
        if any(n not in self._facts and n not in self._gate_problems for n in self.nodes):
            return
        self._gate = judge(self._facts, self._gate_problems, list(self.nodes),
                           self.job.gate_need)
        if self._gate.ok:
            self._broadcast(Control.GO)
            self._ranks_starting()
            return
        for line in folded_lines(self._gate.problems.items(), list(self.nodes)):
            self.sink.info(line)  # "node[1-7]: why": nodes with one problem share a line
        self._begin_teardown()  # the holding agents exit without starting anything

    def _gate_timeout(self) -> None:
        if self.job.gate_need is None or self._gate is not None:
            return
        # Silence, not slowness, is the failure: while nodes keep reporting (32 agents
        # starting at once on a loaded machine took > 20 s in all) the wait goes on;
        # GATE_TIMEOUT_S after the start or the latest report, the missing ones fail.
        if time.monotonic() - max(self._gate_started, self._gate_last) < GATE_TIMEOUT_S:
            return
        for n in self.nodes:
            if n not in self._facts:
                self._gate_problems.setdefault(
                    n, f"the node agent did not report within {GATE_TIMEOUT_S:.0f} s")
        self._decide_gate()

    # -------------------------------------------------------------- failure + teardown

    def _fail(self, state: _Node, reason: str, code: int) -> None:
        if self._failure is None and not self._interrupts:
            ev = state.failed_rank or protocol.RankFailed(state.task.node, code=0)
            if state.failed_rank is None and state.task.nprocs == 1 and reason == "exit":
                # One rank on the node: the launcher's exit is that rank's.
                ev = protocol.RankFailed(state.task.node, rank=state.task.rank_offset,
                                         local_rank=0, code=0)
            failed_node = self.nodes.get(ev.failed_node, state)
            rank = ev.rank
            tail = list(failed_node.rank_tails.get(rank, failed_node.tail)) if rank is not None \
                else list(failed_node.tail)
            self._failure = RankFailure(
                node=failed_node.task.node, rank=rank, local_rank=ev.local_rank,
                code=ev.code or code, reason=reason, tail=tail,
            )
            if rank is not None:  # the other ranks' tracebacks that follow are collateral
                # (before info(), which lets out the lines still in their fold window)
                self.sink.failed_first(rank, self._failure.where(), self._rank_logs())
            self.sink.info(f"{self._failure.where()} failed ({_describe(self._failure)}): "
                           "stopping the job on every node")
        self._begin_teardown()

    def _rank_logs(self) -> str:
        """Where every rank's output is kept (the agents' per-rank logs)."""
        dirs = {with_job_id(t.job_dir, self.job.job_id) for t in self.job.tasks}
        job_dir = dirs.pop() if len(dirs) == 1 else "<job dir>"
        return JobDir(job_dir).node_log("<node>", "<N>")

    def _begin_teardown(self) -> None:
        if not self._teardown.begun:
            self._set_phase("tearing down")
        self._perform(self._teardown.on(teardown.Begin(), time.monotonic()))

    def _perform(self, actions: list[teardown.Action]) -> None:
        """Carry out what the teardown state machine decided."""
        for action in actions:
            if isinstance(action, teardown.Send):
                self._broadcast(action.word)
            elif isinstance(action, teardown.CloseChannels):
                # Closing the channel makes the agent see EOF; it sweeps on its own.
                for state in self.nodes.values():
                    if state.proc is not None and state.code is None:
                        state.proc.close_stdin()
                        state.proc.terminate()
            else:  # GiveUp
                for state in self.nodes.values():
                    if state.code is None:
                        state.code, state.dropped = -1, True

    def _broadcast(self, command: protocol.Control) -> None:
        for state in self.nodes.values():
            if state.proc is not None and state.code is None:
                # A gone connection raises; its agent tears down on EOF by itself.
                with contextlib.suppress(TransportError):
                    state.proc.write_stdin(command.line())

    def _advance_teardown(self) -> None:
        self._perform(self._teardown.on(teardown.Tick(), time.monotonic()))

    # -------------------------------------------------------------- hangs (issue 14)

    def _keepalive(self) -> None:
        """PING every agent: its dead-man switch fires only after keepalive_s of silence."""
        if self.job.keepalive_s <= 0 or time.monotonic() < self._next_ping:
            return
        self._next_ping = time.monotonic() + ping_interval(self.job.keepalive_s)
        self._broadcast(Control.PING)

    def _watch(self) -> None:
        now = time.monotonic()
        wd = self._watchdog
        if wd.fired_at is None:
            if self._teardown.begun or self._interrupts or not self._running():
                return
            why = wd.check(now)
            if why is not None:
                wd.fired_at = now
                self.sink.info(f"{why}: collecting every rank's Python stacks")
                self._broadcast(Control.DUMP)
            return
        if self._stack_summary is None and not self._teardown.begun and (
                self._stack_nodes >= self._live_nodes() or now - wd.fired_at > DUMP_COLLECT_S):
            self._hang_verdict()

    def _running(self) -> bool:
        """Past the gate (if any) and every agent started: only then can a job hang."""
        gate_passed = self.job.gate_need is None or (self._gate is not None and self._gate.ok)
        return gate_passed and all(s.proc is not None for s in self.nodes.values())

    def _live_nodes(self) -> set[str]:
        return {n for n, s in self.nodes.items() if s.code is None and s.task.nprocs > 0}

    def _on_stacks(self, state: _Node, ev: protocol.Stacks) -> None:
        self._stack_nodes.add(state.task.node)
        for key, res in ev.ranks.items():
            if not (isinstance(res, dict) and str(key).isdigit()):
                continue
            rank = int(key)
            self._stacks[rank] = read_stack(rank, state.task.node, str(res.get("text", "")),
                                            state=str(res.get("state", "")),
                                            tool=str(res.get("tool", "")))

    def _hang_verdict(self) -> None:
        world = sum(t.nprocs for t in self.job.tasks)
        summary = summarize(self._stacks, world)
        self._stack_summary = summary
        saved = self._save_stacks()
        self.sink.info("stacks of every rank" + (f" (full dumps in {saved})" if saved else "")
                       + ":")
        for line in summary.lines():
            self.sink.info(line)
        culprit = summary.culprit()
        node, rank = culprit if culprit else (self.job.tasks[0].node, None)
        state = self.nodes[node]
        state.failed_rank = protocol.RankFailed(
            node, failed_node=node, rank=rank,
            local_rank=None if rank is None else rank - state.task.rank_offset, code=124)
        self._fail(state, "hang", 124)

    def _save_stacks(self) -> str | None:
        if not self._stacks_dir or not self._stacks:
            return None
        from pathlib import Path

        from clusterkit.fsutil import atomic_write_text

        root = Path(self._stacks_dir) / f"a{self.job.attempt}"
        try:
            for rank, st in sorted(self._stacks.items()):
                atomic_write_text(root / f"rank{rank}.txt",
                                  f"# node {st.node} rank {rank} state {st.state} via {st.tool}\n"
                                  + st.text)
            if self._stack_summary is not None:
                atomic_write_text(root / "summary.txt",
                                  "\n".join(self._stack_summary.lines()) + "\n")
        except OSError as exc:
            self.sink.info(f"could not save the stacks in {root}: {exc}")
            return None
        return str(root)

    # -------------------------------------------------------------- signals

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        old: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only record it: the loop acts within 0.1 s, outside the handler.
        with self._lock:
            self._pending_signals.append(signal.Signals(signum).name)

    def _handle_signals(self) -> None:
        with self._lock:
            pending, self._pending_signals = self._pending_signals, []
        for name in pending:
            if name in ("SIGUSR1", "SIGUSR2"):
                self.sink.info(f"forwarding {name} to every node")
                self._broadcast(Control[name[3:]])
                continue
            self._interrupts += 1
            if self._interrupts == 1:
                self.sink.info(f"{name}: stopping the job on every node "
                               f"(again to kill at once)")
                self._begin_teardown()
            else:
                self._perform(self._teardown.on(teardown.Kill(), time.monotonic()))

    # -------------------------------------------------------------- results

    def _verify_gone(self) -> dict[str, int]:
        """Nodes whose agent did not exit cleanly: sweep the job there out of band."""
        suspects = [s.task for s in self.nodes.values() if s.dropped or s.code is None]
        if not suspects:
            return {}
        cmds = {t.node: agent_control(t.python, "--stop", self.job.job_id, "--node", t.node,
                                      "--grace", "2") for t in suspects}
        results = self.transport.run_all([t.target for t in suspects],
                                         {n: c.argv for n, c in cmds.items()}, timeout=20.0,
                                         stdin=next(iter(cmds.values())).stdin)
        left: dict[str, int] = {}
        for r in results:
            if r.ok and r.result is not None:
                counts = _parse_json(r.result.stdout.strip().splitlines()[-1]) or {}
                if counts.get("left"):
                    left[r.host] = int(counts["left"])
            else:
                self._unconfirmed.append(r.host)
                self.sink.info(f"{r.host}: could not verify the teardown: "
                               f"{r.error.one_line() if r.error else 'exit != 0'}"
                               + (f" (its agent stops its ranks by itself within "
                                  f"{self.job.keepalive_s:g} s of losing the launcher)"
                                  if self.job.keepalive_s > 0 else ""))
        return left

    def _exit_code(self) -> int:
        if self._gate is not None and not self._gate.ok:
            return 2
        if self._failure is not None:
            return exit_status(self._failure.code) or 1
        if self._interrupts:
            return 130
        return 0


def _parse_json(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _describe(f: RankFailure) -> str:
    if f.reason == "connection-dropped":
        return "the SSH connection dropped"
    if f.reason == "start-failed":
        return "the agent could not be started"
    if f.reason == "hang":
        return "no progress: the watchdog's stack summary names it"
    if f.code < 0:
        try:
            return f"killed by {signal.Signals(-f.code).name}"
        except ValueError:
            return f"killed by signal {-f.code}"
    return f"exit code {f.code}"


def describe_failure(f: RankFailure) -> str:
    return _describe(f)
