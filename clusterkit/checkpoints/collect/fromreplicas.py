"""collect-ckpt's use of replicas (issue 22): which node parts it reads from a replica,
and what the files it reads must hash to. Pure: listings in, a :class:`ReplicaUse` out.

The :class:`~clusterkit.checkpoints.replicas.assemble.Assembly` of the tag decides, per node
index, the copy to read. A part read from a replica becomes a stand-in listing of its
node (the node's name and index, the replica's files and markers), so
:func:`clusterkit.checkpoints.collect.discover.verify` checks the checkpoint as it would with
every node up; a :class:`~clusterkit.checkpoints.sources.base.Route` tells the source which
session reads those files, under which dir. Every file with a manifest's sha256 (a
replica's, or a node's own copy of which a complete replica exists) must arrive with
that digest: a replica corrupted on disk, or a primary file changed since the save, is
refused and the next copy is tried (:func:`next_route`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field

from clusterkit.checkpoints.collectplan import CheckpointIncomplete
from clusterkit.checkpoints.listing import NodeListing
from clusterkit.checkpoints.replicas.assemble import Assembly, PartSource, Ranks, assemble
from clusterkit.checkpoints.sources.base import Route

REPLICA_DAMAGED = "differs from its manifest (corrupted on disk)"


@dataclass(frozen=True)
class Expect:
    """The digest a file must arrive with, and what a mismatch means."""

    sha256: str
    mismatch: str


@dataclass
class ReplicaUse:
    """The assembly collect-ckpt follows and where it stands: ``chosen[N]`` is the
    position in ``assembly.candidates[N]`` read now; ``notes`` what changed and why."""

    assembly: Assembly
    listings: list[NodeListing]
    chosen: dict[int, int]
    notes: list[str] = field(default_factory=list)

    @property
    def tag(self) -> str:
        assert self.assembly.tag is not None
        return self.assembly.tag

    def part(self, index: int) -> PartSource:
        return self.assembly.candidates[index][self.chosen[index]]

    @property
    def routes(self) -> dict[str, Route]:
        """Logical node -> where its files are read, for every part read from a replica."""
        out: dict[str, Route] = {}
        for index in self.chosen:
            p = self.part(index)
            if p.replica:
                out[p.node] = Route(holder=p.host, base=p.root)
        return out

    def expect(self) -> dict[tuple[str, str], Expect]:
        """(node, relpath) -> the manifest digest its file must arrive with."""
        out: dict[tuple[str, str], Expect] = {}
        for index in self.chosen:
            p = self.part(index)
            cands = self.assembly.candidates[index]
            holder = cands[1].host if not p.replica and len(cands) > 1 else p.host
            why = (f"the replica on {p.host} {REPLICA_DAMAGED}"
                   if p.replica else f"{p.host}'s copy differs from the sha256 the manifest of "
                   f"its replica on {holder} recorded (changed since the save?)")
            for rel, digest in p.sha256.items():
                out[(p.node, rel)] = Expect(digest, why)
        return out

    def used(self, verified: bool = True) -> list[str]:
        """One line per part read from a replica: "node index 5 (node6): from its replica
        on node7 (global_step20, verified)" (a dry run: "hashed", nothing copied)."""
        how = "verified" if verified else "hashed"
        return [f"{self.assembly.label(i)}: from its replica on {self.part(i).host} "
                f"({self.tag}, {how})" for i in sorted(self.chosen) if self.part(i).replica]

    def parts_json(self) -> dict[str, dict[str, object]]:
        return {str(i): {"node": self.part(i).node, "from": self.part(i).host,
                         "replica": self.part(i).replica, "root": self.part(i).root}
                for i in sorted(self.chosen)}


def plan_replicas(listings: Sequence[NodeListing], tag: str | None, *,
                  require_markers: bool = True, ranks: Ranks | None = None
                  ) -> ReplicaUse | None:
    """The replicas collect-ckpt uses for ``tag`` (None: the newest that can be
    assembled). None when no node holds any replica: collect as before. Raises
    :class:`CheckpointIncomplete` naming each missing part when a node is unreachable
    and the replicas do not cover it."""
    if not any(ls.replicas for ls in listings if not ls.error):
        return None
    a = assemble(listings, tag, require_markers=require_markers, ranks=ranks)
    if not a.complete:
        if any(ls.error for ls in listings):
            found = ([f"{a.label(i)}: {why}" for i, why in sorted(a.missing.items())]
                     if a.tag is not None else list(a.missing.values()))
            raise CheckpointIncomplete(a.tag, found,
                                       hint="bring the nodes named back, or collect a tag "
                                            "their replicas cover (--tag)")
        return None  # every node answered: verify() names what is wrong, as without replicas
    return ReplicaUse(assembly=a, listings=list(listings), chosen=dict.fromkeys(a.candidates, 0))


def stand_ins(use: ReplicaUse) -> list[NodeListing]:
    """The listings verify() checks: a part read from a replica replaces its node's."""
    out = list(use.listings)
    for index in use.chosen:
        p = use.part(index)
        if not p.replica:
            continue
        holder = next(ls for ls in use.listings if ls.node == p.host)
        copy = holder.replica(index, use.tag)
        assert copy is not None
        prefix = use.tag + "/"
        stand_in = NodeListing(
            node=p.node, index=index, root=p.root, exists=True,
            top={rel: info for rel, info in copy.files.items() if "/" not in rel
                 and rel in p.files},
            latest=None,
            tags={use.tag: {rel[len(prefix):]: info for rel, info in copy.files.items()
                            if rel.startswith(prefix)}},
            markers={use.tag: {posixpath.basename(rel): text
                               for rel, text in copy.markers.items()}})
        at = [k for k, ls in enumerate(out) if ls.index == index]
        if at:
            out[at[0]] = stand_in
        else:
            out.append(stand_in)
    return out


def next_route(use: ReplicaUse, node: str, why: str) -> bool:
    """Move ``node``'s part to its next copy after ``why``; False when none is left."""
    index = next((i for i in use.chosen if use.part(i).node == node), None)
    if index is None or use.chosen[index] + 1 >= len(use.assembly.candidates[index]):
        return False
    before = use.part(index)
    use.chosen[index] += 1
    after = use.part(index)
    what = "its replica on " + before.host if before.replica else "its own copy on " + before.host
    use.notes.append(f"{use.assembly.label(index)}: {what} was refused ({why}); "
                     f"reading its replica on {after.host} instead")
    return True
