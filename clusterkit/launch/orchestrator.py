"""The launcher's I/O loop: one agent per node, their lines multiplexed, a job-wide teardown.

``Orchestrator(job, transport, sink).run()`` starts every node's agent in parallel
(``Transport.start``), sends each its spec on stdin, and then only carries events
and actions between the world and :class:`~clusterkit.launch.runtime.Runtime`,
the pure state machine that decides everything (the gate, the failure, the
watchdog, the phases, the teardown: the table in docs/architecture.md). Its
inputs: every agent's stdout lines and the end of its session (one reader thread
per agent, through a queue), the start results, SIGINT/SIGTERM/SIGUSR1/SIGUSR2
(recorded by the handler, fed by the loop), and a tick at least every 0.1 s.
Its outputs: control words on the agents' stdin, closed channels, console lines
through the :class:`~clusterkit.launch.console.Sink`, the stack dumps on disk, and
at the end an out-of-band sweep of the nodes whose agent did not end cleanly.

``NodeTask``/``JobSpec`` (launch/jobspec.py) and ``JobOutcome``/``RankFailure``
(launch/outcome.py) are re-exported here: most callers know this module.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

from clusterkit.errors import TransportError
from clusterkit.fsutil import atomic_write_text
from clusterkit.launch.console import Sink
from clusterkit.launch.jobspec import JobSpec, NodeTask, zygote_imports
from clusterkit.launch.outcome import JobOutcome
from clusterkit.launch.recording import recorder
from clusterkit.launch.runtime import Runtime
from clusterkit.launch.runtime_io import (
    Action,
    AgentEnded,
    Close,
    Drained,
    Event,
    FailedFirst,
    Finish,
    Info,
    NodeDone,
    NodeUp,
    Phase,
    ReportStacks,
    Send,
    Show,
    Signalled,
    Spawned,
    Starting,
    Tick,
    read_line,
)
from clusterkit.launch.runtime_state import Stage
from clusterkit.node.protocol import ProtocolError, StopReply
from clusterkit.remote.base import RemoteProcess, Transport
from clusterkit.ship import NodeCommand, agent_command

__all__ = ["Orchestrator", "agent_control", "show"]

TICK_S = 0.1  # the longest the loop waits for an input before it feeds a Tick


def agent_control(python: str, *args: str) -> NodeCommand:
    """The agent's out-of-band modes (``--stop``/``--status``), shipped like the agent."""
    return agent_command(python, list(args))


