"""One answer per checkpoint (issue 38 item 4): can this tag be collected, and which tag
does collect-ckpt take when given none. ``status`` shows the same answer per tag.

A tag is collectable when collect-ckpt would copy it: each node index's part is taken
from its own node or a complete replica (:func:`~clusterkit.checkpoints.replicas.assemble.assemble`
decides which; a part read from a replica stands in for its node), and the checkpoint
those listings show verifies (:func:`~clusterkit.checkpoints.collect.discover.verify`:
every rank's shard once, the model states somewhere, the markers or DeepSpeed's file set).
A save whose node parts are not complete one by one but whose files are all there (a
DeepSpeed save without ``use_node_local_storage``: the model states on global rank 0's
node only) is collectable, and ``status`` says that a restart on those nodes cannot
resume it node by node.

The default tag of collect-ckpt (no ``--tag``) is the newest collectable one, newest by
:func:`~clusterkit.checkpoints.replicas.assemble.candidate_tags` (the step a tag names,
node/contract.tag_step, then its files' times). Pure: listings in, answers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clusterkit.checkpoints.collect.discover import verify
from clusterkit.checkpoints.collect.fromreplicas import ReplicaUse, stand_ins
from clusterkit.checkpoints.collectplan import CheckpointIncomplete, CollectPlan, WithoutMarkers
from clusterkit.checkpoints.listing import NodeListing
from clusterkit.checkpoints.replicas.assemble import (
    Assembly,
    assemble,
    candidate_tags,
    ranks_of_slots,
)
from clusterkit.checkpoints.replicas.health import SHOWN_TAGS, TagHealth
from clusterkit.errors import CheckpointError


@dataclass(frozen=True)
class Verdict:
    """One tag: the assembly (which copy of each node's part) and the plan collect-ckpt
    would copy (None: not collectable, ``problems`` say why)."""

    tag: str
    assembly: Assembly
    plan: CollectPlan | None
    problems: tuple[str, ...] = ()

    @property
    def collectable(self) -> bool:
        return self.plan is not None


def judge(listings: Sequence[NodeListing], tag: str, *,
          without_markers: WithoutMarkers | None = None,
          expect_nodes: int | None = None) -> Verdict:
    """Whether ``tag`` can be collected from these listings (replica areas included)."""
    wm = without_markers
    ranks = ranks_of_slots(wm.slots) if wm is not None and wm.slots else None
    a = assemble(listings, tag, expect_nodes=expect_nodes, require_markers=wm is None,
                 ranks=ranks)
    seen = list(listings)
    if a.complete and a.from_replicas:
        seen = stand_ins(ReplicaUse(assembly=a, listings=seen,
                                    chosen=dict.fromkeys(a.candidates, 0)))
    try:
        return Verdict(tag, a, verify(seen, tag, wm))
    except CheckpointIncomplete as exc:
        return Verdict(tag, a, None, exc.problems)
    except CheckpointError as exc:
        return Verdict(tag, a, None, (exc.one_line(),))


def newest_collectable(listings: Sequence[NodeListing], *,
                       without_markers: WithoutMarkers | None = None,
                       expect_nodes: int | None = None) -> Verdict | None:
    """collect-ckpt's default tag: the newest that can be collected (None: none can)."""
    for tag in candidate_tags(listings, markers=without_markers is None):
        v = judge(listings, tag, without_markers=without_markers, expect_nodes=expect_nodes)
        if v.collectable:
            return v
    return None


@dataclass(frozen=True)
class TagAnswer(TagHealth):
    """``status``'s line for one tag: replica health, and collect-ckpt's answer."""

    collectable: bool = False
    problems: tuple[str, ...] = ()
    converted: str = ""  # collect-ckpt takes this universal conversion inside the tag

    def line(self) -> str:
        text = f"{self.tag}: {self.own}/{self.nodes} nodes, replicated {self.replicated}/{self.nodes}"
        if self.converted:  # checkpoints/collect/inside.py: the old world's tag cannot be
            return (text + f"; collectable from {self.converted}, its universal conversion "
                    "by a reshard (the DeepSpeed tag it was made from is incomplete here)")
        if not self.collectable and not self.complete:  # the replicas' words (health.py)
            return text + "; cannot be assembled: " + "; ".join(self.missing.values())
        if not self.collectable:  # every part is there, the checkpoint they make is not
            return text + "; cannot be collected: " + "; ".join(self.problems[:4])
        if not self.complete:  # every file is there, not every node's own part
            return (text + "; collectable (collect-ckpt gathers it), but not complete on "
                    "each node, so a restart there cannot resume it: "
                    + "; ".join(list(self.missing.values())[:3]))
        return text + ("; complete from replicas" if self.own < self.nodes else "")

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "collectable": self.collectable,
                "problems": list(self.problems),
                **({"converted": self.converted} if self.converted else {})}


def answers(listings: Sequence[NodeListing], shown: int = SHOWN_TAGS, *,
            without_markers: WithoutMarkers | None = None,
            expect_nodes: int | None = None) -> list[TagAnswer]:
    """The newest ``shown`` tags' answers, newest first (``status``)."""
    out: list[TagAnswer] = []
    for tag in candidate_tags(listings, markers=without_markers is None)[:shown]:
        v = judge(listings, tag, without_markers=without_markers, expect_nodes=expect_nodes)
        a = v.assembly
        out.append(TagAnswer(tag=tag, nodes=a.num_nodes, own=len(a.own),
                             replicated=len(a.replicated), complete=a.complete,
                             missing={i: f"{a.label(i)}: {why}"
                                      for i, why in sorted(a.missing.items())},
                             collectable=v.collectable, problems=v.problems,
                             converted=f"{tag}/{v.plan.ds_subdir}"
                             if v.plan is not None and v.plan.universal else ""))
    return out
