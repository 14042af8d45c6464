"""Continuing a node-local job without a lost node (issue 22, docs/lost-a-node.md).

``clusterkit launch --job-id J --replace node6=node8``: the plan runs node6's node
index, ranks and slots on node8 (``hostfile.apply_replace``), and before any agent
starts, node6's part of the newest checkpoint the job can resume from is restored
onto node8 from a replica: pulled from its holder into a staging dir on this machine
(the collect machinery: one ``ckstream`` session, sha256 computed on the holder as it
reads and here as it arrives, both equal to the replica manifest's, which is the
source's own), then pushed to node8's checkpoint dir and hashed there again; the
completion marker goes last. The rank->node mapping is node6's with one name
changed, so the resume is exact.

Lives in ``jobs`` because it joins ``launch`` (the plan, the job record) and
``checkpoints`` (the data path), two packages of one layer that may not import each
other (tests/test_layering.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import os
import posixpath
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.checkpoints.collect.scatter import remote_hashes
from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.collectplan import WithoutMarkers
from clusterkit.checkpoints.convert.universal import (
    UNIVERSAL_MARKER,
    UNIVERSAL_SUFFIX,
    Universal,
    convert_to_universal,
    user_resume,
)
from clusterkit.checkpoints.listing import NodeListing
from clusterkit.checkpoints.replicas.assemble import (
    Assembly,
    PartSource,
    assemble,
    candidate_tags,
    ranks_of_map,
)
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.checkpoints.sources.factory import open_source
from clusterkit.checkpoints.sources.transfer import NullProgress, Wanted, sha256_file
from clusterkit.errors import CheckpointError, LaunchError
from clusterkit.launch.jobs import JobRecord
from clusterkit.launch.run import (
    Replacement,
    continue_swaps,
    is_reshard,
    replacements,
    resume_arg,
)
from clusterkit.node.contract import ENV_RESUME_TAG, LATEST_FILE, parse_marker_name
from clusterkit.remote.base import Transport, target_for
from clusterkit.spec.job import JobPlan, NodePlan

Say = Callable[[str], None]


# ------------------------------------------------------------------ what exists


def collect_node(n: NodePlan, root: str) -> CollectNode:
    return CollectNode(n.name, target_for(n.host), n.python, root)


def list_parts(transport: Transport, plan: JobPlan, old_map: Sequence[Sequence[Any]],
               staging: str) -> list[NodeListing]:
    """The listing of every node of ``plan`` that held (or now takes) a node index of the
    job's rank->node mapping ``old_map``, its replica area included, with ``index`` = that
    node index: what :func:`assemble` reads. One collect-ckpt session per node."""
    index_of = {str(row[0]): i for i, row in enumerate(old_map)}
    index_of.update({s.new: s.index for s in replacements(old_map, plan) or ()})
    nodes = [n for n in plan.nodes if n.name in index_of]
    found = _list(transport, [collect_node(n, n.ckpt_dir) for n in nodes], staging)
    return [dataclasses.replace(ls, index=index_of[ls.node]) for ls in found]


def _list(transport: Transport, nodes: Sequence[CollectNode], staging: str) -> list[NodeListing]:
    if not nodes:
        return []
    with open_source(transport, nodes, dest=staging, jobs=len(nodes)) as src:
        return src.listings(None)


def assemble_newest(listings: Sequence[NodeListing], num_nodes: int, markers: bool,
                    old_map: Sequence[Sequence[Any]] = ()) -> list[Assembly]:
    """Every tag that can be assembled from the nodes and the replicas, newest first;
    when none can, the newest tag's attempt alone (its ``missing`` says why). A user's
    script (no ``markers``): each own part by the replicas' rule on its ``old_map`` ranks."""
    tags = candidate_tags(listings, markers=markers)
    ranks = ranks_of_map(old_map) if old_map else None
    tried = [assemble(listings, t, expect_nodes=num_nodes, require_markers=markers, ranks=ranks)
             for t in tags]
    complete = [a for a in tried if a.complete]
    return complete or tried[:1]


# ------------------------------------------------------------------ restoring


@dataclass
class Restore:
    """What restoring one node index's part did, for the console and the tests."""

    replacement: Replacement
    tag: str = ""
    holder: str = ""
    files: int = 0
    bytes: int = 0
    rejected: list[str] = field(default_factory=list)  # holder: why its copy was not used


