"""Which copy of each node's part of a node-local checkpoint can be used (issue 22).

Pure: every reachable node's listing (:class:`~clusterkit.checkpoints.listing.NodeListing`,
the replica area included) in, an :class:`Assembly` out. The rules are not here: they are
node/replicas/rules.py's (issue 36), the ones the Slurm restore on the nodes
(node/slurm/restore.py) asks too; this module turns typed listings into the rules' values
and their answers into :class:`PartSource`s. For a tag, each node index N (the node's
position in the job's plan, the index of ``clusterkit-complete.node<N>.json``) gets its
part from

1. its own node: reachable, its completion marker for the tag present and every file the
   marker lists present with the marker's size (and no ``.pt`` cut short); for a user's
   script (no markers, ``require_markers=False``) every file DeepSpeed owes the node's
   ranks, none cut short (``rules.own_problem``); else
2. a complete replica on another reachable node (``<root>.replicas/node<N>/<tag>/``): its
   manifest present, of a known version, naming this tag and source, every file it lists
   present with the manifest's size, none cut short, and the source's completion marker
   among them when the job writes markers (``rules.copy_problem``). Replicas are
   tried in ring order (N+1, N+2, ...), the order the replication service places them.

Sizes are what a listing can check; the sha256 of a replica's files is checked when they
are read (collect-ckpt compares the streamed digest with :attr:`PartSource.sha256`).

Used by ``collect-ckpt`` (which copies to take), ``status`` (replica health per tag),
the launcher's refusal and the restore onto a spare node::

    a = assemble(listings)             # the newest tag that can be assembled
    if not a.complete:
        raise SomeError(a.describe())  # names each missing node index and why
    for index, part in a.sources.items():
        part.host, part.root, part.replica, part.sha256
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.checkpoints.listing import FileInfo, NodeListing
from clusterkit.node.contract import LATEST_FILE, RECOVERY_SCRIPTS, replica_dir
from clusterkit.node.replicas.rules import (
    Copy,
    Holding,
    Source,
    part_sources,
    read_marker,
)
from clusterkit.node.replicas.rules import candidate_tags as rule_tags


@dataclass(frozen=True)
class PartSource:
    """Where node index ``index``'s part of the tag can be read: on ``host``, under
    ``root`` (a checkpoint root: ``<tag>/...``, for node 0 also ``latest`` and the
    recovery scripts). ``files`` maps each relpath under ``root`` to its size;
    ``sha256`` holds the manifest's digests (a replica's, or for the node's own copy the
    manifest of a complete replica of it, which its files should equal)."""

    index: int
    node: str  # the node whose part this is
    host: str  # the node holding these files
    root: str
    replica: bool
    files: Mapping[str, int] = field(default_factory=dict)
    sha256: Mapping[str, str] = field(default_factory=dict)

    def describe(self, tag: str) -> str:
        return (f"from its replica on {self.host} ({tag})" if self.replica
                else f"from its own copy on {self.host}")


@dataclass(frozen=True)
class Assembly:
    """The decision for one tag. ``sources[N]`` is the first of ``candidates[N]`` (own
    copy first, then replicas in ring order); ``missing[N]`` says why node index N has
    no usable copy. ``own`` are the indexes whose own node has its part; ``replicated[N]``
    the nodes holding a complete replica of N's part."""

    tag: str | None
    names: Mapping[int, str]  # node index -> node name
    sources: Mapping[int, PartSource]
    candidates: Mapping[int, tuple[PartSource, ...]]
    missing: Mapping[int, str]
    own: frozenset[int] = frozenset()
    replicated: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.tag is not None and not self.missing and bool(self.sources)

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    @property
    def from_replicas(self) -> dict[int, PartSource]:
        return {i: s for i, s in self.sources.items() if s.replica}

    def label(self, index: int) -> str:
        """``node index 5 (node6)``: how every message names a part."""
        name = self.names.get(index)
        return f"node index {index} ({name})" if name else f"node index {index}"

    def describe(self) -> str:
        """One line: what is missing and why, or which parts come from replicas."""
        if self.tag is None:
            return "no checkpoint: " + "; ".join(self.missing.values())
        if self.missing:
            return (f"checkpoint {self.tag} cannot be assembled from the reachable nodes and "
                    "replicas: " + "; ".join(f"{self.label(i)}: {why}"
                                             for i, why in sorted(self.missing.items())))
        used = [f"{self.label(i)} {s.describe(self.tag)}"
                for i, s in sorted(self.from_replicas.items())]
        return (f"checkpoint {self.tag}: {len(self.own)}/{self.num_nodes} node parts on their "
                "own nodes" + ("; " + "; ".join(used) if used else ""))


