"""Find a checkpoint on every node and decide whether it is complete (before copying).

Each node's listing (:mod:`clusterkit.checkpoints.listing`: the top-level files
(``latest``, ``zero_to_fp32.py``), every tag dir's files with size and mtime, and the
text of the completion markers) comes from a collect source.
:func:`verify` is pure: listings in, a :class:`CollectPlan` or a
:class:`CheckpointIncomplete` listing every problem by node and rank out.

What DeepSpeed 0.19 actually writes with ``checkpoint.use_node_local_storage``
(measured on the test bed, 7 nodes x 2 ranks):

* ``<root>/latest``, ``<root>/zero_to_fp32.py``, ``<root>/zero_to_torch.py``: node 0 only.
* ZeRO 0-2: ``mp_rank_00_model_states.pt`` on every node, but **not byte-identical**:
  only global rank 0's copy carries ``shared_params`` (tied weights), which
  ``zero_to_fp32`` needs. Differing copies are therefore resolved to the copy of the
  node holding global rank 0, with a note, instead of being refused.
* Optimizer shards (and ZeRO-3 per-rank model states) with the global dp index, on
  the node of that rank; one completion marker per node.

One file because: the three ways a tag is judged (completion markers, DeepSpeed's file
set, and a program's tag dir holding a universal conversion beside its DeepSpeed tag,
whose rule is checkpoints/collect/inside.py's) share one shard scan, one file gathering
and one torn-file check, each private to the verification.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from clusterkit.checkpoints import layout
from clusterkit.checkpoints.collect.inside import Converted, converted, without
from clusterkit.checkpoints.collectplan import (
    CheckpointIncomplete,
    CollectPlan,
    NodeRanks,
    SourceFile,
    WithoutMarkers,
)
from clusterkit.checkpoints.listing import NodeListing
from clusterkit.errors import CheckpointError
from clusterkit.hostrange import fold, folded_lines
from clusterkit.node.contract import (
    ACCELERATE_DS_SUBDIR,
    LATEST_FILE,
    LATEST_UNIVERSAL_FILE,
    MARKER_GLOB,
    RECOVERY_SCRIPTS,
    parse_marker_name,
    tag_step,
)
from clusterkit.node.facts.gatefacts import SHARED_FIX, shared_line
from clusterkit.node.replicas.rules import saved_files


def choose_tag(listings: Sequence[NodeListing], requested: str, *, markers: bool = True
               ) -> tuple[str | None, list[str]]:
    """The tag to collect: explicit, or ``latest`` (which must agree where present)."""
    if requested != "latest":
        return requested, []
    said = {ls.node: ls.latest for ls in listings if ls.latest}
    if len(set(said.values())) > 1:
        detail = ", ".join(f"{n} says {t}" for n, t in said.items())
        return None, [f"the nodes' 'latest' files disagree ({detail}); pass --tag"]
    if said:
        return next(iter(said.values())), []
    # No 'latest' anywhere: newest tag that every node has a marker (or shards) for.
    common: set[str] | None = None
    for ls in listings:
        marked = {t for t, m in ls.markers.items() if m} if markers else \
            {t for t, files in ls.tags.items() if files and _holds_shards(files)}
        common = marked if common is None else common & marked
    if not common:
        what = "completion markers" if markers else "DeepSpeed checkpoint files"
        return None, [f"no node has a 'latest' file and no tag has {what} on every node; "
                      "pass --tag"]
    return max(common, key=lambda t: (tag_step(t), t)), []


def _nothing_there(missing: Sequence[NodeListing]) -> CheckpointError:
    """No node has the checkpoint directory: nothing was ever saved there (or the wrong
    job or --dir was named), one line rather than a finding per node."""
    roots = sorted({ls.root for ls in missing})
    where = roots[0] if len(roots) == 1 else f"{roots[0]} (and {len(roots) - 1} more)"
    return CheckpointError(
        f"no checkpoint to collect: the checkpoint directory {where} does not exist on any "
        f"node ({fold(ls.node for ls in missing)})", path=roots[0],
        hint="name the job that saved it (clusterkit status lists them) or give --dir the "
             "checkpoint root the nodes wrote to")


def verify(listings: Sequence[NodeListing], requested_tag: str = "latest",
           without_markers: WithoutMarkers | None = None) -> CollectPlan:
    """Check completeness across nodes; raise :class:`CheckpointIncomplete` with every problem."""
    # Nodes that failed the same way share one line: "node[1-7]: cannot list (...)".
    order = [ls.node for ls in listings]
    problems = folded_lines([(ls.node, ls.error) for ls in listings if ls.error], order)
    missing = [ls for ls in listings if not ls.error and not ls.exists]
    if listings and len(missing) == len(listings):
        raise _nothing_there(missing)
    problems += folded_lines([(ls.node, f"checkpoint directory {ls.root} does not exist")
                              for ls in missing], order)
    if problems:
        raise CheckpointIncomplete(None if requested_tag == "latest" else requested_tag, problems)
    tag, problems = choose_tag(listings, requested_tag, markers=without_markers is None)
    if tag is None:
        raise CheckpointIncomplete(None, problems)
    for ls in listings:
        if ls.tags.get(tag) is None:
            have = sorted((t for t, f in ls.tags.items() if f is not None),
                          key=lambda t: (tag_step(t), t))
            problems.append(f"{ls.node}: no {tag} directory under {ls.root}"
                            + (f" (it has {', '.join(have[-3:])})" if have else ""))
    if problems:
        raise CheckpointIncomplete(tag, problems)
    shared = shared_dir(listings, tag)
    if shared is not None:
        raise shared
    if without_markers is not None:
        return plan_from_files(listings, tag, without_markers.world_size)
    markers, problems = _read_markers(listings, tag)
    if not markers:
        # A user's own script writes no markers: say that, not "the save did not finish"
        # on every node.
        mine = _hint_without_markers(listings, tag)
        raise CheckpointIncomplete(tag, mine or problems, hint="add --without-markers once the "
                                   "run has stopped saving" if mine else None)
    # Go on with the markers we have, so one report lists every problem at once.
    return _plan(listings, tag, markers, problems)


def shared_dir(listings: Sequence[NodeListing], tag: str) -> CheckpointIncomplete | None:
    """Several nodes list the very same files of ``tag`` (names, sizes, mtimes), per-rank
    shards included: their node-local dir is one shared directory (issue 32). One line
    instead of a "must exist exactly once" per shard."""
    groups: dict[frozenset[tuple[str, int, float]], list[NodeListing]] = {}
    for ls in listings:
        files = ls.tags.get(tag) if not ls.error else None
        if files and any(_per_rank(rel) for rel in saved_files(files)):
            key = frozenset((rel, i.size, i.mtime) for rel, i in files.items())
            groups.setdefault(key, []).append(ls)
    same = max(groups.values(), key=len, default=[])
    if len(same) < 2:
        return None
    where = fold(ls.node for ls in same)
    return CheckpointIncomplete(tag, [
        f"{tag} is the same files on {where}: "
        + shared_line(same[0].root, where).replace("checkpoint dir", "its checkpoint dir", 1)],
        hint="it is in one place already: read it there, or collect it from one node "
             f"(--include {same[0].node}); for the next job use {SHARED_FIX}")


def _per_rank(rel: str) -> bool:
    """A per-rank DeepSpeed file of the save (the caller leaves out a conversion's copy of
    every rank's model states, ZeRO-3's, the same on every node)."""
    shard = layout.parse_shard_name(posixpath.basename(rel))
    return shard is not None and shard.dp_rank is not None


def _read_markers(listings: Sequence[NodeListing], tag: str
                  ) -> tuple[dict[str, list[layout.CompletionMarker]], list[str]]:
    found: dict[str, list[layout.CompletionMarker]] = {}
    problems: list[str] = []
    for ls in listings:
        texts = ls.markers.get(tag, {})
        if not texts:
            problems.append(f"{ls.node}: no completion marker ({MARKER_GLOB}) in {tag}: "
                            "the save did not finish on this node")
            continue
        for name, text in sorted(texts.items()):
            path = f"{ls.node}:{posixpath.join(ls.root, tag, name)}"
            try:
                data = json.loads(text)
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
                marker = layout.marker_from_json_dict(data, path=path)
            except CheckpointError as exc:
                problems.append(exc.one_line())
                continue
            except ValueError as exc:
                problems.append(f"{path}: unreadable completion marker ({exc})")
                continue
            if parse_marker_name(name) != marker.node_index or marker.tag != tag:
                problems.append(f"{path}: marker names node {marker.node_index} / tag {marker.tag}")
                continue
            found.setdefault(ls.node, []).append(marker)
    return found, problems


def _marker_problems(markers: dict[str, list[layout.CompletionMarker]]) -> list[str]:
    flat = [(node, m) for node, ms in markers.items() for m in ms]
    problems: list[str] = []
    first = flat[0][1]
    for key in ("world_size", "num_nodes", "zero_stage", "engine", "step", "ds_subdir"):
        values = {getattr(m, key) for _, m in flat}
        if len(values) > 1:
            detail = ", ".join(f"{n}: {getattr(m, key)}" for n, m in flat)
            problems.append(f"completion markers disagree on {key} ({detail})")
    by_index: dict[int, list[str]] = {}
    for node, m in flat:
        by_index.setdefault(m.node_index, []).append(node)
    for index, nodes in sorted(by_index.items()):
        if len(nodes) > 1:
            problems.append(f"node index {index} has a marker on {' and '.join(nodes)}")
    for index in range(first.num_nodes):
        if index not in by_index:
            problems.append(f"no completion marker for node index {index} on any selected node "
                            f"(the run had {first.num_nodes} nodes: is one missing from the "
                            "selection, or did its save not finish?)")
    return problems


def _plan(listings: Sequence[NodeListing], tag: str,
          markers: dict[str, list[layout.CompletionMarker]], earlier: list[str]) -> CollectPlan:
    problems = earlier + _marker_problems(markers)
    if problems:
        # Shards are checked against the markers; with markers missing, check what we can.
        problems += _shard_problems(listings, tag, next(iter(markers.values()))[0], ())
        raise CheckpointIncomplete(tag, list(dict.fromkeys(problems)))
    all_markers = sorted((m for ms in markers.values() for m in ms), key=lambda m: m.node_index)
    first = all_markers[0]
    node_of_index = {m.node_index: node for node, ms in markers.items() for m in ms}
    nodes = tuple(NodeRanks(node=node_of_index[m.node_index], node_index=m.node_index,
                            host=m.host, ranks=tuple(r.global_rank for r in m.ranks),
                            rank_files={r.global_rank: r.files for r in m.ranks})
                  for m in all_markers)
    files = _gather_files(listings, tag)
    problems = _shard_problems(listings, tag, first, nodes)
    problems += _marker_file_problems(listings, tag, markers)
    problems += _torn_files(listings, tag)
    if problems:
        raise CheckpointIncomplete(tag, problems)
    canonical = next(n.node for n in nodes if 0 in n.ranks) if any(0 in n.ranks for n in nodes) \
        else nodes[0].node
    return CollectPlan(tag=tag, step=first.step, zero_stage=first.zero_stage,
                       world_size=first.world_size, engine=first.engine,
                       ds_subdir=first.ds_subdir, precision=first.precision, nodes=nodes,
                       files=files, canonical_node=canonical)


def _hint_without_markers(listings: Sequence[NodeListing], tag: str) -> list[str]:
    """When no node has a marker but DeepSpeed's files are there: a user's own script."""
    if any(ls.markers.get(tag) for ls in listings):
        return []
    if not any(_holds_shards(ls.tags.get(tag) or {}) for ls in listings):
        return []
    return [f"{tag} holds DeepSpeed checkpoint files but no node has a completion marker: "
            "only the bundled workload writes them. For a checkpoint your own script saved, "
            "pass --without-markers (docs/collect-ckpt.md says what it checks)"]


def _holds_shards(rels: Iterable[str]) -> bool:
    return any(layout.parse_shard_name(posixpath.basename(rel)) for rel in rels)


def _torn_files(listings: Sequence[NodeListing], tag: str) -> list[str]:
    """``.pt`` files that do not end with their zip end record: cut short."""
    return [f"{ls.node}: {posixpath.join(tag, rel)} is cut short ({info.size} bytes, no zip end "
            "record): its save did not finish, or the file was truncated since"
            for ls in listings for rel, info in (ls.tags.get(tag) or {}).items()
            if info.whole is False and not _is_temp(rel)]


# ------------------------------------------------------------ without markers


def plan_from_files(listings: Sequence[NodeListing], tag: str, world_size: int) -> CollectPlan:
    """The plan for a checkpoint without completion markers (see :class:`WithoutMarkers`).

    Ranks are placed where their shards are; the node holding rank 0's shard (else the
    one whose ``latest`` names the tag) is canonical for the ZeRO 0-2 model states. A
    tag dir holding a universal conversion beside its DeepSpeed tag (HF's checkpoint-N
    after a reshard) is :func:`plan_inside`'s."""
    conv = converted(listings, tag)
    if conv is not None:
        return plan_inside(listings, tag, world_size, conv)
    return _plan_files(listings, tag, world_size)