def prepare_continue(transport: Transport, plan: JobPlan, prior: JobRecord, home: str,
                     say: Say, *, dry_run: bool = False) -> JobPlan | None:
    """Before a continued node-local job starts (``launch.run.launch``'s ``prepare``):

    * the newest checkpoint it can resume from is assembled from the nodes and their
      replicas (``checkpoints/replicas/assemble.py``); when a save exists but none can be
      assembled, a bundled-workload job with ``--resume auto`` (and any ``--replace``
      or reshard) is refused before anything starts, naming what is missing;
    * ``--replace``d node indexes, and any node index whose own copy is gone from its
      node, get their part restored from a verified replica;
    * on another rank->node mapping (fewer nodes), the checkpoint is resharded: gathered
      here, converted to DeepSpeed's universal checkpoint, pushed to every node.

    ``dry_run``: the same listing, assembly and refusal; what would be restored or
    resharded is said, nothing is copied.

    Returns the next attempt's plan when it alone differs: a user's script resharded
    (its ds_config with ``load_universal``, ``CLUSTERKIT_RESUME_TAG``); else None.
    """
    old_map = prior.ckpt.rank_map or []  # the caller continues a record that has one
    resume = resume_arg(plan)
    if resume not in (None, "auto"):  # an explicit tag or `never`: the workload's own checks
        return None
    swaps = continue_swaps(plan, prior)
    reshard = is_reshard(plan, prior)
    with staging_dir(os.path.join(home, "restore")) as staging:
        listings = list_parts(transport, plan, old_map, staging)
        down = [f"{ls.node}: {ls.error}" for ls in listings if ls.error]
        if down:
            if swaps or reshard:
                raise LaunchError(f"cannot ready job {plan.job_id}'s checkpoint: nodes of the job "
                                  f"cannot be listed ({'; '.join(down)})", key="--job-id",
                                  hint="fix those nodes, or leave them out (--replace OLD=NEW "
                                       "or fewer nodes)")
            return None  # the gate names an unreachable node of the plan, as for any launch
        tried = assemble_newest(listings, len(old_map), plan.options.uses_workload, old_map)
        if not tried:
            return None  # nothing saved yet: a fresh start is what the job would do anyway
        if not tried[0].complete:
            if resume == "auto" or swaps or reshard:
                raise LaunchError(f"cannot continue job {plan.job_id}: {tried[0].describe()}",
                                  key="--job-id", hint=REFUSAL_HINT)
            return None
        lost = [] if reshard else _parts_to_restore(plan, tried[0], swaps)
        if dry_run:
            _say_plan(tried[0], lost, reshard, plan, say)
        elif reshard:
            return _reshard(transport, plan, prior, old_map, tried[0], home, say)
        elif lost:
            _restore_parts(transport, plan, tried, lost, staging, say)
    return None


def _say_plan(a: Assembly, lost: Sequence[Replacement], reshard: bool, plan: JobPlan,
              say: Say) -> None:
    """The dry run's account of what the launch would do with the checkpoint."""
    say(a.describe())
    if reshard:
        say(f"the launch would reshard {a.tag} for {len(plan.nodes)} nodes, {plan.world_size} "
            "ranks (gather here, convert to DeepSpeed's universal checkpoint, push to every node)")
        if not plan.options.uses_workload:
            say(f"then your script runs once with checkpoint.load_universal on and "
                f"${ENV_RESUME_TAG}={a.tag}{UNIVERSAL_SUFFIX} (docs/lost-a-node.md)")
    for s in lost:
        part = a.sources.get(s.index)
        where = f"its replica on {part.host}" if part is not None and part.replica else "its copy"
        say(f"the launch would restore node index {s.index} ({s.old})'s part of {a.tag} onto "
            f"{s.new} from {where}")


def _parts_to_restore(plan: JobPlan, a: Assembly, swaps: Sequence[Replacement]
                      ) -> list[Replacement]:
    """The replaced indexes, and any other whose part exists only as a replica (its node
    came back with an empty disk): each is restored onto the node that now runs it."""
    out = list(swaps)
    named = {s.index for s in swaps}
    for index, part in sorted(a.sources.items()):
        if part.replica and index not in named and index < len(plan.nodes):
            name = plan.nodes[index].name
            out.append(Replacement(index, name, name))
    return out


