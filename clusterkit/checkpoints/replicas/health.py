"""Replica health per checkpoint, for ``clusterkit status JOB`` (issue 22).

"global_step40: 7/7 nodes, replicated 7/7": how many node parts of the tag are on their
own node, and how many have at least one complete replica on another node
(:func:`clusterkit.checkpoints.replicas.assemble.assemble` decides both). The listings come
through collect-ckpt's own sessions (one ``ckpt.stream`` session per node, each request
with its timeout); an unreachable node is reported, never fatal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterkit.checkpoints.listing import NodeListing
from clusterkit.checkpoints.replicas.assemble import Ranks, assemble, candidate_tags, ranks_of_map
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.checkpoints.sources.factory import open_source
from clusterkit.remote.base import Transport
from clusterkit.spec.jobrecord import JobCheckpoints

SHOWN_TAGS = 3  # the newest few: older ones are pruned by the keep policy anyway


@dataclass(frozen=True)
class TagHealth:
    tag: str
    nodes: int
    own: int  # node parts present on their own node
    replicated: int  # node parts with a complete replica on another node
    complete: bool  # the tag can be assembled from the reachable nodes and replicas
    missing: Mapping[int, str]  # node index -> why its part cannot be had ("node index N (x)")

    def line(self) -> str:
        text = f"{self.tag}: {self.own}/{self.nodes} nodes, replicated {self.replicated}/{self.nodes}"
        if not self.complete:
            return text + "; cannot be assembled: " + "; ".join(self.missing.values())
        return text + ("; complete from replicas" if self.own < self.nodes else "")

    def to_json(self) -> dict[str, Any]:
        return {"tag": self.tag, "nodes": self.nodes, "own": self.own,
                "replicated": self.replicated, "complete": self.complete,
                "missing": {str(i): why for i, why in self.missing.items()}}


def health(listings: Sequence[NodeListing], shown: int = SHOWN_TAGS,
           expect_nodes: int | None = None, *, markers: bool = True,
           ranks: Ranks | None = None) -> list[TagHealth]:
    """The newest ``shown`` tags' health, newest first (pure). ``markers``: whether the
    job's program writes completion markers (the bundled workload); a user's script's
    node part counts by the replicas' rule on the node's ``ranks`` (assemble.py)."""
    out: list[TagHealth] = []
    for tag in candidate_tags(listings, markers=markers)[:shown]:
        a = assemble(listings, tag, expect_nodes=expect_nodes, require_markers=markers,
                     ranks=ranks)
        out.append(TagHealth(tag=tag, nodes=a.num_nodes, own=len(a.own),
                             replicated=len(a.replicated), complete=a.complete,
                             missing={i: f"{a.label(i)}: {why}"
                                      for i, why in sorted(a.missing.items())}))
    return out


def job_nodes(nodes: Sequence[Any], ckpt: JobCheckpoints) -> list[CollectNode]:
    """A launched job's nodes (``JobRecord.nodes``: node, target, python) with the
    checkpoint dirs its record names; empty when it names none."""
    out = []
    for n in nodes:
        root = ckpt.dir_of(n.node)
        if not root:
            return []
        out.append(CollectNode(n.node, n.target, n.python, str(root)))
    return out


def list_all(transport: Transport, nodes: Sequence[CollectNode]) -> list[NodeListing]:
    """Every node's listing (replica areas included) over collect-ckpt's sessions."""
    with open_source(transport, nodes, dest="") as source:
        return source.listings(None)


@dataclass(frozen=True)
class JobHealth:
    tags: list[TagHealth]
    unreachable: Mapping[str, str]  # node -> why it could not be listed
    markers: bool = True

    def lines(self) -> list[str]:
        if not self.tags:
            what = "a completion marker" if self.markers else "DeepSpeed's files"
            out = [f"checkpoints: none saved yet (no tag with {what} or a replica)"]
        else:
            out = ["checkpoints (newest first):"] + [f"  {t.line()}" for t in self.tags]
        out += [f"  {node}: not listed ({why})" for node, why in self.unreachable.items()]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"tags": [t.to_json() for t in self.tags], "unreachable": dict(self.unreachable)}


def job_health(transport: Transport, nodes: Sequence[Any], ckpt: JobCheckpoints
               ) -> JobHealth | None:
    """A launched job's replica health; None when it is not node-local or its record
    names no checkpoint dir (nothing to replicate, or nothing known)."""
    chosen = job_nodes(nodes, ckpt)
    if not ckpt.node_local or not chosen:
        return None
    listings = list_all(transport, chosen)
    ranks = ranks_of_map(ckpt.rank_map) if ckpt.rank_map else None
    return JobHealth(health(listings, markers=ckpt.markers, ranks=ranks),
                     {ls.node: ls.error for ls in listings if ls.error}, ckpt.markers)