def plan_inside(listings: Sequence[NodeListing], tag: str, world_size: int,
                conv: Converted) -> CollectPlan:
    """The DeepSpeed tag ``latest`` names, when complete by its own world size (the
    conversion's marker says it: a job's record names the new world); else the
    conversion when some node holds it complete; else refused with both reasons
    (checkpoints/collect/inside.py, the rule)."""
    source = conv.original
    ds_world = conv.world_size if conv.world_size is not None else world_size
    try:
        plan = _plan_files(without(listings, tag, conv.holds), tag, ds_world)
    except CheckpointIncomplete as exc:
        if not conv.usable or source != conv.source:
            raise CheckpointIncomplete(tag, [*exc.problems, *(
                f"its universal conversion {conv.name} cannot stand in: {why}"
                for why in conv.problems or [f"it was converted from {conv.source}, "
                                              f"not {source}"])]) from None
        return _plan_universal(listings, tag, conv, exc.problems)
    return dataclasses.replace(plan, notes=(*plan.notes, (
        f"{tag}: collected {source} (named by {tag}/{LATEST_FILE}, complete for the "
        f"{ds_world} ranks that saved it); {conv.name} beside it, its universal conversion "
        "made by a reshard, is left out")))


def _plan_universal(listings: Sequence[NodeListing], tag: str, conv: Converted,
                    source_problems: Sequence[str]) -> CollectPlan:
    """The conversion and the program's own files (not the old world's DeepSpeed tag, nor
    its ``latest``, which names that tag); the conversion's files from the nodes holding
    it complete only."""
    good = set(conv.complete_on)
    source = conv.original

    def old(rel: str) -> bool:
        return rel == LATEST_FILE or rel.startswith(source + "/")

    kept = [ls if ls.node in good else without([ls], tag, conv.holds)[0]
            for ls in without(listings, tag, old)]
    problems = _torn_files(kept, tag)
    if problems:
        raise CheckpointIncomplete(tag, problems)
    why = "; ".join(source_problems[:2]) or "the world size that saved it is not recorded"
    assert conv.world_size is not None  # usable
    return CollectPlan(
        tag=tag, step=layout.parse_step_tag(tag), zero_stage=conv.zero_stage,
        world_size=conv.world_size, engine="deepspeed", ds_subdir=conv.name,
        precision=conv.precision or "fp32-or-fp16", nodes=_nodes_from_files(kept, {}),
        files=_gather_files(kept, tag), canonical_node=conv.complete_on[0], universal=True,
        notes=(f"{tag}: collected {conv.name}, DeepSpeed's universal checkpoint of {source} "
               f"that a reshard made (named by {tag}/{LATEST_UNIVERSAL_FILE}; complete on "
               f"{fold(conv.complete_on)}), because {source} itself cannot be collected "
               f"({why}); {tag}/{LATEST_FILE} is left out (it names {source}): resume from "
               "DEST with checkpoint.load_universal on",))


