"""Python stack dumps of every rank, read and folded into one summary (pure, no I/O).

Two dump formats reach us from the node agents:

* ``faulthandler`` (the workload registers it on SIGWINCH)::

      Current thread 0x00007f... (most recent call first):
        File "/x/main.py", line 280 in _step

* ``py-spy dump``::

      Thread 1234 (idle): "MainThread"
          all_reduce (torch/distributed/distributed_c10d.py:2050)

Each rank is reduced to a short *signature*, the innermost frame and the nearest
frame of the user's own code (``in all_reduce ← _step``); a rank waiting in torch's
``FileBaton.wait`` also names the JIT build lock and whose it is (``..., waiting for
build lock PATH: no live process holds it (stale)``: the agent's lines,
node/provision/jitops.py). Ranks with the same signature fold into one row
(``ranks 0-7,9-13``); rows smaller than the largest one are the odd ones out, and a
stopped process is always odd.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from clusterkit.hostrange import fold, fold_numbers
from clusterkit.node.provision.jitops import BUILD_LOCK_NOTE, STALE, waits_on_baton

_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')
_SPY_THREAD = re.compile(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(([^)]*)\)(?:: "(?P<name>[^"]*)")?')
_SPY_FRAME = re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)")
# Frames of the interpreter's own library and of installed packages are not "where
# the user's code is": the caller we name is the first frame outside these.
_LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")
_LIBRARY_RELATIVE = ("torch/", "deepspeed/", "threading.py", "<frozen ")


@dataclass(frozen=True)
class Frame:
    func: str
    file: str
    line: int


@dataclass(frozen=True)
class RankStack:
    """One rank's dump as the agent sent it, and what we read from it."""

    rank: int
    node: str
    text: str
    state: str = ""  # the process state from /proc (R, S, D, T = stopped, ...)
    tool: str = ""  # py-spy | faulthandler | none
    frames: tuple[Frame, ...] = ()  # the main thread, innermost first

    @property
    def stopped(self) -> bool:
        return self.state.startswith(("T", "t"))