def restore_replacements(transport: Transport, plan: JobPlan, swaps: Sequence[Replacement],
                         old_map: Sequence[Sequence[Any]], staging: str, say: Say
                         ) -> list[Restore]:
    """Put each replaced node index's part of the newest checkpoint that can be assembled
    onto its spare. Raise LaunchError naming what is missing and the options."""
    listings = list_parts(transport, plan, old_map, staging)
    down = [f"{ls.node}: {ls.error}" for ls in listings if ls.error]
    if down:
        raise LaunchError(f"cannot restore {_names(swaps)}: nodes of the job cannot be listed "
                          f"({'; '.join(down)})", key="--replace",
                          hint="fix those nodes, or replace them too (--replace OLD=NEW)")
    tried = assemble_newest(listings, len(plan.nodes), plan.options.uses_workload, old_map)
    return _restore_parts(transport, plan, tried, swaps, staging, say)


def _restore_parts(transport: Transport, plan: JobPlan, tried: Sequence[Assembly],
                   swaps: Sequence[Replacement], staging: str, say: Say) -> list[Restore]:
    """Newest tag first; a tag whose copies all fail verification gives way to the next."""
    rejected: list[str] = []
    for a in (t for t in tried if t.complete):
        done = _restore_tag(transport, plan, a, swaps, staging, say, rejected)
        if done is not None:
            return done
    raise LaunchError(_missing_text(swaps, tried, rejected), key="--replace", hint=REFUSAL_HINT)


# ------------------------------------------------------------------ resharding


def _reshard(transport: Transport, plan: JobPlan, prior: JobRecord,
             old_map: Sequence[Sequence[Any]], a: Assembly, home: str, say: Say) -> JobPlan | None:
    """Gather ``a.tag`` here (collect-ckpt, replicas standing in for lost nodes), convert
    it to DeepSpeed's universal checkpoint and push that to every node of the new plan,
    marker last; the bundled workload then resumes from it on the new world size, a
    user's script from the plan returned (:func:`_user_plan`)."""
    assert a.tag is not None
    old_nodes = _recorded_nodes(prior)
    # A user's script: its save judged by DeepSpeed's own file set (no clusterkit markers).
    # (old_map rows: [node, first rank, ranks])
    bare = None if plan.options.uses_workload else WithoutMarkers(
        sum(int(row[2]) for row in old_map), tuple(int(row[2]) for row in old_map))
    with staging_dir(os.path.join(home, "reshard")) as dest:
        say(f"resharding {a.tag} ({len(old_nodes)} nodes) for {len(plan.nodes)} nodes, "
            f"{plan.world_size} ranks: 1/3 gathering it here ({a.describe()})")
        report = collect(transport, old_nodes, CollectOptions(dest=dest, tag=a.tag,
                                                              without_markers=bare))
        say(f"gathered {a.tag}: {len(report.plan.files)} files, "
            f"{report.bytes_copied / 1e6:.1f} MB, sha256 verified")
        say("2/3 converting it to DeepSpeed's universal checkpoint "
            "(deepspeed.checkpoint.ds_to_universal) ...")
        u = _convert(dest, a.tag, bare, plan)
        say(f"converted to {u.tag} in {u.seconds:.1f} s (saved by {u.marker.world_size} ranks, "
            f"ZeRO-{u.marker.zero_stage}, step {u.marker.step})")
        files = _local_files(dest, u.tag)
        say(f"3/3 pushing {u.tag} ({len(files)} files, "
            f"{sum(size for size, _ in files.values()) / 1e6:.1f} MB) to {len(plan.nodes)} nodes")
        targets = [collect_node(n, n.ckpt_dir) for n in plan.nodes]
        with cf.ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
            list(pool.map(lambda t: _push(transport, t, dest, files), targets))
    if bare is None:
        say(f"every node holds {u.tag}: the workload resumes from it on {plan.world_size} ranks")
        return None
    return _user_plan(plan, u, say)


