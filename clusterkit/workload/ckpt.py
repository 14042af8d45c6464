"""Checkpoint save / resume protocol on top of DeepSpeed (collective; every rank calls).

Why not ``load_checkpoint(tag=None)``: with node-local storage only node 0 has
``latest``; DeepSpeed then silently starts other nodes from fresh weights (ZeRO-2)
or hangs (ZeRO-3). Here rank 0 chooses the tag and broadcasts it, every rank checks
its own node's completion marker and its own files, and the verdict is gathered so
either all ranks load or all ranks stop with one error naming host and rank.

The choice is made before the engine is built: a universal checkpoint
(``<tag>_universal/`` with clusterkit's marker, checkpoints/convert/universal.py) needs
``checkpoint.load_universal`` in the ds_config and, after a shrink, another batch
split (spec/batch.py), both read by ``deepspeed.initialize``. A normal checkpoint saved
by another world size is refused here, before DeepSpeed would fail on it.
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
from clusterkit.checkpoints.convert import universal
from clusterkit.checkpoints.universal_marker import UniversalMarker
from clusterkit.errors import CheckpointError
from clusterkit.fsutil import read_json_object
from clusterkit.node.contract import marker_name, parse_marker_name
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
    ds_subdir: str = ""  # where DeepSpeed's files sit in a tag dir (engines.ds_subdir_for)


def _rank_files(ctx: CkptContext, rank: int) -> tuple[str, ...]:
    sub = ctx.ds_subdir
    files = [os.path.join(sub, f) if sub else f
             for f in layout.rank_files(ctx.zero_stage, rank, ctx.precision)]
    if ctx.engine_name == "accelerate":
        files.append(f"random_states_{rank}.pkl")
    return tuple(files)


def _list_files(tag_dir: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for root, _, names in os.walk(tag_dir):
        for name in names:
            if parse_marker_name(name) is not None or name.endswith(".tmp"):
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
    marker = os.path.join(tag_dir, marker_name(me.node_index))
    if me.local_rank == 0 and os.path.exists(marker):
        os.remove(marker)  # re-saving a tag: it is incomplete until re-marked
    dist.barrier()
    engine.save(ctx.ckpt_dir, tag, {"step": engine.global_steps})
    if save_16bit:
        engine.save_16bit(os.path.join(tag_dir, "consolidated"), "pytorch_model.bin")
    dist.barrier()  # every rank has finished writing
    files = _rank_files(ctx, me.global_rank)
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
    _write_json_atomic(os.path.join(tag_dir, marker_name(me.node_index)),
                       marker.to_json_dict())


def _read_marker(path: str) -> layout.CompletionMarker:
    data = read_json_object(path, "completion marker", CheckpointError)
    return layout.marker_from_json_dict(data, path=path)


@dataclass(frozen=True)
class ScanEntry:
    """One tag dir of one rank's checkpoint root (its node's, with node-local storage)."""

    tag: str
    step: int
    nodes: tuple[int, ...]  # node indices whose completion markers are in this dir
    num_nodes: int  # nodes of the save
    world_size: int  # ranks of the save
    is_universal: bool = False  # <tag>_universal with clusterkit's marker (nodes: ())


# Every tag dir with a readable marker; tag dirs without one.
Scan = tuple[list[ScanEntry], list[str]]


def _scan(ckpt_dir: str) -> Scan:
    complete: list[ScanEntry] = []
    unmarked: list[str] = []
    if not os.path.isdir(ckpt_dir):
        return complete, unmarked
    for tag in sorted(os.listdir(ckpt_dir)):
        tag_dir = os.path.join(ckpt_dir, tag)
        if not os.path.isdir(tag_dir) or tag.startswith("."):  # .<tag>_universal.tmp-*
            continue
        entry = _scan_universal(tag, tag_dir) if universal.is_universal_dir(tag_dir) \
            else _scan_tag(tag, tag_dir)
        if entry is None:
            unmarked.append(tag)
        else:
            complete.append(entry)
    return complete, unmarked


def _scan_tag(tag: str, tag_dir: str) -> ScanEntry | None:
    found = []
    for name in os.listdir(tag_dir):
        if parse_marker_name(name) is None:
            continue
        try:
            found.append(_read_marker(os.path.join(tag_dir, name)))
        except CheckpointError:
            continue
    if not found:
        return None
    return ScanEntry(tag, found[0].step, tuple(sorted({m.node_index for m in found})),
                     found[0].num_nodes, found[0].world_size)


def _scan_universal(tag: str, tag_dir: str) -> ScanEntry | None:
    try:
        marker = universal.read_universal_marker(tag_dir)
    except CheckpointError:
        return None
    return ScanEntry(tag, marker.step, (), 0, marker.world_size, is_universal=True)


def _verify_own(ctx: CkptContext, tag: str) -> list[str]:
    me = ctx.topo.me
    tag_dir = os.path.join(ctx.ckpt_dir, tag)
    where = ctx.topo.where(me.global_rank)
    marker_path = os.path.join(tag_dir, marker_name(me.node_index))
    if not os.path.isdir(tag_dir):
        return [f"{where}: no checkpoint directory {tag_dir}"]
    if universal.is_universal_dir(tag_dir):
        return _verify_universal(ctx, tag_dir, where)
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
                 for f in _rank_files(ctx, me.global_rank)
                 if not os.path.isfile(os.path.join(tag_dir, f))]
    return problems


def _verify_universal(ctx: CkptContext, tag_dir: str, where: str) -> list[str]:
    """Only local rank 0 reads the node's copy (every rank of a node reads the same files)."""
    try:
        marker = universal.read_universal_marker(tag_dir)
    except CheckpointError as exc:
        return [f"{where}: {exc.one_line()}"]
    problems = []
    for key, want, got in (("zero_stage", ctx.zero_stage, marker.zero_stage),
                           ("engine", ctx.engine_name, marker.engine)):
        if want != got:
            problems.append(f"{where}: universal checkpoint has {key}={got}, this run has {want}")
    if ctx.topo.me.local_rank == 0:
        missing = universal.missing_files(tag_dir, marker)
        problems += [f"{where}: {os.path.join(tag_dir, f)} is missing or of another size "
                     "than the universal marker records" for f in missing[:MAX_LISTED_PROBLEMS]]
    return problems


