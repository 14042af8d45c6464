"""Continuing a node-local job without a lost node (issue 22, docs/lost-a-node.md).

``clusterkit launch --job-id J --replace node6=node8``: the plan runs node6's node
index, ranks and slots on node8 (``hostfile.apply_replace``), and before any agent
starts, node6's part of the newest checkpoint the job can resume from is restored
onto node8 from a replica: pulled from its holder into a staging dir on this machine
(the collect machinery: one ``ckpt.stream`` session, sha256 computed on the holder as it
reads and here as it arrives, both equal to the replica manifest's, which is the
source's own), then pushed to node8's checkpoint dir and hashed there again; the
completion marker goes last. The rank->node mapping is node6's with one name
changed, so the resume is exact.

Here: the decision (what can be assembled, what to restore, a reshard, or the refusal)
and the dry run's account of it; the copying is ``jobs/restore.py``, the reshard
``jobs/reshard.py``. Lives in ``jobs`` because it joins ``launch`` (the plan, the job
record) and ``checkpoints`` (the data path), two packages of one layer that may not
import each other (tests/unit/test_layering.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from clusterkit.checkpoints.listing import NodeListing
from clusterkit.checkpoints.replicas.assemble import (
    Assembly,
    assemble,
    candidate_tags,
    ranks_of_map,
)
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.checkpoints.sources.factory import open_source
from clusterkit.errors import LaunchError
from clusterkit.jobs.reshard import (
    again_line,
    converted_again,
    load_universal_plan,
    reshard,
)
from clusterkit.jobs.restore import (
    REFUSAL_HINT,
    Restore,
    Say,
    collect_node,
    restore_parts,
    staging_dir,
    swap_names,
)
from clusterkit.jobs.spread import spread_files
from clusterkit.launch.continuation import (
    Replacement,
    continue_swaps,
    is_reshard,
    other_world,
    replacements,
    resume_arg,
)
from clusterkit.launch.registry import JobRecord
from clusterkit.node.ckpt.ready import readiness
from clusterkit.node.contract import (
    ASIDE_SUFFIX,
    ENV_RESUME_TAG,
    UNIVERSAL_SUFFIX,
)
from clusterkit.remote.base import Transport
from clusterkit.spec.job import JobPlan
from clusterkit.spec.jobrecord import RankMap
from clusterkit.spec.programs import DERIVED_DS_CONFIG, OtherWorld
from clusterkit.spec.resume import plan_rule, resumed_program


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
      here, converted to DeepSpeed's universal checkpoint, pushed to every node; a
      program whose checkpoint loads on any world size as it is (a torch snapshot,
      ``OtherWorld.AS_IS``) has its one-writer files put on every node of the new
      mapping (the spread below) and nothing converted.

    ``dry_run``: the same listing, assembly and refusal; what would be restored or
    resharded is said, nothing is copied.

    Returns the next attempt's plan when it alone differs: a user's script resharded
    (its ds_config with ``load_universal``, ``CLUSTERKIT_RESUME_TAG``); else None.
    """
    old_map: RankMap = prior.ckpt.rank_map or []  # the caller continues a record that has one
    resume = resume_arg(plan)
    if resume not in (None, "auto"):  # an explicit tag or `never`: the workload's own checks
        return None
    swaps = continue_swaps(plan, prior)
    # Another mapping: converted (the universal checkpoint), or as it is (a snapshot: the
    # spread below is all it needs).
    resharding = is_reshard(plan, prior) and other_world(plan) is not OtherWorld.AS_IS
    with staging_dir(os.path.join(home, "restore")) as staging:
        if plan.profile is not None and plan.profile.profile.one_writer:
            if dry_run:
                say_spread(plan, prior, say)
            else:
                spread_files(transport, plan, staging, say)  # a snapshot: on every node first
        if not resharding and is_reshard(plan, prior):
            # As it is on another mapping: on every node now; the old mapping's parts
            # (what the assembly below reads) say nothing of the new one.
            return None
        listings = list_parts(transport, plan, old_map, staging)
        tried = _resumable(plan, listings, old_map, resume, must=bool(swaps) or resharding)
        again = None if resharding else _converted(plan, listings, tried)
        if again is not None:
            # A tag dir converted by an earlier reshard, nothing complete saved since
            if dry_run:
                say(f"{again} holds its DeepSpeed tag converted by a reshard: the program "
                    "would resume from it with checkpoint.load_universal on")
                return None
            say(again_line(again, "this attempt"))
            # A program that picks the newest save itself (accelerate) gets the newer,
            # unassemblable ones moved aside; the config holds whatever readiness adds.
            again_plan = load_universal_plan(plan)
            return resume_tag(again_plan, again, newer_than(listings, again), say) or again_plan
        if tried is None:
            return None
        newer = newer_tags(listings, tried[0], plan.options.uses_workload)
        lost = [] if resharding else _parts_to_restore(plan, tried[0], swaps)
        if dry_run:
            say_plan(tried[0], lost, resharding, plan, say)
            resume_plan(plan, tried[0], newer, say)
            return None
        if resharding:
            # The converted tag is what a reshard resumes (CLUSTERKIT_RESUME_TAG); HF's,
            # inside its tag dir, is found by DeepSpeed there, the tag dir named to the
            # program by its resume argument.
            # Then the program's readiness as for any restart: HF's resume argument; a
            # script of the contract that picks the newest tag finds no newer save.
            new = reshard(transport, plan, prior, old_map, tried[0], home, say)
            return resume_plan(new or plan, tried[0], newer, say) or new
        if lost:
            restore_parts(transport, plan, tried, lost, staging, say)
    return resume_plan(plan, tried[0], newer, say)


