"""Put the calling thread's CPU and disk use below the ranks' (checkpoint replicas, issue 31).

Part of the node agent (node program ``agent.core``, ``ship.py``): the replica copy runs
in threads of the agent's copy process (``node/replicas/proc.py``, ``node/replicas/wire.py``) and
must take what the ranks leave, no more. :func:`lower_this_session` lowers that process's
session; :func:`lower_this_thread` applies, to the calling thread only, each of:

* **CPU policy** ``SCHED_IDLE`` (``os.sched_setscheduler`` on the thread's native id;
  allowed without privileges), else nice 19. This ranks the copy below every normal
  task *of the same scheduling group* only: Linux's autogroup puts each session in a
  group of its own, and the ranks run in sessions of their own, so under autogroup
  neither nice nor SCHED_IDLE keeps the copy's session from taking its equal share.
* **Session** (:func:`lower_this_session`, for a process that leads a session of its
  own: ``node/replicas/proc.py``'s copy process, ``slurm.replica serve``): its autogroup at
  nice 19, which ranks the whole session below the ranks' sessions (measured here: a
  busy loop beside another on one CPU got 0.01 CPU-s of 0.5). Allowed without
  privileges (a higher nice only).
* No cpu cgroup. Moving the copy thread into a cgroup v1 group with ``cpu.shares`` 15
  did take it below the ranks' sessions, but starved it for seconds while it held the
  agent's shared state (its output to the launcher): on the test bed's CPU-bound ranks
  jobs then lost ranks to SIGKILL right after a save (the full suite's 7x2 and lost-node
  runs). Removed until the copy shares nothing with the agent's control path.
* **I/O class idle** (``ioprio_set`` through ctypes, else ``ionice -c3``): the disk
  serves the copy when nobody else asks; honoured by the bfq (and old cfq) schedulers
  only — the line says which scheduler the checkpoint's disk has.

Every step falls back silently; the returned line says what applied (the agent writes it
to the node's ``launcher.log``). Standard library only, Python >= 3.8, Linux (elsewhere
nothing applies).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import threading

IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
IOPRIO_WHO_PROCESS = 1  # "process" is a thread id to the kernel: per thread
# ioprio_set's number per architecture (asm/unistd.h).
SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "riscv64": 30, "ppc64le": 273,
                  "ppc64": 273, "s390x": 282, "i686": 289, "armv7l": 314}


def lower_this_thread(path: str = "") -> str:
    """CPU and I/O priority of the calling thread as low as allowed; what applied, in
    words. ``path``: a file or dir on the disk the thread will use (for the line)."""
    tid = threading.get_native_id()
    parts = [_cpu_policy(tid), _io_idle(tid)]
    sched = _io_scheduler(path) if path else ""
    if sched:
        parts[-1] += f" (the disk's scheduler: {sched}"\
                     + ("" if sched in ("bfq", "cfq") else ", which ignores I/O classes") + ")"
    return "; ".join(p for p in parts if p)


def lower_this_session(proc: str = "/proc") -> str:
    """This process's session (its autogroup) at nice 19, when it leads a session of its
    own: under autogroup the one thing, short of a cgroup, that puts its CPU below other
    sessions' (the ranks'). What applied, in words; "" where nothing did."""
    try:
        if os.getsid(0) != os.getpid():
            return ""  # the session is shared: lowering it would lower its other members
        with open(os.path.join(proc, "sys/kernel/sched_autogroup_enabled"), encoding="ascii") as fh:
            if fh.read().strip() != "1":
                return ""
        with open(os.path.join(proc, "self/autogroup"), "w", encoding="ascii") as fh:
            fh.write("19")
        return "CPU: autogroup nice 19"
    except OSError:
        return ""


def _cpu_policy(tid: int) -> str:
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return "CPU: SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        return "CPU: nice 19 (SCHED_IDLE refused)"
    except (AttributeError, OSError):
        return "CPU: normal (neither SCHED_IDLE nor nice allowed)"


def _io_idle(tid: int) -> str:
    number = SYS_IOPRIO_SET.get(platform.machine())
    if number is not None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            value = IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT
            if libc.syscall(number, IOPRIO_WHO_PROCESS, tid, value) == 0:
                return "I/O: idle class"
        except (OSError, AttributeError, ImportError):
            pass
    ionice = shutil.which("ionice")
    if ionice is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run([ionice, "-c", "3", "-p", str(tid)], capture_output=True,
                                  timeout=5, check=False)
            if done.returncode == 0:
                return "I/O: idle class (ionice)"
    return "I/O: normal (idle class refused)"


def _io_scheduler(path: str) -> str:
    """The I/O scheduler of the block device holding ``path`` or its nearest existing
    parent ('' when unknown)."""
    while True:
        try:
            dev = os.stat(path).st_dev
            break
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return ""
            path = parent
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (os.path.join(base, "queue"), os.path.join(base, "..", "queue")):
        with contextlib.suppress(OSError):
            with open(os.path.join(queue, "scheduler"), encoding="ascii") as fh:
                text = fh.read()
            start, end = text.find("["), text.find("]")
            return text[start + 1:end] if 0 <= start < end else text.strip()
    return ""
