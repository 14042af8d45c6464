"""The results of a sync (``clusterkit.sync.engine``): per node, overall,
and the progress it reports while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from clusterkit.sync.plan import NodeView, fmt_bytes


@dataclass(frozen=True)
class Progress:
    views: tuple[NodeView, ...]
    elapsed_s: float
    sent: int  # bytes sent from this machine so far


@dataclass
class NodeResult:
    node: str
    state: str = "starting"  # -> "done", "lost" or "failed"
    need_bytes: int = 0
    got_bytes: int = 0
    files_sent: int = 0
    unchanged: int = 0
    deleted: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # only on the node, kept (no delete)
    digest: str | None = None
    failed: dict[str, str] = field(default_factory=dict)  # file -> why
    lacking: list[str] = field(default_factory=list)
    lacking_count: int = 0
    links_made: int = 0  # symbolic links made or repointed (the others were right)
    links_failed: int = 0  # of ``failed``, how many are links
    why: str = ""

    def summary(self) -> str:
        """One line without the node's name (equal lines fold into node ranges)."""
        if self.state == "failed":
            return f"failed: {self.why}"
        if self.state == "lost":
            return (f"lost mid-transfer ({self.why}): {fmt_bytes(self.got_bytes)} of "
                    f"{fmt_bytes(self.need_bytes)} in {self.files_sent} file(s) delivered; "
                    "run sync again to complete it")
        parts = [f"{self.files_sent - len(self.failed) + self.links_failed} file(s) sent "
                 f"({self.got_bytes:,} bytes, verified)", f"{self.unchanged} unchanged"]
        if self.links_made:
            parts.append(f"{self.links_made} link(s) made")
        if self.failed:
            first = sorted(self.failed)[0]
            parts.append(f"{len(self.failed)} failed ({first}: {self.failed[first]})")
        if self.deleted:
            parts.append(f"{len(self.deleted)} deleted")
        if self.extra:
            parts.append(f"{len(self.extra)} extra file(s) kept (--delete removes them)")
        return ", ".join(parts)


@dataclass
class SyncResult:
    digest: str  # the source's (node/sync/store.tree_digest)
    files: int
    total_bytes: int
    nodes: dict[str, NodeResult]  # in the nodes' order
    sent_bytes: int = 0  # bytes this machine sent
    hashed_bytes: int = 0  # bytes hashed here (the cache spares the rest)
    seconds: float = 0.0
    chains: list[list[str]] = field(default_factory=list)  # as first planned
    notes: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # source files changed while read
    links: list[str] = field(default_factory=list)  # symbolic links not copied (dangling, loop)
    symlinks: int = 0  # symbolic links carried as links (they stay inside the directory)

    def node_ok(self, name: str) -> bool:
        r = self.nodes[name]
        return r.state == "done" and not r.failed and r.digest == self.digest

    @property
    def ok(self) -> bool:
        return not self.changed and all(self.node_ok(n) for n in self.nodes)
