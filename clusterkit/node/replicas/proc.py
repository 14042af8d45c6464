"""The node's checkpoint copies in a process of their own, below the ranks (issue 31).

Part of the node agent (node program ``agent.core``, ``ship.py``). When replicas are on,
the agent holds a :class:`ReplicaProcess`: it starts this module's :func:`main` as a
child in a session of its own, sends it the service's config on stdin (the per-run
secret with it: never argv, env or a file), and forwards what the child prints, the
service's events and its log lines, to the agent's output. The child runs
:class:`~clusterkit.node.replicas.service.ReplicaService` unchanged (server, watcher,
pushes, BYE), as ``slurm.replica serve`` does under Slurm.

Why a process. Linux's autogroup gives each session one equal share of the CPU, whatever
its threads' nice or ``SCHED_IDLE``: copy threads inside the agent's session took as
much CPU as a rank. A session of its own at autogroup nice 19
(:func:`~clusterkit.node.replicas.priority.lower_this_session`) ranks the copy below every rank;
``SCHED_IDLE`` on its threads keeps it below them where autogroup does not apply (a cpu
cgroup shared with the ranks). Starved, the copy now holds nothing the agent needs: the
earlier cpu-cgroup try stalled the agent's control path because a starved copy thread
held the agent's output lock.

Wire, one JSON object per line. Parent to child: the config, then ``finish`` (the ranks
exited 0) or ``abort``; end of file (the agent died) is ``abort``. Child to parent:
``{"event": <protocol line>}``, ``{"log": text}``, and ``{"ended": true}`` last.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from clusterkit.node import protocol
from clusterkit.node.contract import BOOTSTRAP, JobDir, encode_bundle
from clusterkit.node.replicas import priority
from clusterkit.node.replicas.service import (
    FINISH_PUSH_S,
    FINISH_SOURCES_S,
    NoReplicas,
    ReplicaService,
)

# The child's node modules, dependencies first, this one last: it runs as the node
# program ``replicas.proc`` (the agent ships every one of them, so it can hand them on;
# clusterkit/ship.py's replica programs are this list: one table).
MODULES = ("contract", "files", "hashing", "protocol", "agent.procs", "ckpt.listing",
           "replicas.rules", "replicas.done", "replicas.area", "replicas.priority", "replicas.wire",
           "replicas.service", "replicas.proc")
FINISH = "finish"
ABORT = "abort"
ABORT_GRACE_S = 5.0  # after "abort", how long the child may take before it is killed


def child_bundle() -> bytes:
    """The child's sources, taken from this process's own modules: the bootstrap's
    (``<clusterkit.node.X>``, held in linecache) or installed files."""
    out = []
    for name in MODULES:
        path = getattr(sys.modules.get("clusterkit.node." + name), "__file__", None) or ""
        lines = linecache.getlines(path)
        if not lines:
            raise RuntimeError(f"no source for clusterkit.node.{name} (from {path!r})")
        out.append((name, "".join(lines).encode("utf-8")))
    return encode_bundle(out)


class ReplicaProcess:
    """The agent's replication, run by a child process (same hooks as ReplicaService)."""

    def __init__(self, cfg: dict[str, Any], job_id: str, node: str, state_path: str,
                 send: Callable[[protocol.AgentEvent], None],
                 log: Callable[[str], None], python: str = sys.executable) -> None:
        self.conf = {"cfg": cfg, "job_id": job_id, "node": node, "state_path": state_path}
        self.node, self.send, self.log, self.python = node, send, log, python
        self.proc: subprocess.Popen[bytes] | None = None
        self._said: str | None = None  # finish, then maybe abort; or abort: the last word
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    def start(self) -> None:
        """The child, its config, and the threads that forward what it prints."""
        try:
            stdin = child_bundle() + (json.dumps(self.conf) + "\n").encode("utf-8")
            self.proc = subprocess.Popen(
                [self.python, "-S", "-u", "-c", BOOTSTRAP, MODULES[-1]],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)  # its own session: its own autogroup
            assert self.proc.stdin is not None
            self.proc.stdin.write(stdin)
            self.proc.stdin.flush()
        except (OSError, RuntimeError) as exc:
            self.send(protocol.Error(self.node, message="checkpoint replication is off on "
                                                        f"this node: {exc}"))
            self.proc = None
            return
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout,),
                                          daemon=True),
                         threading.Thread(target=self._read_stderr, args=(self.proc.stderr,),
                                          daemon=True)]
        for t in self._readers:
            t.start()

    def abort(self) -> None:
        """A failure or a stop: the child drops everything; never blocks the caller."""
        if self._say(ABORT):
            timer = threading.Timer(ABORT_GRACE_S, self._kill)
            timer.daemon = True
            timer.start()

    def end(self, ok: bool) -> None:
        """The agent's end: finish (bounded, as the service's own waits) or abort."""
        if self.proc is None:
            return
        if not self._say(FINISH if ok else ABORT):
            ok = False  # aborted before: only the wait is left
        bound = FINISH_PUSH_S + FINISH_SOURCES_S + 30.0 if ok else ABORT_GRACE_S
        try:
            self.proc.wait(bound)
        except subprocess.TimeoutExpired:
            self.log(f"replica: the copy process did not end within {bound:g} s; killed")
            self._kill()
            self.proc.wait(10.0)
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        for t in self._readers:
            t.join(5.0)

    def _say(self, word: str) -> bool:
        """Tell the child ``word``: finish or abort once each, abort last.

        An abort after a finish (the launcher stopped the job while this node's ranks had
        ended well: a rank failed elsewhere) ends the finish's waits: a failed node's
        copy process never says BYE, and the finish would wait for it for minutes while
        the launcher's restart ran beside this agent. Stdin stays open until the abort
        or the child's end: its end is an abort too (the agent died)."""
        with self._lock:
            if self.proc is None or self._said in (word, ABORT):
                return False
            self._said = word
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write((word + "\n").encode())
                self.proc.stdin.flush()
                if word == ABORT:
                    self.proc.stdin.close()
            except (OSError, ValueError):
                pass  # the child is gone already
            return True

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            try:
                msg = json.loads(raw.decode("utf-8", "replace"))
                if "event" in msg:
                    self.send(protocol.decode_event(str(msg["event"])))
                elif "log" in msg:
                    self.log(str(msg["log"]))
            except (ValueError, TypeError, protocol.ProtocolError) as exc:
                self.log(f"replica: unreadable line from the copy process ({exc}): "
                         f"{raw[:200]!r}")
        code = self.proc.wait() if self.proc is not None else None
        if code and self._said != ABORT:  # it died on its own: say so once, on the console
            self.send(protocol.Error(self.node, message="checkpoint replication stopped on "
                                     f"this node: its copy process exited with code {code} "
                                     "(the node's launcher.log has its last words)"))

    def _read_stderr(self, stream: IO[bytes]) -> None:
        for raw in stream:
            self.log("replica process: " + raw.decode("utf-8", "replace").rstrip())