def _plan_files(listings: Sequence[NodeListing], tag: str, world_size: int) -> CollectPlan:
    """:func:`plan_from_files` of one DeepSpeed tag."""
    scan = _scan_shards(listings, tag)
    problems = [_parallel_problem(node, rel, shard) for node, rel, shard in scan.parallel]
    if not scan.subdirs:
        raise CheckpointIncomplete(tag, [
            f"no DeepSpeed checkpoint files (mp_rank_00_model_states.pt, "
            f"zero_pp_rank_*_optim_states.pt) under {tag} on any selected node", *problems])
    if len(scan.subdirs) > 1:
        where = ", ".join(repr(d or ".") for d in sorted(scan.subdirs))
        raise CheckpointIncomplete(tag, [f"DeepSpeed files in several directories under {tag} "
                                         f"({where}); point --dir/--tag at one save", *problems])
    sub = next(iter(scan.subdirs))
    kinds = {kind for kind, _ in scan.found}
    stage = 3 if "zero3_model_states" in kinds else (None if "optim_states" in kinds else 0)
    if len(scan.bf16) > 1:
        problems.append(f"optimizer shards under {tag} mix bf16_ and plain names (two saves?)")
    precision = "bf16" if True in scan.bf16 else "fp32-or-fp16"
    problems += _rank_problems(scan.found, world_size, _per_rank_kinds(stage, precision),
                               precision, sub, {},
                               extra_hint=": pass --world-size with the run's size")
    problems += _model_states_problems(listings, tag, stage, sub)
    problems += _torn_files(listings, tag)
    if problems:
        raise CheckpointIncomplete(tag, list(dict.fromkeys(problems)))
    nodes = _nodes_from_files(listings, scan.found)
    model = posixpath.join(sub, layout.model_states_name(0, 0))
    canonical = (next((n.node for n in nodes if 0 in n.ranks), None)
                 or next((ls.node for ls in listings if ls.latest == tag), None)
                 or next((ls.node for ls in listings if model in (ls.tags.get(tag) or {})),
                         listings[0].node))
    return CollectPlan(
        tag=tag, step=layout.parse_step_tag(tag), zero_stage=stage, world_size=world_size,
        engine="accelerate" if sub == ACCELERATE_DS_SUBDIR else "deepspeed",
        ds_subdir=sub, precision=precision, nodes=nodes, files=_gather_files(listings, tag),
        canonical_node=canonical, notes=(
            f"no completion markers: checked DeepSpeed's file set for {world_size} ranks and "
            "that every .pt file is whole; a save still running while the nodes were listed "
            "would not be noticed",))