Ranks = Mapping[int, Sequence[int]]  # node index -> its global ranks


def assemble(listings: Sequence[NodeListing], tag: str | None = None, *,
             expect_nodes: int | None = None, require_markers: bool = True,
             ranks: Ranks | None = None) -> Assembly:
    """The assembly of ``tag`` (None: the newest tag that can be assembled, else the
    newest tag seen, whose ``missing`` then says why). ``listings`` carry the node index
    in ``index`` (unreachable nodes: a listing with ``error``); ``expect_nodes`` is the
    job's node count when known (else the markers' ``num_nodes``, else the listings').
    ``require_markers=False``: a user script's save, whose own copy counts when it holds
    every file DeepSpeed owes the node's ``ranks`` (node index -> global ranks; unknown:
    when its tag dir holds any file)."""
    if tag is not None:
        return _assemble_tag(listings, tag, expect_nodes, require_markers, ranks)
    tags = candidate_tags(listings, markers=require_markers)
    if not tags:
        return Assembly(tag=None, names=_names(listings, expect_nodes), sources={},
                        candidates={}, missing={-1: "no tag with a completion marker or a "
                                                "replica manifest on any reachable node"})
    first: Assembly | None = None
    for t in tags:
        a = _assemble_tag(listings, t, expect_nodes, require_markers, ranks)
        if a.complete:
            return a
        first = first or a
    assert first is not None
    return first


def candidate_tags(listings: Sequence[NodeListing], *, markers: bool = True) -> list[str]:
    """Every tag some reachable node has a marker or a replica manifest of (``markers``
    False, a user's script: or any DeepSpeed checkpoint file of), newest first: the
    rule is node/replicas/rules.candidate_tags."""
    up = [ls for ls in listings if not ls.error]
    own = [(t, _copy(files, ls.markers.get(t, {})))
           for ls in up for t, files in ls.tags.items() if files is not None]
    copies = [(c.tag, _copy(c.files, c.markers, c.manifest))
              for ls in up for r in ls.replicas.values() for c in r.copies.values() if c]
    return rule_tags(own, copies, markers)


def _copy(files: Mapping[str, FileInfo], markers: Mapping[str, str],
          manifest: str | None = None) -> Copy:
    """A listing's files as the rules read them."""
    return Copy(files={rel: (fi.size, fi.mtime, fi.whole) for rel, fi in files.items()},
                markers=markers, manifest=manifest)


def _holding(ls: NodeListing, tag: str) -> Holding:
    """What ``ls`` shows of ``tag``: its own tag dir (its part, node index ``ls.index``)
    and its replicas of other nodes' parts."""
    files = ls.tags.get(tag)
    own = _copy(files, ls.markers.get(tag, {})) if ls.exists and files is not None else None
    copies = {src: _copy(c.files, c.markers, c.manifest) for src, r in ls.replicas.items()
              if (c := r.copies.get(tag)) is not None}
    return Holding(host=ls.node, position=ls.index, own=own, copies=copies, error=ls.error)


def _names(listings: Sequence[NodeListing], expect_nodes: int | None,
           markers_say: int | None = None) -> dict[int, str]:
    count = expect_nodes or markers_say or (max((ls.index for ls in listings), default=-1) + 1)
    by_index = {ls.index: ls.node for ls in listings}
    return {i: by_index.get(i, "") for i in range(count)}