def for_agent(spec: protocol.AgentSpec, job_dir: str, output: Any) -> ReplicaProcess | NoReplicas:
    """The agent's replication from its spec (``output``: its AgentOutput, for the events
    and the lines in its ``launcher.log``)."""
    if spec.replica is None:
        return NoReplicas()
    return ReplicaProcess(spec.replica, spec.job_id, spec.node,
                          JobDir(job_dir).replica_state(spec.node), output.send,
                          lambda m: output.log(JobDir.LAUNCHER_LOG, m))


# ------------------------------------------------------------------------- the child

class _Out:
    """The child's stdout, one JSON line at a time from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def put(self, obj: dict[str, Any]) -> None:
        line = (json.dumps(obj) + "\n").encode("utf-8")
        with self.lock:
            try:
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
            except (OSError, ValueError):
                pass  # the agent is gone; the copies end with the abort that follows


def _abort_on_next_word(svc: ReplicaService) -> None:
    """After "finish": "abort" or the end of stdin (the agent gone) aborts."""
    if sys.stdin.buffer.readline().decode("utf-8", "replace").strip() in (ABORT, ""):
        svc.abort()


def main(argv: list[str] | None = None) -> int:
    out = _Out()
    words = priority.lower_this_session()
    conf = json.loads(sys.stdin.buffer.readline().decode("utf-8"))

    def log(text: str) -> None:
        out.put({"log": text})

    svc = ReplicaService(conf["cfg"], conf["job_id"], conf["node"], conf["state_path"],
                         lambda ev: out.put({"event": protocol.encode(ev)}), log)
    if words:
        log(f"replica: the copy process runs in a session of its own: {words}")
    svc.start()
    word = sys.stdin.buffer.readline().decode("utf-8", "replace").strip()  # EOF: ""
    if word != FINISH:
        svc.end(False)
        out.put({"ended": True})
        return 0
    # A later abort, or the agent's end, cuts the finish short.
    threading.Thread(target=_abort_on_next_word, args=(svc,), daemon=True).start()
    svc.end(True)
    out.put({"ended": True})
    # That reader still blocks on stdin: leave without the interpreter's shutdown, which
    # aborts (SIGABRT) when a daemon thread holds stdin's buffer lock. Everything said
    # went out through flushed writes.
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(0)