_Found = dict[tuple[str, int], list[tuple[str, str]]]  # (kind, dp rank) -> [(node, relpath)]


@dataclass(frozen=True)
class _Shards:
    """DeepSpeed's files of one tag across the nodes (one scan, both modes)."""

    found: _Found  # per-rank files of model-parallel rank 0
    subdirs: frozenset[str]  # the directories (under the tag) holding any of them
    bf16: frozenset[bool]  # whether optimizer shards carry the ``bf16_`` prefix
    parallel: tuple[tuple[str, str, layout.ShardName], ...]  # mp_rank != 0: unsupported


def _scan_shards(listings: Sequence[NodeListing], tag: str, under: str = "") -> _Shards:
    """Every DeepSpeed file of ``tag`` (only those below ``under`` when given)."""
    found: _Found = {}
    subdirs: set[str] = set()
    bf16: set[bool] = set()
    parallel: list[tuple[str, str, layout.ShardName]] = []
    for ls in listings:
        for rel in ls.tags.get(tag) or {}:
            if under and not rel.startswith(under + "/"):
                continue
            parsed = layout.parse_shard_name(posixpath.basename(rel))
            if parsed is None or _is_temp(rel):
                continue
            subdirs.add(posixpath.dirname(rel))
            if parsed.mp_rank != 0:
                parallel.append((ls.node, rel, parsed))
            elif parsed.dp_rank is not None:
                found.setdefault((parsed.kind, parsed.dp_rank), []).append((ls.node, rel))
                if parsed.kind == "optim_states":
                    bf16.add(parsed.bf16)
    return _Shards(found, frozenset(subdirs), frozenset(bf16), tuple(parallel))


