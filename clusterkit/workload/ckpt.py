"""Checkpoint save / resume protocol on top of DeepSpeed (collective; every rank calls).

Why not ``load_checkpoint(tag=None)``: with node-local storage only node 0 has
``latest``; DeepSpeed then silently starts other nodes from fresh weights (ZeRO-2)
or hangs (ZeRO-3). Here rank 0 chooses the tag and broadcasts it, every rank checks
its own node's completion marker and its own files, and the verdict is gathered so
either all ranks load or all ranks stop with one error naming host and rank.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from clusterkit.checkpoints import layout
from clusterkit.errors import CheckpointError
from clusterkit.fsutil import read_json_object
from clusterkit.workload.engines import TrainEngine

EXIT_CHECKPOINT_ERROR = 3
MAX_LISTED_PROBLEMS = 8


class ResumeError(CheckpointError):
    """Raised identically on every rank after the verdict was gathered."""

    collective = True


@dataclass(frozen=True)
class RankInfo:
    global_rank: int
    local_rank: int
    node_index: int
    host: str


@dataclass(frozen=True)
class Topology:
    """Rank -> node map, agreed by an all-gather at start-up."""

    me: RankInfo
    ranks: tuple[RankInfo, ...]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_nodes(self) -> int:
        return len({r.node_index for r in self.ranks})

    def on_node(self, node_index: int) -> list[RankInfo]:
        return [r for r in self.ranks if r.node_index == node_index]

    def where(self, rank: int) -> str:
        r = self.ranks[rank]
        return f"host {r.host} (node {r.node_index}) rank {r.global_rank}"


def build_topology(rank: int, local_rank: int, env_node_index: int | None, host: str) -> Topology:
    mine = (rank, local_rank, env_node_index, host)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    # Without a launcher-provided node index, number hosts in order of first rank.
    host_order: dict[str, int] = {}
    for _, _, _, h in sorted(gathered):
        host_order.setdefault(h, len(host_order))
    infos = tuple(
        RankInfo(global_rank=g, local_rank=lr, host=h,
                 node_index=node if node is not None else host_order[h])
        for g, lr, node, h in sorted(gathered))
    return Topology(me=infos[rank], ranks=infos)


@dataclass(frozen=True)
class CkptContext:
    ckpt_dir: str
    engine_name: str
    zero_stage: int
    precision: str
    storage: str
    topo: Topology


def _rank_files(ctx: CkptContext, engine: TrainEngine, rank: int) -> tuple[str, ...]:
    sub = engine.ds_subdir
    files = [os.path.join(sub, f) if sub else f
             for f in layout.rank_files(ctx.zero_stage, rank, ctx.precision)]
    if ctx.engine_name == "accelerate":
        files.append(f"random_states_{rank}.pkl")
    return tuple(files)


def _list_files(tag_dir: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for root, _, names in os.walk(tag_dir):
        for name in names:
            if layout.parse_marker_name(name) is not None or name.endswith(".tmp"):
                continue
            full = os.path.join(root, name)
            found[os.path.relpath(full, tag_dir)] = os.path.getsize(full)
    return found


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save(ctx: CkptContext, engine: TrainEngine, tag: str, *, save_16bit: bool) -> None:
    """Save ``tag`` and, once every rank is done, write one marker per node."""
    me = ctx.topo.me
    tag_dir = os.path.join(ctx.ckpt_dir, tag)
    marker = os.path.join(tag_dir, layout.marker_name(me.node_index))
    if me.local_rank == 0 and os.path.exists(marker):
        os.remove(marker)  # re-saving a tag: it is incomplete until re-marked
    dist.barrier()
    engine.save(ctx.ckpt_dir, tag, {"step": engine.global_steps})
    if save_16bit:
        engine.save_16bit(os.path.join(tag_dir, "consolidated"), "pytorch_model.bin")
    dist.barrier()  # every rank has finished writing
    files = _rank_files(ctx, engine, me.global_rank)
    missing = [f for f in files if not os.path.isfile(os.path.join(tag_dir, f))]
    reports: list[Any] = [None] * ctx.topo.world_size
    dist.all_gather_object(reports, (files, missing))
    problems = [f"{ctx.topo.where(r)}: did not write {m}"
                for r, (_, miss) in enumerate(reports) for m in miss]
    if problems:
        raise ResumeError(f"checkpoint {tag} is incomplete after saving: " + "; ".join(problems),
                          path=tag_dir, exit_code=EXIT_CHECKPOINT_ERROR)
    if me.local_rank == 0:
        _write_marker(ctx, engine, tag, [tuple(r[0]) for r in reports])
    dist.barrier()


def _write_marker(ctx: CkptContext, engine: TrainEngine, tag: str,
                  files_by_rank: Sequence[tuple[str, ...]]) -> None:
    me = ctx.topo.me
    tag_dir = os.path.join(ctx.ckpt_dir, tag)
    entries = tuple(layout.RankEntry(global_rank=r.global_rank, local_rank=r.local_rank,
                                     host=r.host, files=files_by_rank[r.global_rank])
                    for r in ctx.topo.on_node(me.node_index))
    marker = layout.CompletionMarker(
        tag=tag, step=engine.global_steps, global_samples=engine.global_samples,
        engine=ctx.engine_name, ds_subdir=engine.ds_subdir, zero_stage=ctx.zero_stage,
        precision=ctx.precision, storage=ctx.storage, world_size=ctx.topo.world_size,
        num_nodes=ctx.topo.num_nodes, node_index=me.node_index, host=me.host,
        ranks=entries, node_files=_list_files(tag_dir), created_unix=time.time())
    _write_json_atomic(os.path.join(tag_dir, layout.marker_name(me.node_index)),
                       marker.to_json_dict())


def _read_marker(path: str) -> layout.CompletionMarker:
    data = read_json_object(path, "completion marker", CheckpointError)
    return layout.marker_from_json_dict(data, path=path)


# (tag, step, node indices whose markers are in this dir, number of nodes the save had)
ScanEntry = tuple[str, int, list[int], int]


def _scan(ckpt_dir: str) -> tuple[list[ScanEntry], list[str]]:
    """Every tag dir here with at least one readable marker; tag dirs without one."""
    complete: list[ScanEntry] = []
    unmarked: list[str] = []
    if not os.path.isdir(ckpt_dir):
        return complete, unmarked
    for tag in sorted(os.listdir(ckpt_dir)):
        tag_dir = os.path.join(ckpt_dir, tag)
        if not os.path.isdir(tag_dir):
            continue
        found = []
        for name in os.listdir(tag_dir):
            if layout.parse_marker_name(name) is None:
                continue
            try:
                found.append(_read_marker(os.path.join(tag_dir, name)))
            except CheckpointError:
                continue
        if not found:
            unmarked.append(tag)
            continue
        complete.append((tag, found[0].step, sorted({m.node_index for m in found}),
                         found[0].num_nodes))
    return complete, unmarked


def _verify_own(ctx: CkptContext, engine: TrainEngine, tag: str) -> list[str]:
    me = ctx.topo.me
    tag_dir = os.path.join(ctx.ckpt_dir, tag)
    where = ctx.topo.where(me.global_rank)
    marker_path = os.path.join(tag_dir, layout.marker_name(me.node_index))
    if not os.path.isdir(tag_dir):
        return [f"{where}: no checkpoint directory {tag_dir}"]
    if not os.path.isfile(marker_path):
        return [f"{where}: no completion marker {marker_path} (save never finished on this node)"]
    try:
        marker = _read_marker(marker_path)
    except CheckpointError as exc:
        return [f"{where}: {exc.one_line()}"]
    problems = []
    for key, want, got in (("world_size", ctx.topo.world_size, marker.world_size),
                           ("zero_stage", ctx.zero_stage, marker.zero_stage),
                           ("engine", ctx.engine_name, marker.engine)):
        if want != got:
            problems.append(f"{where}: checkpoint has {key}={got}, this run has {want}")
    problems += [f"{where}: missing {os.path.join(tag_dir, f)}"
                 for f in _rank_files(ctx, engine, me.global_rank)
                 if not os.path.isfile(os.path.join(tag_dir, f))]
    return problems


def choose_and_verify(ctx: CkptContext, engine: TrainEngine, resume: str) -> str | None:
    """Return the tag all ranks will load, None for a fresh start, or raise ResumeError."""
    if resume == "never":
        return None
    scans: list[Any] = [None] * ctx.topo.world_size
    dist.all_gather_object(scans, _scan(ctx.ckpt_dir))
    decision: list[Any] = [None]
    if ctx.topo.me.global_rank == 0:
        decision[0] = _decide(resume, scans)
    dist.broadcast_object_list(decision, src=0)
    tag, warning = decision[0]
    if warning and ctx.topo.me.global_rank == 0:
        print(f"[clusterkit] warning: {warning}", flush=True)
    if tag is None:
        return None
    verdicts: list[Any] = [None] * ctx.topo.world_size
    dist.all_gather_object(verdicts, _verify_own(ctx, engine, tag))
    problems = [p for v in verdicts for p in v]
    if problems:
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(shown)
        text = "; ".join(shown) + (f"; and {more} more" if more else "")
        raise ResumeError(
            f"cannot resume from checkpoint {tag}: {text}", path=ctx.ckpt_dir,
            hint="restore the missing files (clusterkit collect-ckpt), pass --resume <older tag>, "
                 "or --resume never to start fresh on purpose",
            exit_code=EXIT_CHECKPOINT_ERROR)
    return str(tag)


def _decide(resume: str, scans: Sequence[tuple[list[ScanEntry], list[str]]]
            ) -> tuple[str | None, str | None]:
    """Rank 0 picks the tag from every rank's scan of its own checkpoint dir.

    A checkpoint is complete only when the markers of ALL its nodes are seen across the
    scans (node-local storage: each node's dir holds its own marker). A save killed
    midway can leave markers on some nodes only; such a tag is skipped, never loaded.
    """
    steps: dict[str, int] = {}
    seen: dict[str, set[int]] = {}
    expected: dict[str, int] = {}
    unmarked: set[str] = set()
    for complete, incomplete in scans:
        for tag, step, nodes, num_nodes in complete:
            steps[tag] = step
            seen.setdefault(tag, set()).update(nodes)
            expected[tag] = max(expected.get(tag, 0), num_nodes)
        unmarked.update(incomplete)
    unmarked -= set(steps)
    partial = {t: sorted(set(range(expected[t])) - seen[t]) for t in steps}
    partial = {t: missing for t, missing in partial.items() if missing}
    notes = []
    if unmarked:
        notes.append(f"ignoring checkpoint dirs without a completion marker: {', '.join(sorted(unmarked))}")
    for tag, missing in sorted(partial.items()):
        notes.append(f"ignoring checkpoint {tag}: no completion marker from node(s) "
                     f"{', '.join(map(str, missing))} (a save interrupted midway?)")
    warning = "; ".join(notes) if notes else None
    if resume != "auto":
        return resume, warning
    candidates = {t: st for t, st in steps.items() if t not in partial}
    if not candidates:
        return None, warning
    newest = max(candidates, key=lambda t: (candidates[t], t))
    return newest, warning
