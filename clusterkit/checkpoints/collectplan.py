"""What collect-ckpt decided about a checkpoint before copying anything: the
:class:`CollectPlan` (which files exist where, which copies must agree) that
:func:`clusterkit.checkpoints.collect.discover.verify` returns, or the
:class:`CheckpointIncomplete` it raises; :class:`WithoutMarkers`, the option to verify
a user script's save without clusterkit's completion markers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterkit.errors import CheckpointError

MAX_SHOWN_PROBLEMS = 12


@dataclass(frozen=True)
class SourceFile:
    """One file on one node. ``relpath`` is relative to the checkpoint root
    (``latest``, ``zero_to_fp32.py``, ``<tag>/...``)."""

    node: str
    relpath: str
    size: int
    mtime: float


@dataclass(frozen=True)
class NodeRanks:
    node: str  # inventory name of the node holding these ranks now
    node_index: int  # the marker's node index (rank order of the training run)
    host: str  # host name recorded at save time
    ranks: tuple[int, ...]
    rank_files: Mapping[int, tuple[str, ...]]  # global rank -> files relative to the tag dir


@dataclass(frozen=True)
class CollectPlan:
    """A complete checkpoint: what exists where, and which copies must agree."""

    tag: str
    step: int | None
    zero_stage: int | None
    world_size: int
    engine: str
    ds_subdir: str
    precision: str
    nodes: tuple[NodeRanks, ...]  # by node_index
    # relpath -> every copy (several for per-node duplicates such as model states)
    files: Mapping[str, tuple[SourceFile, ...]]
    canonical_node: str  # the node holding global rank 0: wins when copies differ
    notes: tuple[str, ...] = ()
    # ds_subdir is DeepSpeed's universal checkpoint (HF's checkpoint-N after a reshard,
    # checkpoints/collect/inside.py): consolidated from its zero/<param>/fp32.pt
    universal: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(copies[0].size for copies in self.files.values())

    def copies_on(self, node: str) -> list[SourceFile]:
        return [c for copies in self.files.values() for c in copies if c.node == node]


@dataclass(frozen=True)
class WithoutMarkers:
    """Collect a checkpoint that a user's own script saved with ``engine.save_checkpoint``:
    DeepSpeed's own file set stands in for clusterkit's completion markers. Checked: the
    tag, every rank's shard exactly once for ``world_size`` ranks, the model states, and
    every ``.pt`` file ending with its zip end record. Not detectable without a marker: a
    save still being written while the nodes are listed (docs/collect-ckpt.md)."""

    world_size: int
    # Ranks per node index, in node order, when known (a launched job, the nodes' slots):
    # each node's part is then judged by the replicas' rule (assemble.ranks_of_slots).
    slots: tuple[int, ...] = ()


class CheckpointIncomplete(CheckpointError):
    """The checkpoint cannot be collected; ``problems`` has one line per finding."""

    def __init__(self, tag: str | None, problems: Sequence[str], *, hint: str | None = None) -> None:
        shown = list(problems[:MAX_SHOWN_PROBLEMS])
        more = len(problems) - len(shown)
        what = f"checkpoint {tag}" if tag else "checkpoint"
        text = f"{what} is incomplete or inconsistent, nothing was copied: " + "; ".join(shown)
        if more:
            text += f"; and {more} more"
        super().__init__(text, hint=hint or "fix the nodes named (or pick another --tag) "
                         "and run collect-ckpt again", exit_code=2)
        self.problems = tuple(problems)
        self.tag = tag


def describe(plan: CollectPlan) -> dict[str, Any]:
    """A JSON-able summary for ``--dry-run``/reports."""
    return {
        "tag": plan.tag, "step": plan.step, "zero_stage": plan.zero_stage,
        "world_size": plan.world_size, "engine": plan.engine,
        "nodes": [{"node": n.node, "node_index": n.node_index, "ranks": list(n.ranks)}
                  for n in plan.nodes],
        "files": len(plan.files), "bytes": plan.total_bytes,
    }
