"""The agent's replication service: watch, push, record, and the end of a job (issue 22).

Part of the node agent (node program ``agent.core``, ``ship.py``), run in the agent's
copy process (``node/replicas/proc.py``; under Slurm by ``slurm.replica serve``). Built from
``AgentSpec.replica`` (:data:`REPLICA_KEYS`; the launcher's ``launch/fromplan.py``
fills it). It runs this node's :class:`~clusterkit.node.replicas.wire.ReplicaServer` and one
low-priority thread that polls the checkpoint dir (``node/replicas/done.py``'s
completion rule) and pushes each finished tag to its targets, one copy at a time, with
bounded retries. Each finished copy is a ``Replica`` event and a line in
``<job dir>/nodes/<node>/replicas.json`` (tag -> target -> state).

At the end of a job that ended well (:meth:`ReplicaService.finish`) it pushes what is
still due (bounded), says BYE to its targets and keeps its server up until its sources
said BYE (bounded); after a failure or a stop (:meth:`ReplicaService.abort`) it stops
at once: a copy cut short leaves a partial dir that is never read and is swept by the
next server start.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from clusterkit.node import protocol
from clusterkit.node.files import write_atomic
from clusterkit.node.replicas.done import STABLE_S, CompletionWatch
from clusterkit.node.replicas.wire import (
    ReplicaError,
    ReplicaServer,
    low_priority,
    push,
    say_bye,
)

# AgentSpec.replica: this node's index and address, its checkpoint dir, its global
# ranks, whether the job writes completion markers, its targets ([{node, index,
# address}]), the indexes of its sources, and the per-run secret (never on argv).
REPLICA_KEYS = ("index", "address", "ckpt_dir", "ranks", "markers", "targets", "sources",
                "secret")
POLL_S = 1.5
MAX_TRIES = 5  # per tag and target; then the copy is reported failed for good
FINISH_PUSH_S = 300.0  # the end of a job: how long outstanding pushes may take
FINISH_SOURCES_S = 300.0  # ... and how long the server waits for its sources' BYE


def check_config(cfg: dict[str, Any]) -> None:
    """``AgentSpec.replica`` has every key, and only these (a version mismatch)."""
    keys = set(cfg)
    if keys != set(REPLICA_KEYS):
        raise ValueError("AgentSpec.replica keys: expected %s, got %s"  # noqa: UP031
                         % (", ".join(REPLICA_KEYS), ", ".join(sorted(keys))))


class ReplicaService:
    """One node's replication: its server, its watcher/pusher thread, its record."""

    def __init__(self, cfg: dict[str, Any], job_id: str, node: str, state_path: str,
                 send: Callable[[protocol.AgentEvent], None],
                 log: Callable[[str], None]) -> None:
        check_config(cfg)
        self.cfg, self.job_id, self.node = cfg, job_id, node
        self.index = int(cfg["index"])
        self.ckpt_dir = str(cfg["ckpt_dir"])
        self.targets: list[dict[str, Any]] = list(cfg["targets"])
        self.state_path = state_path
        self.send, self.log = send, log
        self.server = ReplicaServer(job_id, self.index, node, self.ckpt_dir, str(cfg["secret"]),
                                    address=str(cfg["address"]), sources=cfg["sources"], log=log)
        self.watch = CompletionWatch(self.ckpt_dir, self.index, cfg["ranks"], job_id,
                                     bool(cfg["markers"]))
        self.state: dict[str, dict[str, str]] = {}  # tag -> target node -> state
        self._tries: dict[tuple[str, str], tuple[int, float]] = {}  # -> (tries, next time)
        self._stop = threading.Event()
        self._finishing: float | None = None
        self._idle = threading.Event()  # a pass with nothing due after finish() began
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """The server and the pusher; a node that cannot serve runs without replicas."""
        try:
            port = self.server.start()
        except (ReplicaError, OSError) as exc:
            self.send(protocol.Error(self.node, message=f"checkpoint replication is off on "
                                                        f"this node: {exc}"))
            return  # no pusher either; finish() still says BYE, so no peer waits for us
        self.log(f"replica: node index {self.index} serving on port {port}; pushing to "
                 + (", ".join(t["node"] for t in self.targets) or "nobody"))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def abort(self) -> None:
        """After a failure or a stop: drop everything now (partials are swept later)."""
        self._stop.set()
        self._idle.set()  # a finish() waiting on the pushes returns now
        self.server.stop()

    def end(self, ok: bool) -> None:
        """The agent's end: :meth:`finish` after the ranks exited 0, else :meth:`abort`."""
        if ok and not self._stop.is_set():
            self.finish()
        else:
            self.abort()

    def finish(self, push_s: float = FINISH_PUSH_S, sources_s: float = FINISH_SOURCES_S) -> None:
        """The ranks exited 0: push what is due, BYE the targets, wait for the sources."""
        self._finishing = time.monotonic()
        t0 = time.monotonic()
        if self._thread is not None and not self._idle.wait(push_s):
            self.log(f"replica: outstanding copies not done after {push_s:g} s; stopping them")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for target in self.targets:
            try:
                say_bye(target, self.job_id, self.index, str(self.cfg["secret"]))
            except (ReplicaError, OSError) as exc:
                self.log(f"replica: BYE to {target['node']} failed: {exc}")
        if self.server.sock is not None and not self.server.wait_sources(sources_s):
            missing = sorted(self.server.sources - self.server.byes)
            self.log(f"replica: no BYE from node index(es) {missing} after {sources_s:g} s")
        self.server.stop()
        self.log(f"replica: finished in {time.monotonic() - t0:.1f} s")

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        low_priority(self.log, self.ckpt_dir)
        while not self._stop.is_set():
            began = time.monotonic()
            due = self._due()
            if due:
                tag, target = due[0]
                self._copy(tag, target)
                continue
            # Idle only after a whole pass that began once finish() was called: a tag
            # completed just before it must not be missed.
            if self._finishing is not None and self._finishing < began and self._settled():
                self._idle.set()
            self._stop.wait(POLL_S)

    def _settled(self) -> bool:
        """After finish(): the no-marker rule had time to see every tag stable."""
        assert self._finishing is not None
        waiting = any(1 for (_, _), (n, t) in self._tries.items()
                      if n < MAX_TRIES and t > time.monotonic())
        return not waiting and time.monotonic() - self._finishing > (
            0.0 if self.cfg["markers"] else STABLE_S + POLL_S)

    def _due(self) -> list[tuple[str, str]]:
        """(tag, target) pairs to push now, oldest tag first."""
        out = []
        now = time.monotonic()
        for tag in self.watch.tags():
            todo = [t for t in self.targets
                    if self.state.get(tag, {}).get(t["node"]) != "complete"
                    and self._tries.get((tag, t["node"]), (0, 0.0))[0] < MAX_TRIES
                    and self._tries.get((tag, t["node"]), (0, 0.0))[1] <= now]
            if todo and self.watch.complete(tag):
                out += [(tag, t["node"]) for t in todo]
        return out

    def _copy(self, tag: str, target_node: str) -> None:
        target = next(t for t in self.targets if t["node"] == target_node)
        t0, c0 = time.monotonic(), time.thread_time()
        tries = self._tries.get((tag, target_node), (0, 0.0))[0] + 1
        try:
            sent = push(self.ckpt_dir, tag, target, job_id=self.job_id, source=self.index,
                        source_host=self.node, secret=str(self.cfg["secret"]),
                        tags=self.watch.tags(), stop=self._stop)
        except (ReplicaError, OSError, ValueError) as exc:
            again = tries < MAX_TRIES and not self._stop.is_set()
            self._tries[(tag, target_node)] = (tries, time.monotonic() + 2.0 ** tries)
            detail = f"{exc} ({'will retry' if again else 'giving up'}, try {tries}/{MAX_TRIES})"
            # A try that will be retried goes to the node's log only: at a (re)start the
            # peers' servers come up at slightly different times, and "refused, will
            # retry" on the console would alarm for nothing. The last one is an event.
            self._record(tag, target_node, protocol.CopyState.FAILED, detail, 0,
                         time.monotonic() - t0,
                         event=not again)
            return
        self._tries.pop((tag, target_node), None)
        self._record(tag, target_node, protocol.CopyState.COMPLETE,
                     "" if sent else protocol.REPLICA_ALREADY_THERE, sent,
                     time.monotonic() - t0, cpu=time.thread_time() - c0)

    def _record(self, tag: str, target: str, state: protocol.CopyState, detail: str,
                nbytes: int, seconds: float, event: bool = True, cpu: float = 0.0) -> None:
        self.state.setdefault(tag, {})[target] = state.value
        live = set(self.watch.tags())  # the record follows the keep policy too
        self.state = {k: v for k, v in self.state.items() if k in live or k == tag}
        try:
            write_atomic(self.state_path, json.dumps(self.state, sort_keys=True))
        except OSError as exc:
            self.log(f"replica: cannot write {self.state_path}: {exc}")
        self.log(f"replica: {tag} -> {target}: {state.value} {detail} ({nbytes} bytes, {seconds:.1f} s, "
                 f"{cpu:.2f} CPU s)")
        if event:
            self.send(protocol.Replica(self.node, tag=tag, source=self.index, target=target,
                                       state=state, detail=detail, bytes=nbytes,
                                       seconds=round(seconds, 3)))


class NoReplicas:
    """What the agent holds when replication is off: every hook does nothing."""

    def start(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def end(self, ok: bool) -> None:
        pass
