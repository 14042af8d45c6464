"""Who builds a JIT op's lock: our build step's owner record beside torch's ``lock``.

Standard library only (shipped with :mod:`clusterkit.node.provision.jitops`, ship.py).

torch's ``<build dir>/lock`` says nothing of its builder, and a builder on another node
sharing the directory (an NFS home) holds it where no /proc here shows it. Our build step
(``provision.jitops build``, the one process per node that builds before the ranks start) keeps
``lock.owner`` beside it: "host pid start boot pidns", rewritten every OWNER_REFRESH_S
while that process holds the lock. Any node then judges the lock (:func:`judge`): on the
builder's own host (same boot, same PID namespace) by whether that pid still runs with
that start time; elsewhere by the record's age, as a live builder refreshes it
(docs/getting-nodes-ready.md, "Shared extension directories").
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List  # noqa: UP035 - runs on Python 3.8 nodes

from clusterkit.node.files import write_atomic

OWNER_SUFFIX = ".owner"
OWNER_REFRESH_S = 5.0
OWNER_TTL_S = 60.0  # a record older than this is a dead builder's (12 missed refreshes)
LIVE = ("held", "building")  # the states of a lock a build holds right now


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def start_time(pid: int, proc: str = "/proc") -> str:
    """The process's start (clock ticks since boot, /proc/PID/stat field 22): a pid and
    its start name one process even after the pid is reused. "" when it is gone, a zombie
    included: a killed build whose parent has not reaped it yet (state Z) still shows its
    stat, and holds nothing (test_jitops_shared_testbed saw it 'building' right after the
    kill, one run in two)."""
    stat = _read(os.path.join(proc, str(pid), "stat"))
    fields = stat[stat.rfind(")") + 2:].split() if ")" in stat else []
    if len(fields) <= 19 or fields[0] in ("Z", "X"):
        return ""
    return fields[19]


def here() -> Dict[str, str]:  # noqa: UP006
    """Who this process's records name: host, boot id and PID namespace (a pid means
    something only within one boot of one PID namespace of one host)."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pidns": pidns}


def owner_line(pid: int) -> str:
    me = here()
    return f"{me['host']} {pid} {start_time(pid) or '?'} {me['boot'] or '?'} {me['pidns'] or '?'}\n"


def parse_owner(text: str) -> Dict[str, Any] | None:  # noqa: UP006
    words = text.split()
    if len(words) != 5 or not words[1].isdigit():
        return None
    return {"host": words[0], "pid": int(words[1]), "start": words[2], "boot": words[3],
            "pidns": words[4]}


def judge(holders_: List[int], owner: Dict[str, Any] | None, owner_age_s: float,  # noqa: UP006
          me: Dict[str, str], start_of: Callable[[int], str] = start_time) -> Dict[str, str]:  # noqa: UP006
    """Whether a build holds the lock now. Pure but for ``start_of(pid)`` (the process's
    start time here, "" when gone). ``held``: a process here has it open; ``building``: the
    record's builder runs (here: that pid with that start; elsewhere: it refreshed the record
    within OWNER_TTL_S); ``dead``: the record proves its builder gone; ``unknown``: no
    process here holds it and no builder recorded it (a rank's own build on another node
    looks like this, and so does a killed one: only its age tells them apart)."""
    if holders_:
        return {"state": "held", "why": f"held by pid {', '.join(map(str, holders_))}"}
    if owner is None:
        return {"state": "unknown", "why": "no live process here holds it and no builder "
                                           "recorded it"}
    host, pid = str(owner["host"]), int(owner["pid"])
    if (host, owner.get("boot"), owner.get("pidns")) == (me["host"], me["boot"], me["pidns"]):
        if owner.get("start") not in ("?", "") and start_of(pid) == owner.get("start"):
            return {"state": "building", "why": f"building on {host} (pid {pid})", "host": host}
        return {"state": "dead", "why": f"its builder, pid {pid} on {host}, is gone",
                "host": host}
    if owner_age_s <= OWNER_TTL_S:
        return {"state": "building", "host": host,
                "why": f"building on {host} (pid {pid}; record {max(owner_age_s, 0):.0f} s old)"}
    return {"state": "dead", "host": host,
            "why": f"its builder on {host} (pid {pid}) stopped refreshing its record "
                   f"{owner_age_s:.0f} s ago"}


def owner_of(lock: str, now: float) -> tuple[Dict[str, Any] | None, float]:  # noqa: UP006
    """The lock's owner record and its age (None when there is none)."""
    path = lock + OWNER_SUFFIX
    try:
        age = now - os.stat(path).st_mtime
    except OSError:
        return None, 0.0
    return parse_owner(_read(path)), age


class Owner:
    """Our build's record beside ``lock`` while this process holds the lock (a thread
    looks every ``poll_s``: torch takes the lock inside ``load``); removed at exit. A
    SIGKILL leaves it, naming a pid that is gone: the next start proves the lock dead."""

    def __init__(self, lock: str, poll_s: float = 0.5) -> None:
        self.lock, self.poll_s = lock, poll_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Owner:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        if parse_owner(_read(self.lock + OWNER_SUFFIX)) == parse_owner(owner_line(os.getpid())):
            with contextlib.suppress(OSError):
                os.unlink(self.lock + OWNER_SUFFIX)

    def _run(self) -> None:
        wrote = 0.0
        while not self.stop.wait(self.poll_s):
            if holds(self.lock) and time.monotonic() - wrote >= OWNER_REFRESH_S:
                with contextlib.suppress(OSError):
                    # Readers see a whole line; in a home shared by several nodes, the
                    # temp name is unique across hosts (a pid alone is not).
                    write_atomic(self.lock + OWNER_SUFFIX, owner_line(os.getpid()))
                    wrote = time.monotonic()


def holds(path: str) -> bool:
    """This process has ``path`` open (torch's FileBaton keeps its O_EXCL fd open)."""
    want = os.path.realpath(path)
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(os.path.join("/proc/self/fd", fd)) == want:
                return True
    return False