def _convert(dest: str, tag: str, bare: WithoutMarkers | None, plan: JobPlan) -> Universal:
    """The conversion; a user's checkpoint that cannot be converted is refused in one line."""
    if bare is None:
        return convert_to_universal(dest, tag)
    try:
        return convert_to_universal(dest, tag, without_markers=bare)
    except CheckpointError as exc:
        raise LaunchError(f"cannot relaunch job {plan.job_id} on {len(plan.nodes)} nodes: its "
                          f"checkpoint {tag} cannot be converted to DeepSpeed's universal "
                          f"checkpoint: {exc.message}", key="--job-id",
                          hint="a DeepSpeed ZeRO 1-3 checkpoint saved with "
                               "engine.save_checkpoint converts; else relaunch on the same "
                               "nodes (--replace OLD=NEW for a lost one; docs/lost-a-node.md)"
                          ) from None


def _user_plan(plan: JobPlan, u: Universal, say: Say) -> JobPlan:
    """A user's script's next attempt: the ds_config with ``checkpoint.load_universal`` and
    spec/batch.py's batch, ``CLUSTERKIT_RESUME_TAG`` naming the tag it must load."""
    r = user_resume(plan.ds_config, u.marker, plan.world_size)
    for line in r.lines:
        say(line)
    nodes = tuple(dataclasses.replace(n, env={**n.env, ENV_RESUME_TAG: r.tag})
                  for n in plan.nodes)
    return dataclasses.replace(plan, ds_config=r.ds_config, nodes=nodes)


def _recorded_nodes(prior: JobRecord) -> list[CollectNode]:
    """The job's nodes as recorded, in node-index order (a lost one included: collect
    takes its part from a replica)."""
    by_name = {n.node: n for n in prior.nodes}
    out = []
    for span in prior.ckpt.rank_map or ():
        n = by_name[span.node]
        out.append(CollectNode(n.node, n.target, n.python, str(prior.ckpt.dir_of(n.node))))
    return out


def _local_files(root: str, tag: str) -> dict[str, tuple[int, str]]:
    out = {}
    for d, _dirs, names in os.walk(os.path.join(root, tag)):
        for name in names:
            path = os.path.join(d, name)
            out[os.path.relpath(path, root).replace(os.sep, "/")] = (os.path.getsize(path),
                                                                     sha256_file(path))
    return out


REFUSAL_HINT = ("pass --resume never to start fresh on purpose, or --resume TAG for an older "
                "checkpoint every node still has; `clusterkit status JOB` shows which "
                "checkpoints are replicated; next time keep replicas on (--replicas K, default 1 "
                "with node-local storage; docs/lost-a-node.md)")


def _restore_tag(transport: Transport, plan: JobPlan, a: Assembly, swaps: Sequence[Replacement],
                 staging: str, say: Say, rejected: list[str]) -> list[Restore] | None:
    assert a.tag is not None
    done = []
    for s in swaps:
        r = Restore(s, tag=a.tag)
        cands = a.candidates.get(s.index, ())
        if cands and not cands[0].replica:  # a restore that finished before, on the spare
            r.holder = s.new
            say(f"node index {s.index} ({s.old}): {s.new} already holds its part of {a.tag}")
            done.append(r)
            continue
        say(f"restoring node index {s.index} ({s.old})'s part of {a.tag} onto {s.new} "
            "from its replica ...")
        for part in (c for c in cands if c.replica):
            why = _try_copy(transport, plan, s, part, a.tag,
                            os.path.join(staging, f"node{s.index}"), r)
            if why is None:
                break
            r.rejected.append(f"{part.host}'s copy of {a.tag}: {why}")
        rejected.extend(r.rejected)
        for why in r.rejected:
            say(f"  not used: {why}")
        if not r.holder:
            return None
        say(f"restored {a.tag} of node index {s.index} ({s.old}) onto {s.new}: {r.files} files, "
            f"{r.bytes / 1e6:.1f} MB from its replica on {r.holder}, each file's sha256 equal to "
            "the replica manifest's as read on the holder, as received here and on " + s.new)
        done.append(r)
    return done


def _missing_text(swaps: Sequence[Replacement], tried: Sequence[Assembly],
                  rejected: Sequence[str]) -> str:
    what = (tried[0].describe() if tried and not tried[0].complete else
            "no checkpoint of the job on its nodes or in their replicas" if not tried else
            "every copy failed verification")
    text = f"cannot continue with {_names(swaps)}: {what}"
    return text + ("; rejected: " + "; ".join(rejected) if rejected else "")