def _parallel_problem(node: str, rel: str, shard: layout.ShardName) -> str:
    return (f"{node}: {rel}: model-parallel checkpoints (mp_rank {shard.mp_rank}) are not "
            "supported")


def _nodes_from_files(listings: Sequence[NodeListing], found: _Found) -> tuple[NodeRanks, ...]:
    """Every selected node, holding the ranks whose shards are on it."""
    per_node: dict[str, dict[int, list[str]]] = {ls.node: {} for ls in listings}
    for (_, rank), holders in found.items():
        node, rel = holders[0]
        per_node[node].setdefault(rank, []).append(rel)
    return tuple(NodeRanks(node=ls.node, node_index=ls.index, host=ls.node,
                           ranks=tuple(sorted(per_node[ls.node])),
                           rank_files={r: tuple(sorted(f)) for r, f in
                                       sorted(per_node[ls.node].items())})
                 for ls in listings)


def _gather_files(listings: Sequence[NodeListing], tag: str) -> dict[str, tuple[SourceFile, ...]]:
    out: dict[str, list[SourceFile]] = {}
    for ls in listings:
        for name, info in ls.top.items():
            # 'latest' is not copied: DEST gets its own, naming the collected tag.
            if name in RECOVERY_SCRIPTS:
                out.setdefault(name, []).append(SourceFile(ls.node, name, info.size, info.mtime))
        for rel, info in (ls.tags.get(tag) or {}).items():
            if _is_temp(rel):
                continue
            path = posixpath.join(tag, rel)
            out.setdefault(path, []).append(SourceFile(ls.node, path, info.size, info.mtime))
    return {k: tuple(v) for k, v in sorted(out.items())}


