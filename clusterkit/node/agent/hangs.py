"""What the launcher's hang watchdog asks of a node (issue 14): progress and stacks.

Part of the node agent (:mod:`clusterkit.node.agent.core`; node program ``agent.core``, whose
module list in :mod:`clusterkit.ship` names this file). Progress: seconds since
each rank last wrote output or touched its heartbeat file, and the step it wrote
there. Stacks (the ``DUMP`` control word): every rank's Python stacks, with py-spy
where it is found, else through the faulthandler the program registered on
``DUMP_SIGNAL``, else one line saying why there is none and how to get one. Its own
module because it only reads the ranks (``/proc``, files) and writes the dumps: it
starts and stops nothing.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from clusterkit.node import protocol
from clusterkit.node.agent.procs import signal_pid
from clusterkit.node.contract import (
    ENV_STACK_TOOL,
    HEARTBEAT_RE,
    STACKS_SUFFIX,
    JobDir,
    progress_file,
)
from clusterkit.node.files import write_atomic
from clusterkit.node.provision import jitops

PROGRESS_EVERY_S = 2.0  # how often the agent reports its ranks' progress
# The job contract (docs/launch.md; node/contract.py): a rank shows progress by writing
# output or by touching its heartbeat file (the workload writes its step there); the
# workload registers faulthandler on DUMP_SIGNAL to write its stacks to its stacks file.
# SIGWINCH: its default action is "ignore", so a script that registered nothing is
# not killed by a stack request.
DUMP_SIGNAL = signal.SIGWINCH
DUMP_WAIT_S = 5.0


def progress(progress_dir: str, last_line: dict[int, float], started: float,
             started_wall: float) -> dict[str, Any]:
    """Seconds since this node's ranks last showed progress, and their steps.

    ``last_line``: global rank -> monotonic time of its last output line; ``started``,
    ``started_wall``: when the agent started (monotonic, wall clock)."""
    now_m, now_w = time.monotonic(), time.time()
    last = {r: now_m - t for r, t in last_line.items()}
    steps: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(progress_dir):
            m = HEARTBEAT_RE.match(name)
            if not m:
                continue
            path, rank = os.path.join(progress_dir, name), int(m.group(1))
            with contextlib.suppress(OSError, ValueError):
                mtime = os.stat(path).st_mtime
                if mtime < started_wall:
                    continue  # an earlier attempt's: its step is not this attempt's
                age = max(0.0, now_w - mtime)
                last[rank] = min(last.get(rank, age), age)
                with open(path, encoding="utf-8") as fh:
                    steps[rank] = int(fh.read().strip() or "-1")
    idle = min(last.values()) if last else now_m - started
    return {"idle_s": round(idle, 2), "ranks": {str(r): round(a, 2) for r, a in last.items()},
            "step": max(steps.values()) if steps else None,
            "time": round(now_w - idle, 2)}


def job_pythons(pids: Iterable[int], command: str | None, path: str | None) -> list[str]:
    """The interpreters this node's ranks run, as paths (a venv's ``bin/python`` as
    typed, not resolved: its py-spy sits beside it): each exec'd rank's argv[0],
    then the job's command's (``command``: the native ranks' Python, or torchrun's,
    looked up on ``path``, the ranks' PATH, when it is a bare name)."""
    found: list[str] = []
    for pid in pids:
        argv0 = _argv0(pid)
        if argv0 and os.path.isabs(argv0):  # a forked rank's title is not a path
            found.append(argv0)
    if command:
        where = command if os.sep in command else shutil.which(command, path=path)
        if where:
            found.append(os.path.abspath(where))
    return list(dict.fromkeys(found))


class StackDump:
    """Every rank's stacks into ``<job_dir>/stacks/a<attempt>/rank<R>.txt``, and one
    :class:`~clusterkit.node.protocol.Stacks` event (``send``: the agent's) that
    carries them to the launcher."""

    def __init__(self, job_dir: str, progress_dir: str, node: str, attempt: int,
                 send: Callable[[protocol.AgentEvent], None]) -> None:
        self.job_dir = job_dir
        self.progress_dir = progress_dir
        self.node = node
        self.attempt = attempt
        self.send = send
        self.spy_python = sys.executable  # the job's Python, named in the py-spy hint

    def dump(self, pids: dict[int, int], pythons: Sequence[str], path: str | None) -> None:
        """py-spy where installed (beside ``pythons`` or on ``path``), else faulthandler."""
        spy = py_spy(pythons, path)
        self.spy_python = pythons[0] if pythons else sys.executable  # for the hint
        results: dict[str, dict[str, Any]] = {}
        threads = []
        for rank, pid in sorted(pids.items()):
            t = threading.Thread(target=self.dump_one, args=(rank, pid, spy, results))
            t.start()
            threads.append(t)
        for t in threads:
            t.join(DUMP_WAIT_S + 15.0)
        out_dir = JobDir(self.job_dir).stacks(self.attempt)
        with contextlib.suppress(OSError):
            os.makedirs(out_dir, exist_ok=True)
            for key, res in results.items():
                write_atomic(os.path.join(out_dir, f"rank{key}.txt"),
                             f"# node {self.node} rank {key} pid {res['pid']} "
                             f"state {res['state']} via {res['tool']}\n{res['text']}")
        self.send(protocol.Stacks(self.node, ranks=results, dir=out_dir))

    def dump_one(self, rank: int, pid: int, spy: str | None,
                 results: dict[str, dict[str, Any]]) -> None:
        state = proc_state(pid)
        text, tool, spy_error = "", "none", ""
        if spy:
            # py-spy cannot pause a process that is already stopped (SIGSTOP): read it
            # without pausing then, and as the second try for any other.
            if not state.startswith("T"):
                text, spy_error = spy_dump(spy, pid)
            if not text:
                text, spy_error = spy_dump(spy, pid, "--nonblocking")
            tool = "py-spy"
        if not text.strip():
            text, tool = self.faulthandler_dump(rank, pid, state), "faulthandler"
        if not text.strip():
            text, tool = no_stack(self.spy_python, spy, spy_error), "none"
        elif jitops.waits_on_baton(text):  # whose build it waits for (launch/stacks.py)
            text = text.rstrip("\n") + "\n" + "".join(f"{n}\n" for n in jitops.lock_notes(pid))
        results[str(rank)] = {"pid": pid, "state": state, "tool": tool, "text": text}

    def faulthandler_dump(self, rank: int, pid: int, state: str) -> str:
        path = progress_file(self.progress_dir, rank, STACKS_SUFFIX)
        size = os.path.getsize(path) if os.path.exists(path) else 0
        signal_pid(pid, DUMP_SIGNAL)
        if state.startswith("T"):
            # A stopped process handles the signal only once continued; we tear the job
            # down right after, so letting it run for a moment changes nothing.
            signal_pid(pid, signal.SIGCONT)
        deadline = time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.2)
            if os.path.exists(path) and os.path.getsize(path) > size:
                time.sleep(0.3)  # let faulthandler finish every thread
                with open(path, encoding="utf-8", errors="replace") as fh:
                    fh.seek(size)
                    return fh.read()
        return ""  # nothing written: the program registers no handler


def no_stack(python: str, spy: str | None, spy_error: str) -> str:
    """Why a rank's dump holds no stack (first line: the summary's), and the fix."""
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


def proc_state(pid: int) -> str:
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


def py_spy(pythons: Sequence[str] = (), path: str | None = None) -> str | None:
    """py-spy beside the job's Python (``pythons``: a venv's ``bin/python`` has its
    ``bin/py-spy`` beside it, found even when the venv is not on PATH), beside this
    agent's Python, then on ``path`` (the ranks' PATH) and the agent's PATH.
    None: not found, or ``CLUSTERKIT_STACK_TOOL=faulthandler``."""
    if os.environ.get(ENV_STACK_TOOL) == "faulthandler":
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


def spy_dump(spy: str, pid: int, *extra: str) -> tuple[str, str]:
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