def newer_tags(listings: Sequence[NodeListing], a: Assembly, markers: bool) -> list[str]:
    """The tags newer than the one a restart resumes from: saved, but not assemblable
    on this node set (``assemble_newest`` takes the newest that is)."""
    return newer_than(listings, a.tag, markers=markers) if a.tag is not None else []


def newer_than(listings: Sequence[NodeListing], tag: str, *, markers: bool = False
               ) -> list[str]:
    """The candidate tags newer than ``tag`` (newest first)."""
    tags = candidate_tags(listings, markers=markers)
    return tags[:tags.index(tag)] if tag in tags else []


def _converted(plan: JobPlan, listings: Sequence[NodeListing], tried: list[Assembly] | None
               ) -> str | None:
    """An HF tag converted inside itself by an earlier reshard, newer than what can be
    assembled (reshard.converted_inside); None for any other program."""
    if other_world(plan) is not OtherWorld.UNIVERSAL_INSIDE or not listings \
            or DERIVED_DS_CONFIG not in plan.program_files:
        return None
    return converted_again(listings, tried)


def resume_plan(plan: JobPlan, a: Assembly, newer: Sequence[str], say: Say) -> JobPlan | None:
    """The next attempt of a user's program resumes from ``a`` (the newest checkpoint
    complete on every node): :func:`resume_tag`."""
    if a.tag is None:
        return None
    return resume_tag(plan, a.tag, newer, say)


def resume_tag(plan: JobPlan, tag: str, newer: Sequence[str], say: Say) -> JobPlan | None:
    """The next attempt of a user's program resumes from ``tag``: readied by its profile's
    rule (node/ckpt/ready.readiness, the batch script's too): its resume argument on every
    node's program, DeepSpeed's ``latest`` pointed at it where that is how the program
    picks, newer tags moved aside where it picks by itself; refused in one line when the
    program has no known way to resume (it would begin at step 0)."""
    rule = plan_rule(plan)
    if not rule or plan.profile is None:
        return None
    r = readiness(rule, plan.nodes[0].ckpt_dir, tag, newer)
    if r.refusal is not None:
        raise LaunchError(r.refusal, key="--resume-arg")
    for line in r.lines:
        say(line)
    if not r.changes:
        return None
    template = plan.profile.resume
    programs = plan.programs if not r.resume else tuple(
        resumed_program(prog, template, f"{n.ckpt_dir}/{tag}")
        for prog, n in zip(plan.programs, plan.nodes, strict=True))
    return dataclasses.replace(plan, programs=programs, set_aside=r.aside or plan.set_aside,
                               resume_from=tag if r.resume or r.latest else plan.resume_from)


def _resumable(plan: JobPlan, listings: Sequence[NodeListing], old_map: RankMap,
               resume: str | None, *, must: bool) -> list[Assembly] | None:
    """What can be assembled, newest first, the first complete; None: the launch goes on
    with nothing to ready (nothing saved yet, or it resumes by its own rules). Raises
    LaunchError when it must not start: nodes of the job cannot be listed or no save is
    whole, and ``must`` (a --replace or a reshard) or the workload resumes with auto."""
    down = [f"{ls.node}: {ls.error}" for ls in listings if ls.error]
    if down:
        if must:
            raise LaunchError(f"cannot ready job {plan.job_id}'s checkpoint: nodes of the job "
                              f"cannot be listed ({'; '.join(down)})", key="--job-id",
                              hint="fix those nodes, or leave them out (--replace OLD=NEW "
                                   "or fewer nodes)")
        return None  # the gate names an unreachable node of the plan, as for any launch
    tried = assemble_newest(listings, len(old_map), plan.options.uses_workload, old_map)
    if not tried:
        return None  # nothing saved yet: a fresh start is what the job would do anyway
    if not tried[0].complete:
        if resume == "auto" or must:
            raise LaunchError(f"cannot continue job {plan.job_id}: {tried[0].describe()}",
                              key="--job-id", hint=REFUSAL_HINT)
        return None
    return tried