@dataclass(frozen=True)
class Resume:
    """What every rank loads: a tag, and the universal marker when it is one."""

    tag: str
    step: int
    marker: UniversalMarker | None = None  # a universal checkpoint's


def choose_and_verify(ctx: CkptContext, resume: str) -> Resume | None:
    """The checkpoint all ranks will load, None for a fresh start, or raise ResumeError.
    Collective; needs no engine (the ds_config depends on the answer)."""
    if resume == "never":
        return None
    scans: list[Any] = [None] * ctx.topo.world_size
    dist.all_gather_object(scans, _scan(ctx.ckpt_dir))
    decision: list[Any] = [None]
    if ctx.topo.me.global_rank == 0:
        decision[0] = _decide(resume, scans, ctx.topo.world_size)
    dist.broadcast_object_list(decision, src=0)
    tag, warning, refusal = decision[0]
    if warning and ctx.topo.me.global_rank == 0:
        print(f"[clusterkit] warning: {warning}", flush=True)
    if refusal:
        raise ResumeError(refusal[0], path=ctx.ckpt_dir, hint=_convert_hint(ctx, refusal[1]),
                          exit_code=EXIT_CHECKPOINT_ERROR)
    if tag is None:
        return None
    verdicts: list[Any] = [None] * ctx.topo.world_size
    dist.all_gather_object(verdicts, _verify_own(ctx, tag))
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
    tag_dir = os.path.join(ctx.ckpt_dir, tag)
    if universal.is_universal_dir(tag_dir):
        marker = universal.read_universal_marker(tag_dir)
        return Resume(str(tag), marker.step, marker)
    return Resume(str(tag), _read_marker(os.path.join(
        tag_dir, marker_name(ctx.topo.me.node_index))).step)


# (tag or None, warning or None, (refusal, refused tag) or None): rank 0's decision.
Decision = tuple[str | None, str | None, tuple[str, str] | None]


