"""Which copy of each node's part of a node-local checkpoint can be used (issue 22).

Pure: every reachable node's listing (:class:`~clusterkit.checkpoints.listing.NodeListing`,
the replica area included) in, an :class:`Assembly` out. For a tag, each node index N
(the node's position in the job's plan, the index of ``clusterkit-complete.node<N>.json``)
gets its part from

1. its own node: reachable, its completion marker for the tag present and every file the
   marker lists present with the marker's size (and no ``.pt`` cut short); for a user's
   script (no markers, ``require_markers=False``) the replicas' own rule instead
   (node/replica_done.part_problem: every file DeepSpeed owes the node's ranks, none cut
   short); else
2. a complete replica on another reachable node (``<root>.replicas/node<N>/<tag>/``): its
   manifest present, of a known version, naming this tag and source, every file it lists
   present with the manifest's size. Replicas are tried in ring order (N+1, N+2, ...),
   the order the replication service places them.

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
import json
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.checkpoints import layout
from clusterkit.checkpoints.listing import FileInfo, NodeListing, ReplicaCopy
from clusterkit.errors import CheckpointError
from clusterkit.node.contract import (
    LATEST_FILE,
    RECOVERY_SCRIPTS,
    REPLICA_MANIFEST,
    REPLICA_SCHEMA,
    REPLICA_SCHEMA_VERSION,
    marker_name,
    replica_dir,
    tag_step,
)
from clusterkit.node.replica_done import part_problem


@dataclass(frozen=True)
class ReplicaManifest:
    """``clusterkit-replica.json`` (node/contract.py): every file of one copy with the
    size and sha256 its source computed while sending it."""

    job_id: str
    tag: str
    source: int
    source_host: str
    holder: str
    files: Mapping[str, tuple[int, str]]  # relpath (to the replica dir) -> (size, sha256)
    completed: float


def parse_replica_manifest(text: str) -> ReplicaManifest:
    """Parse a manifest; ValueError says what is wrong with it."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("schema") != REPLICA_SCHEMA:
        raise ValueError("not a clusterkit replica manifest")
    if data.get("version") != REPLICA_SCHEMA_VERSION:
        raise ValueError(f"manifest version {data.get('version')!r} unknown "
                         f"(this clusterkit reads {REPLICA_SCHEMA_VERSION})")
    try:
        files = {str(rel): (int(v["size"]), str(v["sha256"])) for rel, v in data["files"].items()}
        return ReplicaManifest(job_id=str(data["job_id"]), tag=str(data["tag"]),
                               source=int(data["source"]), source_host=str(data["source_host"]),
                               holder=str(data["holder"]), files=files,
                               completed=float(data["completed"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed manifest ({exc})") from None


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
    False, a user's script: or any DeepSpeed checkpoint file of), newest first."""
    tags: set[str] = set()
    for ls in listings:
        if ls.error:
            continue
        tags.update(t for t, m in ls.markers.items() if m)
        if not markers:
            tags.update(t for t, files in ls.tags.items() if files and any(
                layout.parse_shard_name(posixpath.basename(rel)) for rel in files))
        tags.update(c.tag for r in ls.replicas.values() for c in r.copies.values()
                    if c is not None and c.manifest is not None)
    newest = _newest_mtimes(listings)
    return sorted(tags, key=lambda t: (tag_step(t), newest.get(t, 0.0), t), reverse=True)


def _newest_mtimes(listings: Sequence[NodeListing]) -> dict[str, float]:
    """tag -> the newest mtime of its files anywhere (own copies and replicas): the order
    of tags that name no step."""
    out: dict[str, float] = {}
    for ls in listings:
        seen = [(t, f) for t, f in ls.tags.items() if f]
        seen += [(c.tag, c.files) for r in ls.replicas.values() for c in r.copies.values() if c]
        for tag, files in seen:
            out[tag] = max([out.get(tag, 0.0), *(fi.mtime for fi in files.values())])
    return out


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
    by_index = {ls.index: ls for ls in listings}
    n = len(names)
    sources: dict[int, PartSource] = {}
    candidates: dict[int, tuple[PartSource, ...]] = {}
    missing: dict[int, str] = {}
    own: set[int] = set()
    replicated: dict[int, tuple[str, ...]] = {}
    for index in range(n):
        mine = by_index.get(index)
        own_part, own_why = _own_part(mine, index, tag, require_markers,
                                      None if ranks is None else ranks.get(index))
        holders = sorted((ls for ls in listings if ls.index != index),
                         key=lambda ls: (ls.index - index) % max(n, 1))
        reps, rep_why = _replica_parts(holders, index, names.get(index, ""), tag)
        if reps:
            replicated[index] = tuple(r.host for r in reps)
        if own_part is not None:
            own.add(index)
            if reps:  # the own files should equal what their replica's source sent
                own_part = dataclasses.replace(own_part, sha256=reps[0].sha256)
        cands = ((own_part,) if own_part is not None else ()) + tuple(reps)
        candidates[index] = cands
        if cands:
            sources[index] = cands[0]
        else:
            missing[index] = "; ".join([own_why, rep_why])
    return Assembly(tag=tag, names=names, sources=sources, candidates=candidates,
                    missing=missing, own=frozenset(own), replicated=replicated)


def _markers_num_nodes(listings: Sequence[NodeListing], tag: str) -> int | None:
    """The run's node count as any readable marker of ``tag`` (own or in a copy) says."""
    texts = [t for ls in listings if not ls.error for t in ls.markers.get(tag, {}).values()]
    texts += [t for ls in listings if not ls.error for r in ls.replicas.values()
              if (c := r.copies.get(tag)) is not None for t in c.markers.values()]
    for text in texts:
        marker = _marker(text)
        if marker is not None:
            return marker.num_nodes
    return None


def _marker(text: str) -> layout.CompletionMarker | None:
    try:
        data = json.loads(text)
        return layout.marker_from_json_dict(data) if isinstance(data, dict) else None
    except (ValueError, CheckpointError):
        return None


def _own_part(ls: NodeListing | None, index: int, tag: str, require_markers: bool,
              ranks: Sequence[int] | None = None) -> tuple[PartSource | None, str]:
    """(the node's own copy, or None and why not)."""
    if ls is None:
        return None, "not among the nodes listed"
    if ls.error:
        return None, "unreachable"
    files = ls.tags.get(tag)
    if not ls.exists or files is None:
        return None, f"has no {tag}"
    part = {posixpath.join(tag, rel): info.size for rel, info in files.items()}
    if index == 0:  # 'latest' only while it names this tag (as a replica holds it)
        part.update({name: info.size for name, info in ls.top.items()
                     if name in RECOVERY_SCRIPTS
                     or (name == LATEST_FILE and ls.latest == tag)})
    source = PartSource(index=index, node=ls.node, host=ls.node, root=ls.root,
                        replica=False, files=part)
    torn = [rel for rel, info in files.items() if info.whole is False]
    if torn:
        return None, f"{posixpath.join(tag, torn[0])} is cut short"
    text = ls.markers.get(tag, {}).get(marker_name(index))
    if text is None and not require_markers and files:
        why = part_problem(list(files), ranks) if ranks is not None else None
        return (None, f"{tag}: {why}") if why else (source, "")
    if text is None:
        return None, f"no completion marker in {tag} (its save did not finish)"
    marker = _marker(text)
    if marker is None or marker.tag != tag or marker.node_index != index:
        return None, f"unreadable completion marker in {tag}"
    why = _size_problem(files, marker.node_files, tag, "its completion marker")
    return (None, why) if why else (source, "")


def _size_problem(present: Mapping[str, FileInfo], expected: Mapping[str, int], prefix: str,
                  whose: str) -> str:
    """The first file of ``expected`` missing from ``present`` or of another size."""
    for rel, size in sorted(expected.items()):
        info = present.get(rel)
        shown = posixpath.join(prefix, rel) if prefix else rel
        if info is None:
            return f"{shown} is missing ({whose} lists it)"
        if info.size != size:
            return f"{shown} has {info.size} bytes, {whose} recorded {size}"
    return ""


def _replica_parts(holders: Sequence[NodeListing], index: int, name: str, tag: str
                   ) -> tuple[list[PartSource], str]:
    """Complete replicas of node index ``index``'s ``tag`` on ``holders`` (ring order),
    and why there is none when so."""
    found: list[PartSource] = []
    bad: list[str] = []
    for ls in holders:
        if ls.error or (name and ls.node == name):
            continue
        copy = ls.replica(index, tag)
        if copy is None:
            continue
        manifest, why = _check_copy(copy, index, tag)
        if manifest is None:
            bad.append(f"{ls.node}'s copy {why}")
            continue
        found.append(PartSource(
            index=index, node=name or manifest.source_host, host=ls.node,
            root=replica_dir(ls.root, index, tag), replica=True,
            files={rel: size for rel, (size, _) in manifest.files.items()},
            sha256={rel: digest for rel, (_, digest) in manifest.files.items()}))
    if found:
        return found, ""
    down = [ls.node for ls in holders if ls.error]
    why = f"no complete replica of {tag} on any reachable node"
    details = bad + ([f"unreachable: {', '.join(down)}"] if down else [])
    return found, why + (f" ({'; '.join(details)})" if details else "")


def _check_copy(copy: ReplicaCopy, index: int, tag: str) -> tuple[ReplicaManifest | None, str]:
    if copy.manifest is None:
        return None, f"has no {REPLICA_MANIFEST} (the copy did not finish)"
    try:
        manifest = parse_replica_manifest(copy.manifest)
    except ValueError as exc:
        return None, f"has an unusable manifest: {exc}"
    if manifest.tag != tag or manifest.source != index:
        return None, (f"has a manifest for {manifest.tag} of node index {manifest.source}, "
                      f"not {tag} of {index}")
    sizes = {rel: size for rel, (size, _) in manifest.files.items()}
    why = _size_problem(copy.files, sizes, "", "its manifest")
    torn = [rel for rel, info in copy.files.items() if info.whole is False and rel in sizes]
    if why or torn:
        return None, (f"is incomplete: {why}" if why else f"is incomplete: {torn[0]} is cut short")
    return manifest, ""


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