def say_spread(plan: JobPlan, prior: JobRecord, say: Say) -> None:
    """The dry run's account of a one-writer file (a snapshot) before the start."""
    say("the launch would copy each file at the top of the checkpoint dir (its newest copy, "
        "sha256 verified) to every node of the plan whose copy is missing or differs"
        + (f"; on {len(plan.nodes)} nodes, {plan.world_size} ranks, nothing is converted "
           "(it loads on any world size as it is)" if is_reshard(plan, prior) else ""))


def say_plan(a: Assembly, lost: Sequence[Replacement], reshard: bool, plan: JobPlan,
              say: Say) -> None:
    """The dry run's account of what the launch would do with the checkpoint."""
    say(a.describe())
    if reshard:
        say(f"the launch would reshard {a.tag} for {len(plan.nodes)} nodes, {plan.world_size} "
            "ranks (gather here, convert to DeepSpeed's universal checkpoint, push to every node)")
        if other_world(plan) is OtherWorld.UNIVERSAL_INSIDE:
            say(_inside_words(plan, a.tag))
        elif not plan.options.uses_workload:
            say(f"then your script runs once with checkpoint.load_universal on and "
                f"${ENV_RESUME_TAG}={a.tag}{UNIVERSAL_SUFFIX} (docs/lost-a-node.md)")
    for s in lost:
        part = a.sources.get(s.index)
        where = f"its replica on {part.host}" if part is not None and part.replica else "its copy"
        say(f"the launch would restore node index {s.index} ({s.old})'s part of {a.tag} onto "
            f"{s.new} from {where}")


def _inside_words(plan: JobPlan, tag: str | None) -> str:
    """The dry run's account of where a conversion inside the program's tag dir goes."""
    ds_tag = None if plan.profile is None else plan.profile.profile.ds_tag
    if ds_tag is None:
        return (f"inside {tag} (its DeepSpeed tag with {UNIVERSAL_SUFFIX} and latest_universal "
                "beside it); then your program runs once with checkpoint.load_universal on "
                "in its derived DeepSpeed config and its resume argument (docs/programs.md)")
    return (f"inside {tag}, in the place of {tag}/{ds_tag}, the DeepSpeed tag your program "
            f"loads by that name (the old world's kept as {tag}/{ds_tag}{ASIDE_SUFFIX} on every "
            "node); then your program runs once with checkpoint.load_universal on in its "
            "derived DeepSpeed config and loads it by itself (docs/programs.md)")


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
                         old_map: RankMap, staging: str, say: Say
                         ) -> list[Restore]:
    """Put each replaced node index's part of the newest checkpoint that can be assembled
    onto its spare. Raise LaunchError naming what is missing and the options."""
    listings = list_parts(transport, plan, old_map, staging)
    down = [f"{ls.node}: {ls.error}" for ls in listings if ls.error]
    if down:
        raise LaunchError(f"cannot restore {swap_names(swaps)}: nodes of the job cannot be listed "
                          f"({'; '.join(down)})", key="--replace",
                          hint="fix those nodes, or replace them too (--replace OLD=NEW)")
    tried = assemble_newest(listings, len(plan.nodes), plan.options.uses_workload, old_map)
    return restore_parts(transport, plan, tried, swaps, staging, say)


def list_parts(transport: Transport, plan: JobPlan, old_map: RankMap,
               staging: str) -> list[NodeListing]:
    """The listing of every node of ``plan`` that held (or now takes) a node index of the
    job's rank->node mapping ``old_map``, its replica area included, with ``index`` = that
    node index: what :func:`assemble` reads. One collect-ckpt session per node."""
    index_of = {span.node: i for i, span in enumerate(old_map)}
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
                    old_map: RankMap | None = None) -> list[Assembly]:
    """Every tag that can be assembled from the nodes and the replicas, newest first;
    when none can, the newest tag's attempt alone (its ``missing`` says why). A user's
    script (no ``markers``): each own part by the replicas' rule on its ``old_map`` ranks."""
    tags = candidate_tags(listings, markers=markers)
    ranks = ranks_of_map(old_map) if old_map else None
    tried = [assemble(listings, t, expect_nodes=num_nodes, require_markers=markers, ranks=ranks)
             for t in tags]
    complete = [a for a in tried if a.complete]
    return complete or tried[:1]
