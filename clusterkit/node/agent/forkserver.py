"""The node agent's side of the fork server (native mode, issue 15).

Part of the node agent (:mod:`clusterkit.node.agent.core`; node program ``agent.core``, whose
module list in :mod:`clusterkit.ship` names this file). The fork server itself
is :mod:`clusterkit.node.agent.zygote` (its wire is described there); this module is the
client: whether to use one, starting it early so it imports torch while the gate runs,
handing it each rank's environment and output pipe on GO, and turning its status lines
into the agent's view of the ranks (:class:`ForkedRank`). Its own module because it
owns its own state (the server process, the pipes, a status queue) and threads.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from clusterkit.node.agent import zygote
from clusterkit.node.agent.files import expand
from clusterkit.node.agent.output import AgentOutput
from clusterkit.node.agent.procs import POLL_S, Child, signal_group
from clusterkit.node.contract import ENV_ZYGOTE, JobDir
from clusterkit.node.protocol import AgentSpec


class ForkedRank:
    """A rank forked by the zygote: the agent's view of it, shaped like a Popen.

    The zygote is its parent and reports its exit code; should the zygote die
    without saying, a rank that is gone reads as killed (it died with the zygote).
    "Without saying" is known only once every status line the zygote wrote has been
    applied (``statuses_read``: its status pipe's end): a zygote that reported its last
    rank's exit and ended can be gone while that line still waits in the pipe, and a
    rank that exited 0 read as killed by SIGKILL (seen once at load ~9)."""

    def __init__(self, pid: int, server: subprocess.Popen[bytes],
                 statuses_read: threading.Event) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server
        self._statuses_read = statuses_read
        self.stdout = None

    def poll(self) -> int | None:
        if self.returncode is None and self._statuses_read.is_set() \
                and self._server.poll() is not None and not os.path.exists(f"/proc/{self.pid}"):
            self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("zygote rank", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def rank_title(spec: AgentSpec, job_dir: str, local_rank: int) -> str:
    """What ``ps`` shows for a forked rank (an exec'd one shows its own argv)."""
    n = spec.native or {}
    return zygote.rank_title([expand(a, job_dir) for a in spec.argv],
                             int(n["first_rank"]) + local_rank, int(n["world_size"]),
                             spec.job_id)


def server_env(rank_env: Callable[[int], dict[str, str]], nproc: int) -> dict[str, str]:
    """The fork server's environment: what the node's ranks all have alike.

    A one-rank node is compared with a second rank's environment too (``rank_env`` is
    pure; that rank never runs): else RANK and LOCAL_RANK would count as common and
    /proc/<pid>/environ would show the fork server as the rank to every scan that finds
    ranks so (agent_procs.rank_pids_of, the agent's USR1 forwarding, a user's tools)."""
    envs = [rank_env(lr) for lr in range(max(nproc, 2))]
    return {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}


class ForkServer:
    """One agent's fork server. Its collaborators, all the agent's:

    ``output`` (lines and log notes), ``ranks`` (local rank -> process: forked ranks are
    added here, their exit codes set here), ``rank_env(local_rank)`` (a rank's
    environment), ``stop`` (set once the agent stops), ``keepalive()`` (the dead-man
    check, run while waiting) and ``request_stop(reason)``."""

    def __init__(self, spec: AgentSpec, job_dir: str, output: AgentOutput,
                 ranks: dict[int, Child], rank_env: Callable[[int], dict[str, str]],
                 stop: threading.Event, keepalive: Callable[[], None],
                 request_stop: Callable[[str], None]) -> None:
        self.spec = spec
        self.job_dir = job_dir
        self.output = output
        self.ranks = ranks
        self.rank_env = rank_env
        self.stop = stop
        self.keepalive = keepalive
        self.request_stop = request_stop
        self.proc: subprocess.Popen[bytes] | None = None  # the zygote, once started
        self._fds: dict[int, int] = {}  # local rank -> read end of its output pipe
        self._wfds: list[int] = []  # the same pipes' write ends (fd numbers in the zygote)
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        # Set once the zygote's status pipe ended and every line before that was applied.
        self._statuses_read = threading.Event()

    def _argv(self) -> list[str]:
        return [expand(a, self.job_dir) for a in self.spec.argv]

    def _cwd(self) -> str | None:
        return os.path.expanduser(self.spec.cwd) if self.spec.cwd else None

    def wanted(self) -> bool:
        if not (self.spec.native and self.spec.argv and self.spec.zygote):
            return False
        cwd = self._cwd()
        parsed = zygote.parse_argv(self._argv(), cwd)
        why = ("the argv is not `python -u script|-m module`" if parsed is None else
               None if zygote.worth_it(parsed[0], parsed[1], cwd) else
               "the script names no module the fork server preloads")
        if why is not None:  # exec, as before: nothing to say on the console
            self.output.log(JobDir.LAUNCHER_LOG, f"clusterkit agent: no fork server: {why}")
            return False
        # The job's env (inventory) may switch it off for one cluster.
        off = self.spec.env.get(ENV_ZYGOTE, os.environ.get(ENV_ZYGOTE, ""))
        return off.strip().lower() not in ("0", "off", "no", "false")

    def start(self) -> None:
        """Start the fork server now: it imports torch while the gate runs.

        Its environment is every rank's minus what differs per rank (RANK, ...);
        each rank's own output pipe is made here and handed down at its start."""
        n = self.spec.native or {}
        argv, cwd = self._argv(), self._cwd()
        nproc = int(n["nproc"])
        common = server_env(self.rank_env, nproc)
        common[zygote.SLOT] = "." * zygote.SLOT_BYTES  # becomes each rank's own variables
        source = "".join(linecache.getlines(zygote.__file__ or ""))
        if not source:
            self.note("its source is not readable here")
            return
        pipes = [os.pipe() for _ in range(nproc)]
        status_r, status_w = os.pipe()
        # The zygote's argv area must hold the longest title it and its ranks will show
        # (zygote.set_title): a padding argument that it ignores.
        title = zygote.server_title(self.spec.job_id, self.spec.node)
        titles = [rank_title(self.spec, self.job_dir, lr) for lr in range(nproc)]
        pad = "." * min(zygote.TITLE_MAX, max(len(t.encode()) for t in [title, *titles]))
        try:
            self.proc = subprocess.Popen(
                [argv[0], "-u", "-c", zygote.BOOT, str(os.getpid()), pad],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=common, cwd=cwd, start_new_session=True,
                pass_fds=[status_w, *(w for _, w in pipes)])
        except OSError as exc:
            for fd in (status_r, status_w, *(x for p in pipes for x in p)):
                os.close(fd)
            self.note(f"{type(exc).__name__}: {exc}")
            return
        for fd in (status_w, *(w for _, w in pipes)):
            os.close(fd)  # the zygote and its ranks hold the write ends
        self._fds = {lr: r for lr, (r, _) in enumerate(pipes)}
        self._wfds = [w for _, w in pipes]
        config = {"argv": argv, "cwd": cwd, "imports": list(self.spec.zygote),
                  "status_fd": status_w, "grace_s": self.spec.grace_s, "title": title}
        body = source.encode()
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):  # it died at once: its status thread says "gone"
            self.proc.stdin.write(b"%d\n" % len(body) + body + json.dumps(config).encode()
                                  + b"\n")
            self.proc.stdin.flush()
        threading.Thread(target=self._read_status, args=(status_r,), daemon=True).start()
        threading.Thread(target=self._read_output, daemon=True).start()

    def _read_status(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as fh:
            for raw in fh:
                with contextlib.suppress(ValueError):
                    self._events.put(json.loads(raw))
        self._events.put({"ev": "gone"})

    def _read_output(self) -> None:
        """Whatever the zygote prints itself (import warnings): launcher lines."""
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self.output.handle_line(raw.decode("utf-8", "replace").rstrip("\r\n"))

    def note(self, why: str) -> None:
        self.output.handle_line(f"clusterkit agent: no fork server ({why}): each rank "
                                "imports its own modules (plain exec)")

    def _wait(self, *want: str) -> dict[str, Any] | None:
        """The zygote's next status line of a kind in ``want`` (None: a stop came first)."""
        while not self.stop.is_set():
            try:
                ev = self._events.get(timeout=POLL_S)
            except queue.Empty:
                self.keepalive()
                continue
            if ev.get("ev") == "gone":
                self._statuses_read.set()
                return ev
            if ev.get("ev") in want:
                return ev
            self._on_exit(ev)  # a rank may end before its siblings are forked
        return None

    def _on_exit(self, ev: dict[str, Any]) -> None:
        if ev.get("ev") == "exit":
            proc = self.ranks.get(int(ev["lr"]))
            if isinstance(proc, ForkedRank):
                proc.returncode = int(ev["code"])

    def drop(self) -> None:
        """No ranks after all (stopped before GO): close the pipes, end the server."""
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # it exits at EOF (it has forked nothing)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2.0)
            if self.proc.poll() is None:
                signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def fork(self, started: Callable[[], None]) -> list[threading.Thread] | None:
        """The ranks forked by the zygote; None: use exec (the reason said in one line).

        ``started()`` is called once the ranks are forked (not on a stop before)."""
        assert self.proc is not None
        ready = self._wait("ready", "unfit")
        if ready is None:
            return []  # stopped while the zygote imported: start nothing
        if ready.get("ev") != "ready":
            self.note(str(ready.get("why", "it exited while importing")))
            self.drop()
            return None
        self.output.log(JobDir.LAUNCHER_LOG, f"clusterkit agent: fork server ready "
                                        f"(imports took {ready.get('import_s')} s)")
        n = self.spec.native or {}
        ranks = [{"lr": lr, "fd": self._wfds[lr], "env": self.rank_env(lr),
                  "title": rank_title(self.spec, self.job_dir, lr)}
                 for lr in range(int(n["nproc"]))]
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"ranks": ranks}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: the status thread says "gone"
        pumps = []
        while len(self.ranks) < len(ranks):
            ev = self._wait("forked")
            if ev is None or ev.get("ev") != "forked":
                break
            lr = int(ev["lr"])
            self.ranks[lr] = ForkedRank(int(ev["pid"]), self.proc, self._statuses_read)
            t = threading.Thread(target=self._pump_fd, args=(lr, self._fds.pop(lr)),
                                 daemon=True)
            t.start()
            pumps.append(t)
        if len(self.ranks) < len(ranks) and not self.stop.is_set():
            self.request_stop("zygote-failed")
        threading.Thread(target=self._exits, daemon=True).start()
        started()
        return pumps

    def _exits(self) -> None:
        while not self._statuses_read.is_set():  # set already: _wait took the end
            ev = self._events.get()
            if ev.get("ev") == "gone":
                self._statuses_read.set()
                return
            self._on_exit(ev)

    def _pump_fd(self, local_rank: int, fd: int) -> None:
        rank = int((self.spec.native or {})["first_rank"]) + local_rank
        with os.fdopen(fd, "rb") as fh:
            for raw in iter(fh.readline, b""):
                self.output.handle_rank_line(rank, raw.decode("utf-8", "replace").rstrip("\r\n"))