def _is_temp(rel: str) -> bool:
    base = posixpath.basename(rel)
    return base.endswith(".tmp") or base.startswith(".")


def _shard_problems(listings: Sequence[NodeListing], tag: str, marker: layout.CompletionMarker,
                    nodes: tuple[NodeRanks, ...]) -> list[str]:
    """Every dp shard 0..W-1 exactly once across nodes, on the node its marker names."""
    world, stage = marker.world_size, marker.zero_stage
    expected_node = {r: n.node for n in nodes for r in n.ranks}
    problems = [f"rank {r} is listed by no completion marker" for r in range(world)
                if nodes and r not in expected_node]
    scan = _scan_shards(listings, tag, under=marker.ds_subdir)
    problems += [_parallel_problem(node, rel, shard) for node, rel, shard in scan.parallel
                 if shard.dp_rank is not None]
    problems += _rank_problems(scan.found, world, _per_rank_kinds(stage, marker.precision),
                               marker.precision, marker.ds_subdir, expected_node)
    return problems + _model_states_problems(listings, tag, stage, marker.ds_subdir)


def _per_rank_kinds(stage: int | None, precision: str) -> list[str]:
    """The files each rank writes; stage None (no markers: 1 or 2) has optimizer shards."""
    kinds = ["optim_states"] if stage is None or layout.has_zero_optimizer_shards(
        stage, precision) else []
    return kinds + (["zero3_model_states"] if stage == 3 else [])