@dataclass(frozen=True)
class StackGroup:
    signature: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    stopped: tuple[int, ...] = ()
    odd: bool = False

    def label(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else \
            f"ranks {_rank_ranges(self.ranks)}"
        where = fold(dict.fromkeys(self.nodes)) if self.nodes else "?"
        stopped = "" if not self.stopped else ", stopped" if self.stopped == self.ranks else \
            f", stopped: {_rank_ranges(self.stopped)}"
        return f"{who} ({where}{stopped}): {self.signature}"


@dataclass
class StackSummary:
    groups: list[StackGroup] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # ranks no dump came back from
    # How to get a stack where a dump had none (the agents' "fix: ..." lines), once each.
    fixes: list[str] = field(default_factory=list)

    def odd_ones(self) -> list[StackGroup]:
        return [g for g in self.groups if g.odd]

    def culprit(self) -> tuple[str, int] | None:
        """(node, rank) the summary blames: a stopped rank first, else the smallest odd group."""
        for g in self.groups:
            if g.stopped:
                rank = g.stopped[0]
                return g.nodes[g.ranks.index(rank)] if len(g.nodes) == len(g.ranks) \
                    else g.nodes[0], rank
        odd = sorted(self.odd_ones(), key=lambda g: len(g.ranks))
        if odd:
            return odd[0].nodes[0], odd[0].ranks[0]
        return None

    def lines(self) -> list[str]:
        out = [("  " + g.label() + ("   <- odd one out" if g.odd else "")) for g in self.groups]
        if self.missing:
            out.append(f"  no dump from ranks {_rank_ranges(tuple(self.missing))}")
        return out + [f"  {fix}" for fix in self.fixes]

    def one_line(self) -> str:
        return "; ".join(g.label() for g in self.groups)


def _rank_ranges(ranks: tuple[int, ...] | list[int]) -> str:
    """``0-7,9-13`` for the ranks."""
    return fold_numbers(sorted(ranks))


def parse_threads(text: str) -> list[tuple[str, list[Frame]]]:
    """Every thread of a faulthandler or py-spy dump: (header, frames innermost first)."""
    threads: list[tuple[str, list[Frame]]] = []
    for raw in text.splitlines():
        if _FH_THREAD.match(raw) or _SPY_THREAD.match(raw):
            threads.append((raw.strip(), []))
            continue
        m = _FH_FRAME.match(raw) or _SPY_FRAME.match(raw)
        if m and threads:
            threads[-1][1].append(Frame(m.group("func"), m.group("file"),
                                        int(m.group("line") or 0)))
    return threads


def main_thread(text: str) -> tuple[Frame, ...]:
    """The thread that runs the script: its outermost frame is ``<module>``."""
    threads = parse_threads(text)
    for header, frames in threads:
        if '"MainThread"' in header or (frames and frames[-1].func == "<module>"):
            return tuple(frames)
    return tuple(threads[0][1]) if threads else ()


def _is_library(frame: Frame) -> bool:
    return any(part in frame.file for part in _LIBRARY) or frame.file.startswith(_LIBRARY_RELATIVE)


def signature(frames: tuple[Frame, ...]) -> str:
    """``in all_reduce ← _step``: the innermost frame and the nearest user frame below it."""
    if not frames:
        return "no Python stack"
    inner = frames[0]
    caller = next((f for f in frames[1:] if not _is_library(f) and f.func != inner.func), None)
    return f"in {inner.func}" + (f" \u2190 {caller.func}" if caller else "")


def read_stack(rank: int, node: str, text: str, state: str = "", tool: str = "") -> RankStack:
    return RankStack(rank=rank, node=node, text=text, state=state, tool=tool,
                     frames=main_thread(text))


def summarize(stacks: Mapping[int, RankStack], world_size: int) -> StackSummary:
    """Fold ranks with the same signature; name the odd ones out.

    A stopped process never folds with running ones: it is stuck in the same
    all_reduce as the others, but it is the one they wait for.
    """
    by_sig: dict[tuple[str, bool], list[RankStack]] = {}
    fixes: dict[str, None] = {}
    for rank in sorted(stacks):
        st = stacks[rank]
        sig = signature(st.frames) if st.frames else no_stack(st.text)
        locks = build_locks(st.text)
        if locks:  # waits in FileBaton.wait: whose build (the agent named the locks)
            sig += ", waiting for build lock " + "; ".join(locks)
            fixes.update(dict.fromkeys(stale_lock_fix(lk) for lk in locks
                                       if lk.endswith(STALE)))
        if not st.frames:
            fixes.update(dict.fromkeys(ln.strip() for ln in st.text.splitlines()
                                       if ln.strip().startswith("fix: ")))
        by_sig.setdefault((sig, st.stopped), []).append(st)
    biggest = max((len(v) for v in by_sig.values()), default=0)
    single_big = sum(1 for v in by_sig.values() if len(v) == biggest) == 1
    groups = []
    for (sig, _), members in sorted(by_sig.items(), key=lambda kv: (-len(kv[1]), kv[1][0].rank)):
        stopped = tuple(m.rank for m in members if m.stopped)
        odd = bool(stopped) or (len(by_sig) > 1 and (len(members) < biggest or not single_big))
        groups.append(StackGroup(signature=sig, ranks=tuple(m.rank for m in members),
                                 nodes=tuple(m.node for m in members), stopped=stopped, odd=odd))
    missing = [r for r in range(world_size) if r not in stacks]
    return StackSummary(groups=groups, missing=missing, fixes=list(fixes))


def no_stack(text: str) -> str:
    """The row of a dump without frames: ``no Python stack: <the agent's first line>``
    (the agent says why: no py-spy where it looked, no faulthandler handler)."""
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return "no Python stack" + (f": {first[:200]}" if first else "")


def build_locks(text: str) -> list[str]:
    """``PATH: held by pid N`` / ``PATH: no live process holds it (stale)`` for a dump that
    waits in torch's FileBaton.wait: the lines the agent added (node/provision/jitops.lock_notes)."""
    if not waits_on_baton(text):
        return []
    return [ln[len(BUILD_LOCK_NOTE):].strip() for ln in text.splitlines()
            if ln.startswith(BUILD_LOCK_NOTE)]


def stale_lock_fix(lock: str) -> str:
    path = lock.rpartition(": ")[0]
    return (f"fix: {path} is a stale JIT build lock (a build killed mid-way): check that no "
            f"build runs, then `rm {path}`; `clusterkit nodes build-ops` builds the ops once "
            "per node before a job")
