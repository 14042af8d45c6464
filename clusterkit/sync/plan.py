"""The pure decisions of a sync (``clusterkit.sync.engine``): no I/O.

* :class:`Chains`: the selected nodes as pipelined chains in inventory order; the
  launcher feeds each chain's head, every node forwards to the next. One chain when
  every node reaches the next; a node lost mid-transfer or a hop that is blocked
  splits a chain (the launcher feeds the rest itself).
* :func:`records`: what travels, in stream order: every (file, chunk) some node lacks,
  with the nodes that lack it (a node writes what names it, forwards what names a
  later node).
* progress: :func:`node_lines` folds nodes in the same state (``node[1-7]: 9.1/14.0 GB``),
  :func:`eta_s`, :func:`fmt_bytes`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from clusterkit.hostrange import folded_lines


@dataclass
class Chains:
    """Node indexes (the order of the selection) grouped into chains, each fed at its head."""

    chains: list[list[int]] = field(default_factory=list)

    @classmethod
    def plan(cls, nodes: Sequence[int]) -> Chains:
        """One chain through every node in order: each link carries the data once, so the
        time stays near size/rate whatever the number of nodes."""
        return cls([list(nodes)] if nodes else [])

    def heads(self) -> list[int]:
        return [c[0] for c in self.chains]

    def chain_of(self, node: int) -> list[int] | None:
        return next((c for c in self.chains if node in c), None)

    def downstream(self, node: int) -> int | None:
        c = self.chain_of(node)
        if c is None:
            return None
        i = c.index(node)
        return c[i + 1] if i + 1 < len(c) else None

    def upstream(self, node: int) -> int | None:
        """The node before it; None for a head (fed by the launcher) or an unknown node."""
        c = self.chain_of(node)
        if c is None or c[0] == node:
            return None
        return c[c.index(node) - 1]

    def split_before(self, node: int) -> int | None:
        """``node`` cannot be reached from its upstream: it heads a chain of its own and
        the rest of its chain; the new head (None when it already was one)."""
        c = self.chain_of(node)
        if c is None or c[0] == node:
            return None
        i = c.index(node)
        self.chains[self.chains.index(c)] = c[:i]
        self.chains.append(c[i:])
        return node

    def lose(self, node: int) -> int | None:
        """``node`` is gone: its upstream keeps the part before it, the node after it heads
        the rest (the launcher re-feeds it); that new head, or None."""
        c = self.chain_of(node)
        if c is None:
            return None
        i = c.index(node)
        before, after = c[:i], c[i + 1:]
        pos = self.chains.index(c)
        self.chains[pos:pos + 1] = [x for x in (before, after) if x]
        return after[0] if after else None

    def members(self, head: int) -> list[int]:
        c = self.chain_of(head)
        return list(c) if c is not None and c[0] == head else []


Record = tuple[int, int, tuple[int, ...]]  # file index, chunk index, the nodes that lack it


def records(needs: Mapping[int, Mapping[int, Iterable[int]]]) -> list[Record]:
    """``needs``: node -> file -> chunks it lacks. Stream order: by file, then chunk."""
    want: dict[tuple[int, int], list[int]] = {}
    for node, files in needs.items():
        for fi, chunks in files.items():
            for ci in chunks:
                want.setdefault((fi, ci), []).append(node)
    return [(fi, ci, tuple(sorted(nodes))) for (fi, ci), nodes in sorted(want.items())]


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_pair(got: int, need: int) -> str:
    """``9.1/14.0 GB``: both in the unit of the larger."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if need >= scale:
            return f"{got / scale:.1f}/{need / scale:.1f} {unit}"
    return f"{got}/{need} B"


@dataclass(frozen=True)
class NodeView:
    """One node's state on the progress line."""

    name: str
    got: int
    need: int
    state: str  # "waiting", "sending", "done", "lost", "failed"

    def text(self) -> str:
        if self.state in ("lost", "failed"):
            return f"{self.state} at {fmt_pair(self.got, self.need)}"
        if not self.need:
            return "up to date"
        return "done" if self.state == "done" else fmt_pair(self.got, self.need)


def node_lines(views: Sequence[NodeView]) -> list[str]:
    """Nodes with the same text share one line, in selection order."""
    return folded_lines(((v.name, v.text()) for v in views), [v.name for v in views])


def eta_s(done: int, total: int, elapsed_s: float) -> float | None:
    """Seconds left at the rate so far; None before anything moved."""
    if done <= 0 or elapsed_s <= 0:
        return None
    return max(0.0, (total - done) * elapsed_s / done)


def progress_line(views: Sequence[NodeView], elapsed_s: float, sent: int) -> str:
    """``sync 41% 5.7/14.0 GB at 48.2 MB/s, ETA 2m53s: node[1-7]: 5.7/14.0 GB``: the
    slowest node's share (the end waits for it), the launcher's rate, the nodes folded."""
    live = [v for v in views if v.state not in ("lost", "failed") and v.need]
    got = min((v.got for v in live), default=0)
    need = max((v.need for v in live), default=0)
    pct = 100 * got // need if need else 100
    eta = eta_s(got, need, elapsed_s)
    eta_txt = "" if eta is None else f", ETA {int(eta) // 60}m{int(eta) % 60:02d}s"
    rate = fmt_bytes(sent / elapsed_s) + "/s" if elapsed_s > 0 else "-"
    return (f"sync {pct}% {fmt_pair(got, need)} at {rate}{eta_txt}: "
            + "; ".join(node_lines(views)))


SSH_COST = "slower: SSH's cipher on this machine's CPU"


@dataclass
class FeedRoutes:
    """How the launcher feeds a node it must feed itself (a chain's head): over TCP to the
    node's port, or, where that port cannot be reached from here at all (a firewall that
    lets only SSH in), over the node's SSH session (its stdin). Node-to-node hops stay TCP."""

    over_ssh: dict[int, str] = field(default_factory=dict)  # node -> why its port failed

    def decide(self, node: int, name: str, port: int, dial_error: str | None
               ) -> tuple[str, str | None]:
        """``("tcp" | "ssh" | "failed", the console note or None)``: the note comes once per
        node; a node already fed over SSH whose stream broke has no route left."""
        if dial_error is None:
            return "tcp", None
        if node in self.over_ssh:
            return "failed", None
        self.over_ssh[node] = dial_error
        return "ssh", (f"{name}: port {port} unreachable from here ({dial_error}): feeding it "
                       f"over SSH ({SSH_COST})")