def ranks_of_map(rank_map: Sequence[Sequence[Any]]) -> dict[int, range]:
    """A launched job's ``rank_map`` (``[[node, first_rank, nproc], ...]``, node index
    order) -> node index -> its global ranks."""
    return {i: range(int(first), int(first) + int(n)) for i, (_, first, n) in enumerate(rank_map)}


def ranks_of_slots(slots: Sequence[int]) -> dict[int, range]:
    """Ranks placed in node order, ``slots[i]`` on node index i (DeepSpeed's and
    torchrun's order, what clusterkit's plans use)."""
    out, first = {}, 0
    for i, n in enumerate(slots):
        out[i] = range(first, first + n)
        first += n
    return out


def _assemble_tag(listings: Sequence[NodeListing], tag: str, expect_nodes: int | None,
                  require_markers: bool, ranks: Ranks | None = None) -> Assembly:
    names = _names(listings, expect_nodes, _markers_num_nodes(listings, tag))
    by_host = {ls.node: ls for ls in listings}
    found, missing = part_sources([_holding(ls, tag) for ls in listings], tag, len(names),
                                  require_markers, ranks)
    sources: dict[int, PartSource] = {}
    candidates: dict[int, tuple[PartSource, ...]] = {}
    own: set[int] = set()
    replicated: dict[int, tuple[str, ...]] = {}
    for index, found_here in found.items():
        cands = [_part(by_host[s.host], s, tag, names) for s in found_here]
        reps = [c for c in cands if c.replica]
        if reps:
            replicated[index] = tuple(r.host for r in reps)
        if cands and not cands[0].replica:
            own.add(index)
            if reps:  # the own files should equal what their replica's source sent
                cands[0] = dataclasses.replace(cands[0], sha256=reps[0].sha256)
        candidates[index] = tuple(cands)
        if cands:
            sources[index] = cands[0]
    return Assembly(tag=tag, names=names, sources=sources, candidates=candidates,
                    missing=missing, own=frozenset(own), replicated=replicated)


def _part(ls: NodeListing, s: Source, tag: str, names: Mapping[int, str]) -> PartSource:
    """Where the rules' source ``s`` is read: the holder's root (its own tag dir; node 0's
    part also ``latest`` while it names this tag, and the recovery scripts) or the
    replica dir, with the manifest's sizes and digests."""
    if s.manifest is not None:
        m = s.manifest
        return PartSource(index=s.index, node=names.get(s.index) or m.source_host, host=ls.node,
                          root=replica_dir(ls.root, s.index, tag), replica=True,
                          files={rel: size for rel, (size, _) in m.files.items()},
                          sha256={rel: digest for rel, (_, digest) in m.files.items()})
    part = {posixpath.join(tag, rel): info.size for rel, info in (ls.tags.get(tag) or {}).items()}
    if s.index == 0:  # 'latest' only while it names this tag (as a replica holds it)
        part.update({name: info.size for name, info in ls.top.items()
                     if name in RECOVERY_SCRIPTS
                     or (name == LATEST_FILE and ls.latest == tag)})
    return PartSource(index=s.index, node=names.get(s.index) or ls.node, host=ls.node,
                      root=ls.root, replica=False, files=part)


def _markers_num_nodes(listings: Sequence[NodeListing], tag: str) -> int | None:
    """The run's node count as any readable marker of ``tag`` (own or in a copy) says."""
    texts = [t for ls in listings if not ls.error for t in ls.markers.get(tag, {}).values()]
    texts += [t for ls in listings if not ls.error for r in ls.replicas.values()
              if (c := r.copies.get(tag)) is not None for t in c.markers.values()]
    for text in texts:
        marker = read_marker(text)
        if marker is not None:
            return marker.num_nodes
    return None


def to_json(a: Assembly) -> dict[str, Any]:
    """The assembly for ``--json`` outputs."""
    return {
        "tag": a.tag, "complete": a.complete, "nodes": a.num_nodes, "own": len(a.own),
        "replicated": len(a.replicated),
        "parts": {str(i): {"node": a.names.get(i, ""), "from": s.host, "replica": s.replica,
                           "root": s.root}
                  for i, s in sorted(a.sources.items())},
        "missing": {str(i): why for i, why in sorted(a.missing.items())},
    }
