"""Small host-side helpers for the test bed: commands, processes, mounts, locks.

Everything here talks to the local kernel only (``ip``, ``/proc``); nothing
touches the network beyond the test bed's own bridge.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from clusterkit.errors import ClusterkitError

# A clean PATH for everything we start inside nodes: the test process's env
# (PYTEST_*, virtualenv tweaks) must not leak into sshd and from there into logins.
NODE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}


class TestbedError(ClusterkitError):
    """The test bed could not be brought up, used, or torn down."""

    __test__ = False  # not a pytest test class despite the name


def run(argv: Sequence[str], *, stdin: str | None = None, timeout: float = 60.0,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a host command; raise TestbedError with its stderr when it fails."""
    try:
        proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise TestbedError(f"{argv[0]} not found",
                           hint="apt-get install iproute2 util-linux openssh-server pdsh") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise TestbedError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                           f"{detail[-1] if detail else 'no output'}")
    return proc


def ip_batch(lines: Iterable[str], *, force: bool = False,
             netns: str | None = None) -> subprocess.CompletedProcess[str]:
    """One ``ip -batch`` for many links/namespaces: far cheaper than one exec each
    (``netns``: every line inside that network namespace)."""
    text = "".join(f"{line}\n" for line in lines)
    if not text:
        return subprocess.CompletedProcess(["ip"], 0, "", "")
    argv = ["ip", *(["-n", netns] if netns else []), *(["-force"] if force else []),
            "-batch", "-"]
    return run(argv, stdin=text, check=not force)


def link_names() -> set[str]:
    out = run(["ip", "-o", "link", "show"]).stdout
    names: set[str] = set()
    for line in out.splitlines():
        # "12: tb1-v3@if2: <...>" -> "tb1-v3"
        parts = line.split(": ", 2)
        if len(parts) >= 2:
            names.add(parts[1].split("@", 1)[0])
    return names


def start_time(pid: int) -> int | None:
    """The kernel start time of ``pid`` (guards against pid reuse), None if gone/zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(pid: int, started: int | None = None) -> bool:
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def pids_in_netns(ns_paths: Iterable[Path]) -> list[int]:
    """Every process whose network namespace is one of ``ns_paths`` (like ``ip netns pids``)."""
    inodes = set()
    for p in ns_paths:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(p).st_ino)
    if not inodes:
        return []
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry.name}/ns/net").st_ino in inodes:
                found.append(int(entry.name))
    return found


def pids_mentioning(text: str) -> list[int]:
    """Host processes (not this one) whose command line contains ``text``: e.g. the Slurm
    bed's munged/slurmctld, which run outside every node with their files under the
    test bed's root, and outlive a pytest that was killed before its teardown."""
    needle = text.encode()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def kill_and_wait(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """SIGKILL ``pids``; return those still alive after ``timeout`` (normally none)."""
    todo = [p for p in pids if p > 1]
    for pid in todo:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while todo and time.monotonic() < deadline:
        todo = [p for p in todo if alive(p)]
        if todo:
            time.sleep(0.02)
    return todo


def mountpoints() -> list[str]:
    """Mount points of the host's mount namespace, octal escapes decoded."""
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 2:
            points.append(fields[1].encode().decode("unicode_escape"))
    return points


@contextlib.contextmanager
def flock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock held for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-lines:])