def _rank_problems(found: _Found, world: int, kinds: Sequence[str], precision: str,
                   ds_subdir: str, expected_node: Mapping[int, str], extra_hint: str = ""
                   ) -> list[str]:
    """Each kind's file for ranks 0..world-1 exactly once (on ``expected_node`` when known)."""
    problems: list[str] = []
    for kind in kinds:
        label = "optimizer shard" if kind == "optim_states" else "ZeRO-3 model states"
        for rank in range(world):
            holders = [node for node, _ in found.get((kind, rank), [])]
            name = _shard_file(kind, rank, precision, ds_subdir)
            if not holders:
                where = f"{expected_node[rank]}: " if rank in expected_node else ""
                problems.append(f"{where}{label} of rank {rank} is missing ({name})")
            elif len(holders) > 1:
                problems.append(f"{label} of rank {rank} ({name}) exists on "
                                f"{' and '.join(holders)}; it must exist exactly once")
            elif rank in expected_node and holders[0] != expected_node[rank]:
                problems.append(f"{holders[0]}: has the {label} of rank {rank}, but the "
                                f"markers place rank {rank} on {expected_node[rank]}")
        extra = sorted(r for (k, r) in found if k == kind and r >= world)
        if extra:
            problems.append(f"{label} for ranks {extra} beyond the world size {world}{extra_hint}")
    return problems


def _model_states_problems(listings: Sequence[NodeListing], tag: str, stage: int | None,
                           ds_subdir: str) -> list[str]:
    """ZeRO 0-2 keep one model-states file (some node must have it); ZeRO-3 one per rank."""
    if stage == 3:
        return []
    name = posixpath.join(ds_subdir, layout.model_states_name(0, 0))
    if any(name in (ls.tags.get(tag) or {}) for ls in listings):
        return []
    return [f"no node has {posixpath.join(tag, name)} (the model states)"]


def _shard_file(kind: str, rank: int, precision: str, ds_subdir: str) -> str:
    name = (layout.optim_states_name(rank, bf16=precision == "bf16") if kind == "optim_states"
            else layout.model_states_name(3, rank))
    return posixpath.join(ds_subdir, name) if ds_subdir else name


def _marker_file_problems(listings: Sequence[NodeListing], tag: str,
                          markers: dict[str, list[layout.CompletionMarker]]) -> list[str]:
    """Files a node's marker says it wrote must be there, with the recorded size."""
    problems: list[str] = []
    by_node = {ls.node: ls for ls in listings}
    for node, ms in markers.items():
        present = by_node[node].tags.get(tag) or {}
        for m in ms:
            for rel, size in m.node_files.items():
                info = present.get(rel)
                shard = layout.parse_shard_name(posixpath.basename(rel))
                if info is None and shard is not None and shard.dp_rank is not None:
                    continue  # reported by rank in _shard_problems
                if info is None:
                    problems.append(f"{node}: {posixpath.join(tag, rel)} is missing (its "
                                    "completion marker lists it)")
                elif info.size != size and not _gathered_copy(rel, info.size, ms):
                    problems.append(f"{node}: {posixpath.join(tag, rel)} has {info.size} bytes, "
                                    f"its completion marker recorded {size} (truncated or "
                                    "rewritten after the save)")
    return problems


def _gathered_copy(rel: str, size: int, markers: Sequence[layout.CompletionMarker]) -> bool:
    """One dir holding every node's marker is a gathered checkpoint (collect-ckpt's DEST):
    it has one copy of the model states file that each ZeRO 0-2 node wrote its own of
    (they differ; collect takes node 0's), so that file must match node 0's marker only."""
    shard = layout.parse_shard_name(posixpath.basename(rel))
    return (len(markers) > 1 and (shard is None or shard.dp_rank is None)
            and any(m.node_index == 0 and m.node_files.get(rel) == size for m in markers))