def _try_copy(transport: Transport, plan: JobPlan, s: Replacement, part: PartSource, tag: str,
              staging: str, result: Restore) -> str | None:
    """Pull one replica from its holder and push it to the spare; None when done, else why
    this copy was not used (the staging files of a rejected copy are removed)."""
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging, exist_ok=True)
    holder = next(n for n in plan.nodes if n.name == part.host)
    files = {rel: (size, part.sha256[rel]) for rel, size in part.files.items()}
    try:
        _pull(transport, collect_node(holder, part.root), files, staging)
        spare = plan.nodes[s.index]
        _push(transport, collect_node(spare, spare.ckpt_dir), staging, files)
    except LaunchError as exc:
        return exc.message
    result.holder, result.files = part.host, len(files)
    result.bytes = sum(size for size, _ in files.values())
    return None


def _pull(transport: Transport, holder: CollectNode, files: Mapping[str, tuple[int, str]],
          staging: str) -> None:
    """The replica's files into ``staging``: each checked against the manifest's sha256
    (the source's) as the holder reads it and as it arrives here, so a copy corrupted on
    the holder's disk is caught and never used."""
    wanted = [Wanted(holder.name, rel, size, digest) for rel, (size, digest) in files.items()]
    with open_source(transport, [holder], dest=staging, jobs=1) as src:
        results, _, problems = src.copy(wanted, {}, NullProgress())
    failed = results.get(holder.name)
    bad = dict(failed.failed) if failed is not None else {}
    missing = [w.relpath for w in wanted
               if not os.path.isfile(os.path.join(staging, w.relpath)) and w.relpath not in bad]
    if bad or missing or problems:
        shown = [f"{rel}: {why}" for rel, why in list(bad.items())[:3]]
        shown += [f"{rel}: not received" for rel in missing[:3]] + problems[:2]
        raise LaunchError("; ".join(shown))


def _push(transport: Transport, spare: CollectNode, local_root: str,
          files: Mapping[str, tuple[int, str]]) -> None:
    """The staged files into the spare's checkpoint dir, hashed there; the completion
    marker and ``latest`` last, so a spare that did not get everything never looks
    complete to the workload's resume."""
    last = sorted(f for f in files if _goes_last(f))
    first = sorted(f for f in files if not _goes_last(f))
    for d in sorted({posixpath.dirname(posixpath.join(spare.root, f)) for f in files}):
        transport.makedirs(spare.target, d)
    transport.run(spare.target, ["rm", "-f", "--", *(posixpath.join(spare.root, f)
                                                     for f in last)], timeout=60.0)
    for group in (first, last):
        for f in group:
            transport.put(spare.target, os.path.join(local_root, f), posixpath.join(spare.root, f))
        _check_on_node(transport, spare, group, files)


def _goes_last(rel: str) -> bool:
    """What makes a checkpoint look complete on its node: written after the rest."""
    name = posixpath.basename(rel)
    return (rel == LATEST_FILE or parse_marker_name(name) is not None
            or name == UNIVERSAL_MARKER)


def _check_on_node(transport: Transport, node: CollectNode, rels: Sequence[str],
                   files: Mapping[str, tuple[int, str]]) -> None:
    if not rels:
        return
    try:
        got = remote_hashes(transport, node, rels)
    except CheckpointError as exc:  # a restore's failures are the launch's: LaunchError
        raise LaunchError(f"{node.name}: {exc.message}", host=node.name) from None
    bad = [r for r in rels if got.get(r) != files[r][1]]
    if bad:
        raise LaunchError(f"sha256 mismatch on {node.name} after upload: {', '.join(bad[:4])}",
                          host=node.name)


def _names(swaps: Sequence[Replacement]) -> str:
    return ", ".join(f"{s.old} -> {s.new}" for s in swaps)


@contextlib.contextmanager
def staging_dir(path: str) -> Iterator[str]:
    """The restore's staging dir on this machine, removed afterwards (it held one node's
    share of one checkpoint, once)."""
    os.makedirs(path, exist_ok=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