def _decide(resume: str, scans: Sequence[Scan], world_size: int) -> Decision:
    """Rank 0 picks the tag from every rank's scan of its own checkpoint dir.

    A checkpoint is complete only when the markers of ALL its nodes are seen across the
    scans (node-local storage: each node's dir holds its own marker). A save killed
    midway can leave markers on some nodes only; such a tag is skipped, never loaded.
    A universal checkpoint counts only where every rank's dir holds it (each node needs
    the whole of it). ``auto`` takes the newest by step; at the same step a normal
    checkpoint of this world size beats a universal one (it resumes exactly), and a
    universal one beats a normal one of another world size, which never loads directly.
    """
    entries: dict[str, ScanEntry] = {}
    seen: dict[str, set[int]] = {}
    holders: dict[str, int] = {}
    unmarked: set[str] = set()
    for complete, incomplete in scans:
        for e in complete:
            prev = entries.get(e.tag)
            if prev is None or e.num_nodes > prev.num_nodes:
                entries[e.tag] = e
            seen.setdefault(e.tag, set()).update(e.nodes)
            holders[e.tag] = holders.get(e.tag, 0) + 1
        unmarked.update(incomplete)
    unmarked -= set(entries)
    partial = {t: sorted(set(range(e.num_nodes)) - seen[t]) for t, e in entries.items()
               if not e.is_universal}
    partial = {t: missing for t, missing in partial.items() if missing}
    notes = []
    if unmarked:
        notes.append(f"ignoring checkpoint dirs without a completion marker: {', '.join(sorted(unmarked))}")
    for tag, missing in sorted(partial.items()):
        notes.append(f"ignoring checkpoint {tag}: no completion marker from node(s) "
                     f"{', '.join(map(str, missing))} (a save interrupted midway?)")
    lacking = sorted(t for t, e in entries.items() if e.is_universal and holders[t] < len(scans))
    if lacking:
        notes.append(f"ignoring universal checkpoint(s) {', '.join(lacking)}: not on every "
                     f"node ({len(scans)} ranks, copies seen by fewer)")
    warning = "; ".join(notes) if notes else None
    if resume != "auto":
        named = entries.get(resume)
        return resume, warning, _other_world(named, world_size) if named else None
    candidates = [e for t, e in entries.items() if t not in partial and t not in lacking]
    if not candidates:
        return None, warning, None
    newest = max(candidates, key=lambda e: (e.step, _preference(e, world_size), e.tag))
    return newest.tag, warning, _other_world(newest, world_size)


def _preference(entry: ScanEntry, world_size: int) -> int:
    """At the same step: this world size's own save, then a universal one, then others."""
    if entry.is_universal:
        return 1
    return 2 if entry.world_size == world_size else 0


def _other_world(entry: ScanEntry, world_size: int) -> tuple[str, str] | None:
    """The refusal for a normal checkpoint saved by another number of ranks."""
    if entry.is_universal or entry.world_size == world_size:
        return None
    return (f"checkpoint {entry.tag} was saved by {entry.world_size} ranks and this run has "
            f"{world_size}: ZeRO's optimizer shards load only on the world size that wrote them",
            entry.tag)


def _convert_hint(ctx: CkptContext, tag: str) -> str:
    """The conversion, spelled out: in place on shared storage; gathered first otherwise."""
    call = (f"python3 -c 'from clusterkit.checkpoints.convert.universal import convert_to_universal; "
            f"convert_to_universal(\"%s\", \"{tag}\")'")
    out = universal.universal_tag(tag)
    if ctx.storage == "shared":
        return (f"convert it to DeepSpeed's universal checkpoint, then run again: "
                f"{call % ctx.ckpt_dir} (writes {out}/ beside it; docs/workload.md)")
    return (f"relaunch with `clusterkit launch --job-id JOB` on the new nodes, which converts "
            f"it for you; or gather it (clusterkit collect-ckpt JOB --tag {tag} --to DEST), "
            f"run {call % 'DEST'} and copy DEST/{out}/ into every node's checkpoint dir "
            f"(docs/lost-a-node.md)")
