"""The node agent (node program ``agent``, shipped by :mod:`clusterkit.node.ship`).

One agent runs per node and job, over ONE SSH session (or as a local child for
virtual nodes). It reads its :class:`~clusterkit.node.protocol.AgentSpec` as JSON
on the first stdin line after its sources (or ``--spec-b64``), writes the job's
files atomically into the per-job directory,
starts the per-node launcher (torchrun, ``accelerate launch``, DeepSpeed's runner
or the workload itself) in its own session with ``CLUSTERKIT_JOB_ID`` in the
environment of every process, and streams the output back as machine-parsable
lines::

    @ck:L <node> <local-rank|-> <text>     one output line of a rank or the launcher
    @ck:E {"ev": ...}                      an event (started, rank-failed, exit, ...)

Every line also lands in ``<job_dir>/nodes/<node>/rank<R>.log`` (or
``launcher.log``). The rest of stdin carries control commands, one per line:
``TERM`` (teardown with a grace period), ``KILL``, ``USR1``, ``USR2`` (forwarded
to the ranks). EOF on stdin — the launcher exited or the SSH connection dropped —
tears the job down on this node.

Teardown is job-scoped: SIGTERM to the launcher's process group AND to every
process whose ``/proc/<pid>/environ`` carries this job's ``CLUSTERKIT_JOB_ID``
(workers may live in other process groups, or be started by pdsh through sshd),
SIGKILL after the grace period. A process of another job is never signalled: we
never match on command lines (DeepSpeed's ``pkill -f`` kills every DeepSpeed job
on the node, DeepSpeed#6807).

The agent's exit code is the launcher's (128+N when a signal N ended it).
Other modes, used by ``clusterkit stop`` / ``status`` through ``run_all``:
``--stop JOB_ID [--grace S]`` and ``--status JOB_ID [--job-dir D --node N]``.
Standard library only, Python >= 3.8 on the node: no ``match``, no new typing
syntax at runtime. The wire format lives in :mod:`clusterkit.node.protocol`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import linecache
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any, Union

from clusterkit.node import protocol, zygote
from clusterkit.node.gatefacts import gate_facts
from clusterkit.node.protocol import (
    DEFAULT_GRACE_S,
    ENV_ATTEMPT,
    ENV_JOB,
    ENV_NODE,
    EVENT_PREFIX,
    JOB_DIR_TOKEN,
    LINE_PREFIX,
    AgentSpec,
    ProtocolError,
)

__all__ = ["EVENT_PREFIX", "LINE_PREFIX", "Agent", "Spec", "gate_facts", "job_processes", "sweep"]
POLL_S = 0.1
PROGRESS_EVERY_S = 2.0  # how often the agent reports its ranks' progress
# The job contract (docs/launch.md): a rank shows progress by writing output or by
# touching CLUSTERKIT_HEARTBEAT (the workload writes its step there); the workload
# registers faulthandler on DUMP_SIGNAL to write its stacks to CLUSTERKIT_STACKS.
ENV_HEARTBEAT, ENV_HEARTBEAT_DIR, ENV_STACKS = (
    "CLUSTERKIT_HEARTBEAT", "CLUSTERKIT_HEARTBEAT_DIR", "CLUSTERKIT_STACKS")
# SIGWINCH: its default action is "ignore", so a script that registered nothing is
# not killed by a stack request.
DUMP_SIGNAL = signal.SIGWINCH
DUMP_WAIT_S = 5.0
Spec = AgentSpec  # the name the agent has always used
AGENT_COMM = "ck-agent"

# torchrun --tee 3: "[default0]:text"; pdsh: "node3: text".
_TORCHRUN_LINE = re.compile(r"^\[[A-Za-z_]*?(\d+)\]:(.*)$")
_PDSH_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*): (.*)$")
# torchrun: "... failed (exitcode: -9) local_rank: 1 (pid: 20825) of binary: ..."
_TORCHRUN_FAIL = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# deepspeed.launcher.launch: "[... '--local_rank=1', ...] exits with return code = -9"
_DS_FAIL = re.compile(r"--local_rank=(\d+).*exits with return code = (-?\d+)")
# pdsh: "pdsh@node1: node5: ssh exited with exit code 1"
_PDSH_FAIL = re.compile(r"^pdsh@\S+: (\S+): \S+ exited with exit code (\d+)")


# ----------------------------------------------------------------- /proc scanning


def _environ(pid: int) -> dict[bytes, bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None  # gone, a kernel thread, or not ours to read
    out: dict[bytes, bytes] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key] = value
    return out


def job_processes(job_id: str, node: str | None = None, attempt: int | None = None
                  ) -> dict[int, dict[bytes, bytes]]:
    """pid -> environ of every live process tagged with ``job_id``.

    ``node``/``attempt``: also require these tags when the process carries them
    (virtual nodes share one machine; processes started by pdsh carry no node tag).
    """
    want = job_id.encode()
    skip = {os.getpid(), os.getppid()}
    found: dict[int, dict[bytes, bytes]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        env = _environ(int(name))
        if not env or env.get(ENV_JOB.encode()) != want:
            continue
        if node is not None and env.get(ENV_NODE.encode(), node.encode()) != node.encode():
            continue
        if attempt is not None and env.get(ENV_ATTEMPT.encode(), str(attempt).encode()) \
                != str(attempt).encode():
            continue
        found[int(name)] = env
    return found


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rank_pids_of(procs: dict[int, dict[bytes, bytes]]) -> dict[int, int]:
    """global rank -> pid of the rank's own process among ``procs`` (pid -> environ).

    A rank's helpers (DataLoader workers, compile workers) inherit its RANK: the rank is
    the process whose parent is not of the same rank (the lowest pid where that leaves
    several, as after a pid wrap)."""
    by_rank: dict[int, list[int]] = {}
    for pid, env in procs.items():
        value = env.get(b"RANK", b"")
        if value.isdigit() and b"LOCAL_RANK" in env:
            by_rank.setdefault(int(value), []).append(pid)
    out: dict[int, int] = {}
    for rank, pids in by_rank.items():
        roots = [p for p in pids if _ppid(p) not in pids] or pids
        out[rank] = min(roots)
    return out


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class ForkedRank:
    """A rank forked by the zygote: the agent's view of it, shaped like a Popen.

    The zygote is its parent and reports its exit code; should the zygote die
    without saying, a rank that is gone reads as killed (it died with the zygote)."""

    def __init__(self, pid: int, server: subprocess.Popen[bytes]) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server
        self.stdout = None

    def poll(self) -> int | None:
        if self.returncode is None and self._server.poll() is not None \
                and not os.path.exists(f"/proc/{self.pid}"):
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


Proc = Union["subprocess.Popen[bytes]", ForkedRank]


def sweep(job_id: str, node: str | None, attempt: int | None, grace_s: float,
          children: Sequence[Proc] = ()) -> dict[str, int]:
    """SIGTERM the children's groups and every process of the job; SIGKILL after grace."""
    counts = {"signalled": 0, "killed": 0, "left": 0}
    for child in children:
        if child.poll() is None:
            _signal_group(child.pid, signal.SIGTERM)
            counts["signalled"] += 1
    for pid in job_processes(job_id, node, attempt):
        counts["signalled"] += _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        alive = any(c.poll() is None for c in children)
        if not alive and not job_processes(job_id, node, attempt):
            return counts
        time.sleep(POLL_S)
    for child in children:
        if child.poll() is None:
            _signal_group(child.pid, signal.SIGKILL)
            counts["killed"] += 1
    for pid in job_processes(job_id, node, attempt):
        counts["killed"] += _signal(pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(5.0)
    time.sleep(POLL_S)
    counts["left"] = len(job_processes(job_id, node, attempt))
    return counts


# ----------------------------------------------------------------- files


def omp_threads(nproc: int) -> str:
    """OpenMP threads per rank: the CPUs this node lets us run on / its ranks, at least 1.

    (Issue 13: ranks that start a thread per core each oversubscribe the node; torchrun's
    fixed 1 wastes the cores of a node with fewer ranks than CPUs.) Same rule as the
    batch script's (docs/sbatch.md)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return str(max(1, cpus // max(1, nproc)))


def _write_atomic(path: str, text: str) -> None:
    # The job dir may be on a shared filesystem that every node's agent writes at once,
    # and pids repeat across hosts (and PID namespaces): the temp name must be unique.
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _expand(value: str, job_dir: str) -> str:
    return value.replace(JOB_DIR_TOKEN, job_dir)


# ----------------------------------------------------------------- rank log files

_RANK_LOG = re.compile(r"_rank(\d+)\.log$")


class RankLogTail:
    """Follow ``<dir>/*_rank<R>.log`` (DeepSpeed's per-rank logs) as complete lines."""

    def __init__(self, directory: str, want: Any = None) -> None:
        self.directory = directory
        self.want = want or (lambda rank: True)  # which ranks' files to follow
        self._files: dict[str, tuple[int, IO[bytes]]] = {}
        self._partial: dict[str, bytes] = {}

    def poll(self, final: bool = False) -> list[tuple[int, str]]:
        """(global rank, line) of every line completed since the last poll."""
        out: list[tuple[int, str]] = []
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(self.directory)):
                m = _RANK_LOG.search(name)
                if m and name not in self._files and self.want(int(m.group(1))):
                    with contextlib.suppress(OSError):
                        self._files[name] = (int(m.group(1)),
                                             open(os.path.join(self.directory, name), "rb"))  # noqa: SIM115
        for name, (rank, fh) in self._files.items():
            data = self._partial.pop(name, b"") + fh.read()
            *lines, rest = data.split(b"\n")
            if rest and final:
                lines.append(rest)
            elif rest:
                self._partial[name] = rest
            out += [(rank, ln.decode("utf-8", "replace").rstrip("\r")) for ln in lines]
        return out

    def close(self) -> None:
        for _, fh in self._files.values():
            fh.close()


# ----------------------------------------------------------------- the agent


class Agent:
    def __init__(self, spec: AgentSpec, out: IO[str]) -> None:
        self.spec = spec
        self.job_dir = os.path.abspath(os.path.expanduser(spec.job_dir))
        self.node_dir = os.path.join(self.job_dir, "nodes", spec.node)
        self._out = out
        self._out_ok = True
        self._lock = threading.Lock()
        self._logs: dict[str, IO[str]] = {}
        self.child: subprocess.Popen[bytes] | None = None  # the launcher (launcher mode)
        self.ranks: dict[int, Proc] = {}  # local rank -> process (native)
        # Native mode's fork server (issue 15): started early, forks the ranks on GO.
        self.zygote: subprocess.Popen[bytes] | None = None
        self._zy_fds: dict[int, int] = {}  # local rank -> read end of its output pipe
        self._zy_wfds: list[int] = []  # the same pipes' write ends (fd numbers in the zygote)
        self._zy_events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.rank_codes: dict[int, int] = {}  # local rank -> exit code, in order of exit
        self.stop_reason: str | None = None
        self._stop = threading.Event()
        self._failure_sent = False
        self._tail_done = threading.Event()
        self._go = threading.Event()
        # Output goes through one writer thread: behind a network partition a write to
        # the SSH session blocks, and nothing else (the teardown) may wait on it.
        self._outq: queue.Queue[str] = queue.Queue()
        self.keepalive_lost = False
        self._last_control = time.monotonic()
        self._started = time.monotonic()
        self._started_wall = time.time()
        self._last_line: dict[int, float] = {}  # global rank -> time of its last output line
        self._next_progress = 0.0
        self.progress_dir = os.path.join(self.node_dir, "progress")
        self._threaded = False  # see start_writer
        self._spy_python = sys.executable  # the job's Python, named in the py-spy hint

    def start_writer(self) -> None:
        """From now on output goes through a writer thread (the real agent, not tests)."""
        self._threaded = True
        threading.Thread(target=self._writer, daemon=True, name="agent-out").start()

    # -------------------------------------------------------------- output

    def emit_raw(self, line: str) -> None:
        if not self._out_ok or self.keepalive_lost:
            return
        if self._threaded:
            self._outq.put(line)
            return
        with self._lock:
            try:
                self._out.write(line + "\n")
                self._out.flush()
            except (OSError, ValueError):
                self._out_ok = False

    def _writer(self) -> None:
        while True:
            line = self._outq.get()
            try:
                self._out.write(line + "\n")
                if self._outq.empty():
                    self._out.flush()
            except (OSError, ValueError):
                self._out_ok = False  # the launcher is gone; keep writing log files

    def drain(self, timeout: float = 5.0) -> None:
        """Give the writer a moment to send what is queued (the exit event)."""
        deadline = time.monotonic() + timeout
        while not self._outq.empty() and self._out_ok and not self.keepalive_lost \
                and time.monotonic() < deadline:
            time.sleep(0.02)

    def event(self, ev: str, **fields: Any) -> None:
        self.emit_raw(protocol.encode_event(ev, self.spec.node, **fields))

    def _log(self, name: str, text: str) -> None:
        fh = self._logs.get(name)
        if fh is None:
            fh = open(os.path.join(self.node_dir, name), "a", encoding="utf-8")  # noqa: SIM115
            self._logs[name] = fh
        fh.write(text + "\n")
        fh.flush()

    def handle_line(self, line: str) -> None:
        node, lrank, text = self._classify(line)
        offset = self.spec.rank_offsets.get(node)
        if lrank is not None and offset is not None:
            log_name = f"rank{offset + lrank}.log"
        else:
            log_name = "launcher.log" if node == self.spec.node else f"{node}.log"
        with self._lock:
            self._log(log_name, text)
        if lrank is not None and offset is not None:
            self._last_line[offset + lrank] = time.monotonic()
        self.emit_raw(f"{LINE_PREFIX}{node} {'-' if lrank is None else lrank} {text}")
        self._watch_failure(node, text)

    def handle_rank_line(self, rank: int, text: str) -> None:
        """A line read from a rank's own log file on this node (global rank known)."""
        offset = self.spec.rank_offsets.get(self.spec.node, 0)
        with self._lock:
            self._log(f"rank{rank}.log", text)
        self._last_line[rank] = time.monotonic()
        self.emit_raw(f"{LINE_PREFIX}{self.spec.node} {rank - offset} {text}")

    def tail_rank_logs(self) -> None:
        """Until the agent finishes: stream DeepSpeed's per-rank log files as rank lines."""
        assert self.spec.rank_log_dir is not None
        tail = RankLogTail(_expand(self.spec.rank_log_dir, self.job_dir), self._my_ranks())
        try:
            while not self._tail_done.wait(0.2):
                for rank, text in tail.poll():
                    self.handle_rank_line(rank, text)
            for rank, text in tail.poll(final=True):
                self.handle_rank_line(rank, text)
        finally:
            tail.close()

    def _my_ranks(self) -> Any:
        """On a shared job dir every node's rank files meet in one directory: keep ours."""
        first = self.spec.rank_offsets.get(self.spec.node, 0)
        later = [o for o in self.spec.rank_offsets.values() if o > first]
        end = min(later) if later else None
        return lambda rank: rank >= first and (end is None or rank < end)

    def _classify(self, line: str) -> tuple[str, int | None, str]:
        node, text = self.spec.node, line
        if self.spec.prefix == "pdsh":
            m = _PDSH_LINE.match(text)
            if m and m.group(1) in self.spec.rank_offsets:
                node, text = m.group(1), m.group(2)
        if self.spec.prefix == "single":
            return node, 0, text
        m = _TORCHRUN_LINE.match(text)
        if m:
            # torchrun's tee (tail_logfile) reads a rank's log with readline(): a line
            # caught half-written comes out in two parts, the second with the header again.
            return node, int(m.group(1)), m.group(2).replace(text[:m.start(2)], "")
        return node, None, text

    def _watch_failure(self, node: str, text: str) -> None:
        """Name the first rank that failed, from the launchers' own reports."""
        if self._failure_sent:
            return
        m = _TORCHRUN_FAIL.search(text)
        if m:
            self._rank_failed(node, int(m.group(2)), int(m.group(1)))
            return
        m = _DS_FAIL.search(text)
        if m:
            self._rank_failed(node, int(m.group(1)), int(m.group(2)))
            return
        m = _PDSH_FAIL.match(text)
        if m:
            self._rank_failed(m.group(1), None, int(m.group(2)))
            # DeepSpeed's runner keeps waiting for the other nodes, which hang in their
            # collectives (DeepSpeed#1995): a failed node ends the job right here.
            self.request_stop("pdsh-node-failed")

    def _rank_failed(self, node: str, lrank: int | None, code: int) -> None:
        self._failure_sent = True
        offset = self.spec.rank_offsets.get(node)
        rank = offset + lrank if (offset is not None and lrank is not None) else None
        self.event("rank-failed", failed_node=node, local_rank=lrank, rank=rank, code=code)

    # -------------------------------------------------------------- control

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()

    def forward(self, sig: int) -> int:
        """USR1/USR2 go to the ranks (a launcher such as torchrun dies of SIGUSR1)."""
        procs = job_processes(self.spec.job_id, self.spec.node, self.spec.attempt)
        ranks = [p for p, env in procs.items() if b"RANK" in env or b"LOCAL_RANK" in env]
        if not ranks and self.child is not None and self.child.poll() is None:
            ranks = [self.child.pid]
        # Forked ranks carry RANK only in os.environ, not in /proc/<pid>/environ.
        ranks = sorted({*ranks, *(p.pid for p in self.ranks.values() if p.poll() is None)})
        return sum(_signal(p, sig) for p in ranks)

    def read_control(self, stream: IO[str]) -> None:
        for raw in stream:
            self._last_control = time.monotonic()
            cmd = protocol.parse_control(raw)
            if cmd in (protocol.TERM, protocol.KILL):
                self.request_stop(cmd.lower())
                if cmd == protocol.KILL:
                    self.kill_now()
            elif cmd == protocol.GO:
                self._go.set()
            elif cmd in (protocol.USR1, protocol.USR2):
                n = self.forward(getattr(signal, f"SIG{cmd}"))
                self.event("forwarded", signal=cmd, processes=n)
            elif cmd == protocol.DUMP:
                threading.Thread(target=self.dump_stacks, daemon=True).start()
        self.request_stop("stdin-eof")  # the launcher exited or the connection dropped

    def kill_now(self) -> None:
        for child in self.children():
            if child.poll() is None:
                _signal_group(child.pid, signal.SIGKILL)
        for pid in job_processes(self.spec.job_id, self.spec.node, self.spec.attempt):
            _signal(pid, signal.SIGKILL)

    # -------------------------------------------------------------- lifecycle

    def prepare(self) -> None:
        os.makedirs(self.node_dir, exist_ok=True)
        os.makedirs(self.progress_dir, exist_ok=True)
        if self.spec.rank_log_dir:
            # DeepSpeed's launcher creates it with exists()+makedirs(): on a shared job
            # dir its launchers on several nodes race and one dies. Exists before them.
            os.makedirs(_expand(self.spec.rank_log_dir, self.job_dir), exist_ok=True)
        for name, content in self.spec.files.items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"bad job file name {name!r}")
            _write_atomic(os.path.join(self.job_dir, name), _expand(content, self.job_dir))

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({k: _expand(v, self.job_dir) for k, v in self.spec.env.items()})
        env.update({ENV_JOB: self.spec.job_id, ENV_NODE: self.spec.node,
                    ENV_ATTEMPT: str(self.spec.attempt), ENV_HEARTBEAT_DIR: self.progress_dir})
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines, not 8 KiB blocks, reach the console
        if self.spec.local_ranks > 0 and "OMP_NUM_THREADS" not in env:
            # torchrun and accelerate keep a value they find (their own default is a fixed 1
            # for several ranks); an inventory env value wins over ours.
            env["OMP_NUM_THREADS"] = omp_threads(self.spec.local_ranks)
        return env

    def start_child(self) -> None:
        argv = [_expand(a, self.job_dir) for a in self.spec.argv]
        cwd = os.path.expanduser(self.spec.cwd) if self.spec.cwd else None
        self.child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=self.child_env(), cwd=cwd, start_new_session=True,
        )
        self.write_state("running")
        self.event("started", pid=self.child.pid, argv=argv)

    def children(self) -> list[Proc]:
        out: list[Proc] = [self.child] if self.child is not None else []
        if self.zygote is not None:
            out.append(self.zygote)
        return out + list(self.ranks.values())

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """What torchrun gives a worker, minus its TORCHELASTIC_* agent variables."""
        n = self.spec.native or {}
        env = self.child_env()
        nproc = int(n["nproc"])
        env.update({
            "RANK": str(int(n["first_rank"]) + local_rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(n["world_size"]), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(n["node_rank"]), "GROUP_WORLD_SIZE": str(n["nnodes"]),
            "ROLE_RANK": str(int(n["first_rank"]) + local_rank), "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(n["world_size"]), "MASTER_ADDR": str(n["master_addr"]),
            "MASTER_PORT": str(n["master_port"]),
        })
        rank = int(n["first_rank"]) + local_rank
        env[ENV_HEARTBEAT] = os.path.join(self.progress_dir, f"rank{rank}.heartbeat")
        env[ENV_STACKS] = os.path.join(self.progress_dir, f"rank{rank}.stacks")
        if "OMP_NUM_THREADS" not in env:  # an inventory env value wins
            env["OMP_NUM_THREADS"] = omp_threads(nproc)
        return env

    # -------------------------------------------------------------- the fork server

    def rank_title(self, local_rank: int) -> str:
        """What ``ps`` shows for a forked rank (an exec'd one shows its own argv)."""
        n = self.spec.native or {}
        return zygote.rank_title([_expand(a, self.job_dir) for a in self.spec.argv],
                                 int(n["first_rank"]) + local_rank, int(n["world_size"]),
                                 self.spec.job_id)

    def zygote_wanted(self) -> bool:
        if not (self.spec.native and self.spec.argv and self.spec.zygote):
            return False
        cwd = os.path.expanduser(self.spec.cwd) if self.spec.cwd else None
        parsed = zygote.parse_argv([_expand(a, self.job_dir) for a in self.spec.argv], cwd)
        why = ("the argv is not `python -u script|-m module`" if parsed is None else
               None if zygote.worth_it(parsed[0], parsed[1], cwd) else
               "the script names no module the fork server preloads")
        if why is not None:
            with self._lock:  # exec, as before: nothing to say on the console
                self._log("launcher.log", f"clusterkit agent: no fork server: {why}")
            return False
        # The job's env (inventory) may switch it off for one cluster.
        off = self.spec.env.get("CLUSTERKIT_ZYGOTE", os.environ.get("CLUSTERKIT_ZYGOTE", ""))
        return off.strip().lower() not in ("0", "off", "no", "false")

    def start_zygote(self) -> None:
        """Start the fork server now: it imports torch while the gate runs.

        Its environment is every rank's minus what differs per rank (RANK, ...);
        each rank's own output pipe is made here and handed down at its start."""
        n = self.spec.native or {}
        argv = [_expand(a, self.job_dir) for a in self.spec.argv]
        cwd = os.path.expanduser(self.spec.cwd) if self.spec.cwd else None
        nproc = int(n["nproc"])
        envs = [self.rank_env(lr) for lr in range(nproc)]
        common = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
        common[zygote.SLOT] = "." * zygote.SLOT_BYTES  # becomes each rank's own variables
        source = "".join(linecache.getlines(zygote.__file__ or ""))
        if not source:
            self._zygote_note("its source is not readable here")
            return
        pipes = [os.pipe() for _ in range(nproc)]
        status_r, status_w = os.pipe()
        # The zygote's argv area must hold the longest title it and its ranks will show
        # (zygote.set_title): a padding argument that it ignores.
        title = zygote.server_title(self.spec.job_id, self.spec.node)
        pad = "." * min(zygote.TITLE_MAX, max(len(t.encode()) for t in
                                              [title, *map(self.rank_title, range(nproc))]))
        try:
            self.zygote = subprocess.Popen(
                [argv[0], "-u", "-c", zygote.BOOT, str(os.getpid()), pad],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=common, cwd=cwd, start_new_session=True,
                pass_fds=[status_w, *(w for _, w in pipes)])
        except OSError as exc:
            for fd in (status_r, status_w, *(x for p in pipes for x in p)):
                os.close(fd)
            self._zygote_note(f"{type(exc).__name__}: {exc}")
            return
        for fd in (status_w, *(w for _, w in pipes)):
            os.close(fd)  # the zygote and its ranks hold the write ends
        self._zy_fds = {lr: r for lr, (r, _) in enumerate(pipes)}
        self._zy_wfds = [w for _, w in pipes]
        config = {"argv": argv, "cwd": cwd, "imports": list(self.spec.zygote),
                  "status_fd": status_w, "grace_s": self.spec.grace_s, "title": title}
        body = source.encode()
        assert self.zygote.stdin is not None
        with contextlib.suppress(OSError):  # it died at once: its status thread says "gone"
            self.zygote.stdin.write(b"%d\n" % len(body) + body + json.dumps(config).encode()
                                    + b"\n")
            self.zygote.stdin.flush()
        threading.Thread(target=self._zygote_status, args=(status_r,), daemon=True).start()
        threading.Thread(target=self._zygote_output, daemon=True).start()

    def _zygote_status(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as fh:
            for raw in fh:
                with contextlib.suppress(ValueError):
                    self._zy_events.put(json.loads(raw))
        self._zy_events.put({"ev": "gone"})

    def _zygote_output(self) -> None:
        """Whatever the zygote prints itself (import warnings): launcher lines."""
        assert self.zygote is not None and self.zygote.stdout is not None
        for raw in iter(self.zygote.stdout.readline, b""):
            self.handle_line(raw.decode("utf-8", "replace").rstrip("\r\n"))

    def _zygote_note(self, why: str) -> None:
        self.handle_line(f"clusterkit agent: no fork server ({why}): each rank imports "
                         "its own modules (plain exec)")

    def _zygote_wait(self, *want: str) -> dict[str, Any] | None:
        """The zygote's next status line of a kind in ``want`` (None: a stop came first)."""
        while not self._stop.is_set():
            try:
                ev = self._zy_events.get(timeout=POLL_S)
            except queue.Empty:
                self.check_keepalive()
                continue
            if ev.get("ev") in want or ev.get("ev") == "gone":
                return ev
            self._zygote_exit(ev)  # a rank may end before its siblings are forked
        return None

    def _zygote_exit(self, ev: dict[str, Any]) -> None:
        if ev.get("ev") == "exit":
            proc = self.ranks.get(int(ev["lr"]))
            if isinstance(proc, ForkedRank):
                proc.returncode = int(ev["code"])

    def _zygote_drop(self) -> None:
        for fd in self._zy_fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._zy_fds = {}
        if self.zygote is not None and self.zygote.poll() is None:
            assert self.zygote.stdin is not None
            with contextlib.suppress(OSError):
                self.zygote.stdin.close()  # it exits at EOF (it has forked nothing)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.zygote.wait(2.0)
            if self.zygote.poll() is None:
                _signal_group(self.zygote.pid, signal.SIGKILL)
                self.zygote.wait()

    def fork_ranks(self) -> list[threading.Thread] | None:
        """The ranks forked by the zygote; None: use exec (the reason said in one line)."""
        assert self.zygote is not None
        ready = self._zygote_wait("ready", "unfit")
        if ready is None:
            return []  # stopped while the zygote imported: start nothing
        if ready.get("ev") != "ready":
            self._zygote_note(str(ready.get("why", "it exited while importing")))
            self._zygote_drop()
            return None
        with self._lock:
            self._log("launcher.log", f"clusterkit agent: fork server ready "
                                      f"(imports took {ready.get('import_s')} s)")
        n = self.spec.native or {}
        ranks = [{"lr": lr, "fd": self._zy_wfds[lr], "env": self.rank_env(lr),
                  "title": self.rank_title(lr)} for lr in range(int(n["nproc"]))]
        assert self.zygote.stdin is not None
        try:
            self.zygote.stdin.write(json.dumps({"ranks": ranks}).encode() + b"\n")
            self.zygote.stdin.flush()
        except OSError:
            pass  # it died: the status thread says "gone"
        pumps = []
        while len(self.ranks) < len(ranks):
            ev = self._zygote_wait("forked")
            if ev is None or ev.get("ev") != "forked":
                break
            lr = int(ev["lr"])
            self.ranks[lr] = ForkedRank(int(ev["pid"]), self.zygote)
            t = threading.Thread(target=self._pump_fd, args=(lr, self._zy_fds.pop(lr)),
                                 daemon=True)
            t.start()
            pumps.append(t)
        if len(self.ranks) < len(ranks) and not self._stop.is_set():
            self.request_stop("zygote-failed")
        threading.Thread(target=self._zygote_exits, daemon=True).start()
        argv = [_expand(a, self.job_dir) for a in self.spec.argv]
        self.write_state("running")
        self.event("started", pid=None, pids=[p.pid for p in self.ranks.values()], argv=argv,
                   zygote=self.zygote.pid)
        return pumps

    def _zygote_exits(self) -> None:
        while True:
            ev = self._zy_events.get()
            if ev.get("ev") == "gone":
                return
            self._zygote_exit(ev)

    def _pump_fd(self, local_rank: int, fd: int) -> None:
        rank = int((self.spec.native or {})["first_rank"]) + local_rank
        with os.fdopen(fd, "rb") as fh:
            for raw in iter(fh.readline, b""):
                self.handle_rank_line(rank, raw.decode("utf-8", "replace").rstrip("\r\n"))

    def start_ranks(self) -> list[threading.Thread]:
        if self.zygote is not None:
            forked = self.fork_ranks()
            if forked is not None:
                return forked
        n = self.spec.native or {}
        argv = [_expand(a, self.job_dir) for a in self.spec.argv]
        cwd = os.path.expanduser(self.spec.cwd) if self.spec.cwd else None
        pumps = []
        for lr in range(int(n["nproc"])):
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=self.rank_env(lr), cwd=cwd, start_new_session=True,
            )
            self.ranks[lr] = proc
            t = threading.Thread(target=self.pump_rank, args=(lr, proc), daemon=True)
            t.start()
            pumps.append(t)
        self.write_state("running")
        self.event("started", pid=None, pids=[p.pid for p in self.ranks.values()], argv=argv)
        return pumps

    def pump_rank(self, local_rank: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        rank = int((self.spec.native or {})["first_rank"]) + local_rank
        for raw in iter(proc.stdout.readline, b""):
            self.handle_rank_line(rank, raw.decode("utf-8", "replace").rstrip("\r\n"))

    def check_ranks(self) -> bool:
        """Native mode: record exits; a failed rank stops the node. True when all are done."""
        for lr, proc in self.ranks.items():
            code = proc.poll()
            if code is None or lr in self.rank_codes:
                continue
            self.rank_codes[lr] = code
            if code != 0 and not self._failure_sent:
                self._rank_failed(self.spec.node, lr, code)
                self.request_stop("rank-failed")
        return len(self.rank_codes) == len(self.ranks)

    def pump_child(self) -> None:
        assert self.child is not None and self.child.stdout is not None
        for raw in iter(self.child.stdout.readline, b""):
            self.handle_line(raw.decode("utf-8", "replace").rstrip("\r\n"))

    def write_state(self, state: str, **extra: Any) -> None:
        data = {"job_id": self.spec.job_id, "node": self.spec.node, "attempt": self.spec.attempt,
                "agent_pid": os.getpid(), "child_pid": self.child.pid if self.child else None,
                "rank_pids": [p.pid for p in self.ranks.values()],
                # Forked ranks carry RANK only in os.environ: `status` reads them here.
                "ranks": {str(r): pid for r, pid in self.rank_pids().items()} if self.ranks else {},
                "zygote_pid": self.zygote.pid if self.zygote is not None else None,
                "state": state, "time": time.time(), **extra}
        # A full or vanished disk must not stop the teardown.
        with contextlib.suppress(OSError):
            _write_atomic(os.path.join(self.node_dir, "agent.json"), json.dumps(data))

    # -------------------------------------------------------------- hangs (issue 14)

    def check_keepalive(self) -> None:
        """The dead-man switch: no word from the launcher for keepalive_s -> tear down.

        Behind a network partition the SSH session neither delivers nor closes, so
        EOF never comes; silence is the only sign. From here on nothing is written to
        the session (it would block); the log files keep everything.
        """
        ka = self.spec.keepalive_s
        if ka <= 0 or self.keepalive_lost or time.monotonic() - self._last_control <= ka:
            return
        self.keepalive_lost = True
        with self._lock:
            self._log("launcher.log", f"clusterkit agent: no keepalive from the launcher for "
                                      f"{ka:g} s: tearing down this node's ranks")
        self.request_stop("keepalive-lost")

    def rank_pids(self) -> dict[int, int]:
        """global rank -> pid of this node's rank processes."""
        if self.ranks:
            first = int((self.spec.native or {})["first_rank"])
            return {first + lr: p.pid for lr, p in self.ranks.items() if p.poll() is None}
        return rank_pids_of(job_processes(self.spec.job_id, self.spec.node, self.spec.attempt))

    def progress(self) -> dict[str, Any]:
        """Seconds since this node's ranks last showed progress, and their steps."""
        now_m, now_w = time.monotonic(), time.time()
        last = {r: now_m - t for r, t in self._last_line.items()}
        steps: dict[int, int] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(self.progress_dir):
                m = re.match(r"rank(\d+)\.heartbeat$", name)
                if not m:
                    continue
                path, rank = os.path.join(self.progress_dir, name), int(m.group(1))
                with contextlib.suppress(OSError, ValueError):
                    mtime = os.stat(path).st_mtime
                    if mtime < self._started_wall:
                        continue  # an earlier attempt's: its step is not this attempt's
                    age = max(0.0, now_w - mtime)
                    last[rank] = min(last.get(rank, age), age)
                    with open(path, encoding="utf-8") as fh:
                        steps[rank] = int(fh.read().strip() or "-1")
        idle = min(last.values()) if last else now_m - self._started
        return {"idle_s": round(idle, 2), "ranks": {str(r): round(a, 2) for r, a in last.items()},
                "step": max(steps.values()) if steps else None,
                "time": round(now_w - idle, 2)}

    def report_progress(self) -> None:
        if time.monotonic() < self._next_progress:
            return
        self._next_progress = time.monotonic() + PROGRESS_EVERY_S
        prog = self.progress()
        self.event("progress", **prog)
        self.write_state("running", progress=prog)  # what `clusterkit status JOB` shows

    def dump_stacks(self) -> None:
        """Every rank's Python stacks: py-spy where installed, else faulthandler's file."""
        pids = self.rank_pids()
        pythons = self.job_pythons(pids.values())
        spy = _py_spy(pythons, self.child_env().get("PATH"))
        self._spy_python = pythons[0] if pythons else sys.executable  # for the hint
        results: dict[str, dict[str, Any]] = {}
        threads = []
        for rank, pid in sorted(pids.items()):
            t = threading.Thread(target=self._dump_one, args=(rank, pid, spy, results))
            t.start()
            threads.append(t)
        for t in threads:
            t.join(DUMP_WAIT_S + 15.0)
        out_dir = os.path.join(self.job_dir, "stacks", f"a{self.spec.attempt}")
        with contextlib.suppress(OSError):
            os.makedirs(out_dir, exist_ok=True)
            for key, res in results.items():
                _write_atomic(os.path.join(out_dir, f"rank{key}.txt"),
                              f"# node {self.spec.node} rank {key} pid {res['pid']} "
                              f"state {res['state']} via {res['tool']}\n{res['text']}")
        self.event("stacks", ranks=results, dir=out_dir)

    def _dump_one(self, rank: int, pid: int, spy: str | None,
                  results: dict[str, dict[str, Any]]) -> None:
        state = _proc_state(pid)
        text, tool, spy_error = "", "none", ""
        if spy:
            # py-spy cannot pause a process that is already stopped (SIGSTOP): read it
            # without pausing then, and as the second try for any other.
            if not state.startswith("T"):
                text, spy_error = _spy_dump(spy, pid)
            if not text:
                text, spy_error = _spy_dump(spy, pid, "--nonblocking")
            tool = "py-spy"
        if not text.strip():
            text, tool = self._faulthandler_dump(rank, pid, state), "faulthandler"
        if not text.strip():
            text, tool = self._no_stack(spy, spy_error), "none"
        results[str(rank)] = {"pid": pid, "state": state, "tool": tool, "text": text}

    def job_pythons(self, pids: Any = ()) -> list[str]:
        """The interpreters this node's ranks run, as paths (a venv's ``bin/python`` as
        typed, not resolved: its py-spy sits beside it): each exec'd rank's argv[0],
        then the job's command's (the native ranks' Python, or torchrun's)."""
        found: list[str] = []
        for pid in pids:
            argv0 = _argv0(pid)
            if argv0 and os.path.isabs(argv0):  # a forked rank's title is not a path
                found.append(argv0)
        if self.spec.argv:
            first = _expand(self.spec.argv[0], self.job_dir)
            path = first if os.sep in first else shutil.which(
                first, path=self.child_env().get("PATH"))
            if path:
                found.append(os.path.abspath(path))
        return list(dict.fromkeys(found))

    def _no_stack(self, spy: str | None, spy_error: str) -> str:
        """Why a rank's dump holds no stack (first line: the summary's), and the fix."""
        python = self._spy_python
        handler = "no faulthandler dump (the program registers none on SIGWINCH)"
        if spy is None:
            why = f"py-spy is not beside {python} nor on PATH, and {handler}"
            fix = (f"fix: {python} -m pip install py-spy on every node, or register "
                   "faulthandler on SIGWINCH (docs/launch.md, Hangs)")
        else:
            why = f"{spy} could not read the process ({spy_error or 'no output'}), and {handler}"
            fix = ("fix: py-spy needs ptrace permission (root, CAP_SYS_PTRACE, or "
                   "kernel.yama.ptrace_scope=0), or register faulthandler on SIGWINCH "
                   "(docs/launch.md, Hangs)")
        return f"{why}\n{fix}\n"

    def _faulthandler_dump(self, rank: int, pid: int, state: str) -> str:
        path = os.path.join(self.progress_dir, f"rank{rank}.stacks")
        size = os.path.getsize(path) if os.path.exists(path) else 0
        _signal(pid, DUMP_SIGNAL)
        if state.startswith("T"):
            # A stopped process handles the signal only once continued; we tear the job
            # down right after, so letting it run for a moment changes nothing.
            _signal(pid, signal.SIGCONT)
        deadline = time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.2)
            if os.path.exists(path) and os.path.getsize(path) > size:
                time.sleep(0.3)  # let faulthandler finish every thread
                with open(path, encoding="utf-8", errors="replace") as fh:
                    fh.seek(size)
                    return fh.read()
        return ""  # nothing written: the program registers no handler

    def hold_for_go(self) -> bool:
        """True once the launcher says GO (the facts are reported), False on a stop."""
        while not self._go.is_set():
            if self._stop.wait(POLL_S / 2):
                return self._go.is_set()
            self.check_keepalive()
        return True

    def run(self) -> int:
        self.prepare()  # while the launcher compares the nodes' facts
        if self.spec.hold:
            self.event("facts", facts=gate_facts(self.spec.needs))
        # The fork server's imports overlap the gate's round trip and the GO. Started
        # after the facts: on a node short of CPUs, its import would delay our report.
        if self.zygote_wanted():
            self.start_zygote()
        if self.spec.hold and not self.hold_for_go():
            self._zygote_drop()
            self.event("exit", code=0, reason=self.stop_reason, held=True)
            return 0
        pumps: list[threading.Thread] = []
        tail: threading.Thread | None = None
        if self.spec.rank_log_dir:
            tail = threading.Thread(target=self.tail_rank_logs, daemon=True)
            tail.start()
        if self.spec.argv and self.spec.native:
            pumps = self.start_ranks()
        elif self.spec.argv:
            self.start_child()
            pumps = [threading.Thread(target=self.pump_child, daemon=True)]
            pumps[0].start()
        else:
            self.write_state("watching")
            self.event("started", pid=None, argv=[])
        while not self._stop.wait(POLL_S):
            if self.child is not None and self.child.poll() is not None:
                break
            if self.ranks and self.check_ranks():
                break
            self.check_keepalive()
            self.report_progress()
        return self.finish(pumps, tail)

    def _exit_code(self) -> int:
        if self.ranks:
            self.check_ranks()
            # The first rank that failed decides (dicts keep the order of exits).
            failed = [c for c in self.rank_codes.values() if c != 0]
            raw: int | None = failed[0] if failed else (
                0 if len(self.rank_codes) == len(self.ranks) else None)
        elif self.child is not None:
            raw = self.child.poll()
        else:
            return 0
        return 128 + (-raw) if raw is not None and raw < 0 else (raw if raw is not None else 137)

    def finish(self, pumps: Sequence[threading.Thread] = (),
               tail: threading.Thread | None = None) -> int:
        node = self.spec.node
        if self.stop_reason is not None:
            self.event("teardown", reason=self.stop_reason)
            # On teardown match untagged job processes too (pdsh-started ranks).
            counts = sweep(self.spec.job_id, node, self.spec.attempt, self.spec.grace_s,
                           self.children())
        else:
            if self.zygote is not None:
                # Its ranks are done: it reports the last exit and ends by itself.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.zygote.wait(2.0)
            # The launcher ended by itself: only stragglers it left behind on this node.
            counts = sweep(self.spec.job_id, node, self.spec.attempt, min(self.spec.grace_s, 1.0),
                           self.children())
        for pump in pumps:
            pump.join(2.0)
        if tail is not None:
            self._tail_done.set()  # the ranks are gone: read what is left, then stop
            tail.join(5.0)
        code = self._exit_code()
        self.write_state("exited", exit_code=code, reason=self.stop_reason, **counts)
        self.event("exit", code=code, reason=self.stop_reason, **counts)
        self.drain()
        for fh in self._logs.values():
            fh.close()
        return code


# ----------------------------------------------------------------- stack helpers


def _proc_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat (T: stopped, as by SIGSTOP)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _argv0(pid: int) -> str:
    """The first word of a process's command line ("" when unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0", 1)[0].decode("utf-8", "replace")
    except OSError:
        return ""


def _py_spy(pythons: Sequence[str] = (), path: str | None = None) -> str | None:
    """py-spy beside the job's Python (``pythons``: a venv's ``bin/python`` has its
    ``bin/py-spy`` beside it, found even when the venv is not on PATH), beside this
    agent's Python, then on ``path`` (the ranks' PATH) and the agent's PATH.
    None: not found, or ``CLUSTERKIT_STACK_TOOL=faulthandler``."""
    if os.environ.get("CLUSTERKIT_STACK_TOOL") == "faulthandler":
        return None
    for python in [*pythons, sys.executable]:
        if python and os.path.isabs(python):
            here = os.path.join(os.path.dirname(python), "py-spy")
            if os.path.isfile(here) and os.access(here, os.X_OK):
                return here
    for search in (path, os.environ.get("PATH")):
        found = shutil.which("py-spy", path=search) if search else None
        if found:
            return found
    return None


def _spy_dump(spy: str, pid: int, *extra: str) -> tuple[str, str]:
    """(the dump, "") or ("", why py-spy gave none: its last error line)."""
    try:
        res = subprocess.run([spy, "dump", *extra, "--pid", str(pid)], capture_output=True,
                             text=True, timeout=15.0, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "", type(exc).__name__
    # Without ptrace permission py-spy fails: the caller falls back to faulthandler.
    if res.returncode == 0:
        return res.stdout, ""
    lines = (res.stderr or res.stdout).strip().splitlines()
    return "", (lines[-1][:160] if lines else f"exit {res.returncode}")


# ----------------------------------------------------------------- entry points


def _read_spec(args: argparse.Namespace) -> Spec:
    if args.spec_b64:
        return AgentSpec.from_json(base64.b64decode(args.spec_b64).decode())
    first = sys.stdin.readline()
    if not first:
        raise SystemExit("clusterkit agent: no job spec on stdin")
    return AgentSpec.from_json(first)


def _install_signals(agent: Agent) -> None:
    def on_signal(signum: int, _frame: Any) -> None:
        agent.request_stop(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)


def _status(job_id: str, job_dir: str | None, node: str | None) -> dict[str, Any]:
    procs = job_processes(job_id, node)
    state: Any = None
    if job_dir and node:
        path = os.path.join(os.path.expanduser(job_dir), "nodes", node, "agent.json")
        try:
            with open(path, encoding="utf-8") as fh:
                state = json.load(fh)
        except (OSError, ValueError):
            state = None
    agent_alive = bool(state and state.get("state") != "exited" and state.get("agent_pid")
                       and os.path.exists(f"/proc/{state['agent_pid']}"))
    pids = rank_pids_of(procs)
    if isinstance(state, dict) and isinstance(state.get("ranks"), dict):
        # Ranks the agent started itself: its own record names them (a forked rank whose
        # environ has no room for RANK is found here too).
        pids.update({int(r): pid for r, pid in state["ranks"].items()
                     if isinstance(pid, int) and pid in procs and r.isdigit()})
    prog = state.get("progress") if isinstance(state, dict) else None
    progress = None
    if isinstance(prog, dict) and isinstance(prog.get("time"), (int, float)):
        # The age on this node's own clock: the launcher's may differ.
        progress = {"step": prog.get("step"), "age_s": round(time.time() - prog["time"], 1)}
    return {"processes": len(procs), "ranks": sorted(pids), "agent": state,
            "agent_alive": agent_alive, "progress": progress,
            # JSON keys are strings: rank -> pid of each live rank of this node.
            "pids": {str(r): pids[r] for r in sorted(pids)},
            "launcher_pid": _live(state, "child_pid", procs),
            "fork_server_pid": _live(state, "zygote_pid", procs)}


def _live(state: Any, key: str, procs: dict[int, dict[bytes, bytes]]) -> int | None:
    """The agent's recorded pid of ``key`` while that process still runs for the job."""
    pid = state.get(key) if isinstance(state, dict) else None
    return pid if isinstance(pid, int) and pid in procs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clusterkit node agent", allow_abbrev=False)
    p.add_argument("--spec-b64")
    p.add_argument("--stop", metavar="JOB_ID")
    p.add_argument("--status", metavar="JOB_ID")
    p.add_argument("--job-dir")
    p.add_argument("--node")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S)
    args = p.parse_args(argv)
    if args.stop:
        print(json.dumps(sweep(args.stop, args.node, None, args.grace)), flush=True)
        return 0
    if args.status:
        print(json.dumps(_status(args.status, args.job_dir, args.node)), flush=True)
        return 0
    try:
        spec = _read_spec(args)
    except ProtocolError as exc:
        # Said on stderr and as the exit code: the launcher shows the agent's last line.
        sys.stderr.write(f"clusterkit agent: {exc}\n")
        return 2
    # ps/top show the job's agent as such, not as `python3 -u -c import linecache,...`.
    zygote.set_title(f"[clusterkit agent job {spec.job_id} node {spec.node}]", AGENT_COMM)
    agent = Agent(spec, sys.stdout)
    agent.start_writer()
    _install_signals(agent)
    threading.Thread(target=agent.read_control, args=(sys.stdin,), daemon=True).start()
    try:
        code = agent.run()
    except (OSError, ValueError) as exc:
        agent.event("error", message=f"{type(exc).__name__}: {exc}")
        agent.drain()
        return 127 if isinstance(exc, FileNotFoundError) else 126
    if agent.keepalive_lost:
        # stdout may be stuck on a dead session: flushing it at exit would block.
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