class Orchestrator:
    def __init__(self, job: JobSpec, transport: Transport, sink: Sink,
                 *, start_timeout_s: float = 60.0, stacks_dir: str | None = None) -> None:
        self.job = job
        self.transport = transport
        self.sink = sink
        self.start_timeout_s = start_timeout_s
        imports = next((m for m in map(zygote_imports, job.tasks) if m), [])
        self.runtime = Runtime(job, time.monotonic(), fork_import=imports[0] if imports else "")
        self._rec = recorder()  # CLUSTERKIT_RECORD_AGENTS: the inputs on file (launch/recording.py)
        if self._rec is not None:
            self._rec.attempt(job, imports[0] if imports else "")
        self._procs: dict[str, RemoteProcess] = {}
        self._q: queue.Queue[Event] = queue.Queue()
        self._lock = threading.Lock()
        self._pending_signals: list[signal.Signals] = []
        self._stacks_dir = stacks_dir  # launcher side copy of the dumps (None: nodes only)
        self._sweep: tuple[str, ...] = ()
        self._unconfirmed: list[str] = []

    def run(self, *, install_signals: bool = True) -> JobOutcome:
        started = time.monotonic()
        restore = self._install_signals() if install_signals else {}
        try:
            self._feed(Starting())
            self._start_all()
            self._loop()
            self._feed(Drained())
        finally:
            for sig, handler in restore.items():
                signal.signal(sig, handler)
            self.sink.end_attempt()  # the collateral line, once every rank line is in
            if self._rec is not None:
                self._rec.end_attempt()
        leftovers = self._verify_gone(self._sweep)
        return self.runtime.outcome(time.monotonic() - started, leftovers, self._unconfirmed)

    def _feed(self, event: Event) -> None:
        if self._rec is not None:
            self._rec.event(event)
        for action in self.runtime.on(event, time.monotonic()):
            self._perform(action)

    # -------------------------------------------------------------- inputs

    def _start_all(self) -> None:
        with ThreadPoolExecutor(max_workers=min(64, len(self.job.tasks))) as pool:
            errors = list(pool.map(self._start_one, self.job.tasks))
        self._feed(Spawned({t.node: e for t, e in zip(self.job.tasks, errors, strict=True)
                            if e is not None}))

    def _start_one(self, task: NodeTask) -> str | None:
        """Start one agent and its reader thread; the error line when it cannot start."""
        # The agent's sources and its spec travel on the session's stdin: the node
        # needs only a Python (see clusterkit.ship).
        cmd = agent_command(task.python, spec=self.job.agent_spec(task))
        try:
            proc = self.transport.start(task.target, cmd.argv)
            proc.write_stdin(cmd.stdin)
        except TransportError as exc:
            return exc.one_line()
        self._procs[task.node] = proc
        threading.Thread(target=self._read, args=(task.node, proc), daemon=True,
                         name=f"clusterkit-launch-{task.node}").start()
        return None

    def _read(self, node: str, proc: RemoteProcess) -> None:
        for _stream, line in proc.lines():
            self._q.put(read_line(node, line))
        try:
            code = proc.wait(timeout=30.0)
        except TimeoutError:
            code = -1
        self._q.put(AgentEnded(node, code, bool(getattr(proc, "dropped", False))))

    def _loop(self) -> None:
        """Each turn: the next queued input (waiting at most TICK_S), signals, a Tick."""
        while self.runtime.stage is not Stage.FINISHED:
            queued = self._next(TICK_S)
            if queued is not None:
                self._feed(queued)
            with self._lock:
                pending, self._pending_signals = self._pending_signals, []
            for sig in pending:
                self._feed(Signalled(sig))
            self._feed(Tick())
        # Lines still queued after the last exit (reader threads are done).
        while (queued := self._next(None)) is not None:
            if not isinstance(queued, AgentEnded):
                self._feed(queued)

    def _next(self, wait_s: float | None) -> Event | None:
        """The next input from the reader threads; None when none came within ``wait_s``
        (``wait_s`` None: when none is queued now)."""
        try:
            return self._q.get(timeout=wait_s) if wait_s is not None else self._q.get_nowait()
        except queue.Empty:
            return None

    # -------------------------------------------------------------- outputs

    def _perform(self, action: Action) -> None:
        """Carry out one of the runtime's decisions."""
        if isinstance(action, Send):
            for node in action.nodes:
                if node in self._procs:
                    # A gone connection raises; its agent tears down on EOF by itself.
                    with contextlib.suppress(TransportError):
                        self._procs[node].write_stdin(action.word.line())
        elif isinstance(action, Close):
            for node in action.nodes:
                if node in self._procs:
                    self._procs[node].close_stdin()
                    if action.terminate:
                        self._procs[node].terminate()
        elif isinstance(action, ReportStacks):
            self._report_stacks(action)
        elif isinstance(action, Finish):
            self._sweep = action.sweep
        else:
            self._show(action)

    def _show(self, action: Info | Show | Phase | NodeUp | NodeDone | FailedFirst) -> None:
        show(self.sink, action)

    def _report_stacks(self, action: ReportStacks) -> None:
        saved = self._save_stacks(action)
        self.sink.info("stacks of every rank" + (f" (full dumps in {saved})" if saved else "")
                       + ":")
        for line in action.summary.lines():
            self.sink.info(line)

    def _save_stacks(self, action: ReportStacks) -> str | None:
        if not self._stacks_dir or not action.stacks:
            return None
        root = Path(self._stacks_dir) / f"a{self.job.attempt}"
        try:
            for rank, st in sorted(action.stacks.items()):
                atomic_write_text(root / f"rank{rank}.txt",
                                  f"# node {st.node} rank {rank} state {st.state} via {st.tool}\n"
                                  + st.text)
            atomic_write_text(root / "summary.txt", "\n".join(action.summary.lines()) + "\n")
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
        # Only record it: the loop feeds it to the runtime within TICK_S, outside the handler.
        with self._lock:
            self._pending_signals.append(signal.Signals(signum))

    # -------------------------------------------------------------- the sweep

    def _verify_gone(self, sweep: tuple[str, ...]) -> dict[str, int]:
        """Nodes whose agent did not exit cleanly: sweep the job there out of band."""
        suspects = [t for t in self.job.tasks if t.node in sweep]
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
                try:
                    reply = StopReply.from_stdout(r.result.stdout)
                except ProtocolError:
                    reply = StopReply()  # no reply line: nothing known to be left
                if reply.left:
                    left[r.host] = reply.left
            else:
                self._unconfirmed.append(r.host)
                self.sink.info(f"{r.host}: could not verify the teardown: "
                               f"{r.error.one_line() if r.error else 'exit != 0'}"
                               + (f" (its agent stops its ranks by itself within "
                                  f"{self.job.keepalive_s:g} s of losing the launcher)"
                                  if self.job.keepalive_s > 0 else ""))
        return left


def show(sink: Sink, action: Info | Show | Phase | NodeUp | NodeDone | FailedFirst) -> None:
    """The console's part of the actions (also a recorded launch's replay: launch/recording.py)."""
    if isinstance(action, Info):
        sink.info(action.text)
    elif isinstance(action, Show):
        sink.line(action.node, action.rank, action.text, agent=action.agent)
    elif isinstance(action, Phase):
        sink.phase(action.name, action.detail)
    elif isinstance(action, NodeUp):
        sink.node_up(action.node)
    elif isinstance(action, NodeDone):
        sink.node_done(action.node, action.code)
    else:
        sink.failed_first(action.rank, action.where, action.logs)
