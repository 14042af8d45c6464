"""Resharding a node-local job's checkpoint for another rank->node mapping.

A continued job on fewer nodes (a lost node with no spare, ``--exclude``, ``--nodes``)
cannot resume from node-local parts tied to the old mapping: its newest checkpoint is
gathered here (collect-ckpt, replicas standing in for lost nodes), converted to
DeepSpeed's universal checkpoint, and pushed to every node of the new plan, marker last
(docs/lost-a-node.md). The bundled workload resumes from it on the new world size; a
user's script gets its next attempt's plan (``checkpoint.load_universal``,
``CLUSTERKIT_RESUME_TAG``). A program whose DeepSpeed tag sits inside its own tag dir
(``OtherWorld.UNIVERSAL_INSIDE``): HF's ``checkpoint-N/global_stepN`` is converted beside
itself (``global_stepN_universal``, ``latest_universal``); accelerate's
``step_N/pytorch_model``, which its load_state loads by that name, in its place (the old
world's tag kept as ``step_N/pytorch_model.set-aside`` on every node, ``latest_universal``
naming the conversion); the whole tag dir is pushed, and the next attempt's derived
DeepSpeed config gets ``load_universal`` (jobs/recover.py adds HF's resume argument).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import posixpath
from collections.abc import Sequence

from clusterkit.checkpoints.collect.inside import converted
from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.collectplan import WithoutMarkers
from clusterkit.checkpoints.convert.tagdir import (
    inside_line,
    into_tag_dir,
    local_files,
    with_load_universal,
)
from clusterkit.checkpoints.convert.universal import Universal, convert_to_universal, user_resume
from clusterkit.checkpoints.listing import NodeListing
from clusterkit.checkpoints.replicas.assemble import Assembly, candidate_tags
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.errors import CheckpointError, LaunchError
from clusterkit.jobs.resolve import recorded_nodes
from clusterkit.jobs.restore import Say, collect_node, push_files, staging_dir
from clusterkit.launch.registry import JobRecord
from clusterkit.node.contract import (
    ENV_RESUME_TAG,
    LATEST_UNIVERSAL_FILE,
    UNIVERSAL_SUFFIX,
)
from clusterkit.remote.base import Transport
from clusterkit.spec.job import JobPlan
from clusterkit.spec.jobrecord import RankMap
from clusterkit.spec.programs import DERIVED_DS_CONFIG, OWN_CONFIG_FIX, OWN_CONFIG_WHY, OtherWorld


def reshard(transport: Transport, plan: JobPlan, prior: JobRecord,
             old_map: RankMap, a: Assembly, home: str, say: Say) -> JobPlan | None:
    """Gather ``a.tag`` here (collect-ckpt, replicas standing in for lost nodes), convert
    it to DeepSpeed's universal checkpoint and push that to every node of the new plan,
    marker last; the bundled workload then resumes from it on the new world size, a
    user's script from the plan returned (:func:`_user_plan`)."""
    assert a.tag is not None
    check_inside(plan)
    old_nodes = recorded_nodes(prior)
    # A user's script: its save judged by DeepSpeed's own file set (no clusterkit markers).
    bare = None if plan.options.uses_workload else WithoutMarkers(
        sum(span.nproc for span in old_map), tuple(span.nproc for span in old_map))
    with staging_dir(os.path.join(home, "reshard")) as dest:
        say(f"resharding {a.tag} ({len(old_nodes)} nodes) for {len(plan.nodes)} nodes, "
            f"{plan.world_size} ranks: 1/3 gathering it here ({a.describe()})")
        report = collect(transport, old_nodes, CollectOptions(dest=dest, tag=a.tag,
                                                              without_markers=bare))
        say(f"gathered {a.tag}: {len(report.plan.files)} files, "
            f"{report.bytes_copied / 1e6:.1f} MB, sha256 verified")
        say("2/3 converting it to DeepSpeed's universal checkpoint "
            "(deepspeed.checkpoint.ds_to_universal) ...")
        u = convert_checkpoint(dest, a.tag, bare, plan)
        say(f"converted to {u.tag} in {u.seconds:.1f} s (saved by {u.marker.world_size} ranks, "
            f"ZeRO-{u.marker.zero_stage}, step {u.marker.step})")
        inside = _inside(plan)
        in_place = inside and plan.profile is not None and plan.profile.profile.ds_tag is not None
        if inside:
            u, files = into_tag_dir(dest, a.tag, u, in_place=in_place)
        else:
            files = local_files(dest, u.tag)
        say(f"3/3 pushing {u.tag} ({len(files)} files, "
            f"{sum(size for size, _ in files.values()) / 1e6:.1f} MB) to {len(plan.nodes)} nodes")
        targets = [collect_node(n, n.ckpt_dir) for n in plan.nodes]

        def push(t: CollectNode) -> None:
            if in_place:
                _move_aside(transport, t, u.tag, u.marker.source_tag)
            push_files(transport, t, dest, files)

        with cf.ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
            list(pool.map(push, targets))
    if bare is None:
        say(f"every node holds {u.tag}: the workload resumes from it on {plan.world_size} ranks")
        return None
    if inside:
        return _inside_plan(plan, u, say)
    return _user_plan(plan, u, say)


def _inside(plan: JobPlan) -> bool:
    """DeepSpeed's tag inside the program's own tag dir (HF's checkpoint-N/global_stepN)."""
    return plan.profile is not None and \
        plan.profile.profile.other_world is OtherWorld.UNIVERSAL_INSIDE


def check_inside(plan: JobPlan) -> None:
    """Before anything is gathered: the attempt's DeepSpeed config must be clusterkit's
    derived copy (the user's own file is never edited, so load_universal goes there)."""
    if _inside(plan) and DERIVED_DS_CONFIG not in plan.program_files:
        raise LaunchError(f"cannot relaunch job {plan.job_id} on {len(plan.nodes)} nodes: "
                          f"{OWN_CONFIG_WHY}", key="--job-id",
                          hint="relaunch on the same nodes (--replace OLD=NEW for a lost one; "
                               f"docs/lost-a-node.md), or {OWN_CONFIG_FIX}")


# A node's own part of the old world's tag (its ranks' optimizer shards) moved to the aside
# name; nothing where it has none (a node new to the mapping) or where the name holds the
# conversion already (an earlier try's push: it has no optimizer shard of a rank).
_ASIDE_SCRIPT = ('for f in "$1"/*optim_states.pt; do test -e "$f" || exit 0; '
                 'exec mv -T -- "$1" "$2"; done')


def _move_aside(transport: Transport, node: CollectNode, conv: str, original: str) -> None:
    """accelerate's layout on one node before the push: its copy of the old world's
    DeepSpeed tag (``<tag>/pytorch_model``) renamed ``<tag>/pytorch_model.set-aside``
    (kept, never deleted), so that the conversion takes the name accelerate loads."""
    src, dst = posixpath.join(node.root, conv), posixpath.join(node.root, original)
    res = transport.run(node.target, ["sh", "-c", _ASIDE_SCRIPT, "sh", src, dst], timeout=60.0)
    if not res.ok:
        raise LaunchError(f"{node.name}: cannot move {conv} aside to {original} before the "
                          f"conversion takes its place: {res.stderr.strip()[-200:]}",
                          host=node.name, hint=f"move {dst} away on {node.name} (it is kept "
                                               "otherwise), then launch again")


def _inside_plan(plan: JobPlan, u: Universal, say: Say) -> JobPlan:
    """The next attempt's derived DeepSpeed config with ``checkpoint.load_universal``
    (this attempt only); the resume argument is the profile's (jobs/recover.resume_plan).
    The batch stays the program's own (HF and accelerate compute it from its arguments)."""
    if plan.profile is not None:
        say(inside_line(u, plan.world_size, plan.profile.profile, "this attempt only"))
    return load_universal_plan(plan)


def load_universal_plan(plan: JobPlan) -> JobPlan:
    """``plan`` with ``checkpoint.load_universal`` on in its derived DeepSpeed config."""
    doc = with_load_universal(json.loads(plan.program_files[DERIVED_DS_CONFIG]))
    return dataclasses.replace(plan, program_files={
        **plan.program_files, DERIVED_DS_CONFIG: json.dumps(doc, indent=2) + "\n"})


def converted_inside(listings: Sequence[NodeListing], tags: Sequence[str]) -> str | None:
    """The newest of ``tags`` (newest first) that a reshard converted inside itself on
    every node listed (pure): collect-ckpt's and status's rule (checkpoints/collect/
    inside.py: every file its marker lists, on every node); a conversion from before the
    marker went with it: each node holds ``latest_universal`` and the same files under one
    ``<DeepSpeed tag>_universal/``. After a reshard the old DeepSpeed tag beside it (the
    old world's shards) makes the tag look unassemblable on the new mapping; a restart
    before the next save resumes from the converted one again, never from step 0."""
    if not listings or any(ls.error for ls in listings):
        return None
    for tag in tags:
        conv = converted(listings, tag)
        if conv is not None and conv.world_size is not None:
            if conv.everywhere and len(conv.complete_on) == len(listings):
                return tag
            continue
        seen: list[dict[str, int]] = []
        for ls in listings:
            files = ls.tags.get(tag) or {}
            uni = {rel: fi.size for rel, fi in files.items()
                   if rel.split("/", 1)[0].endswith(UNIVERSAL_SUFFIX) and "/" in rel}
            if LATEST_UNIVERSAL_FILE not in files or not uni:
                break
            seen.append(uni)
        else:
            if all(s == seen[0] for s in seen):
                return tag
    return None


def converted_again(listings: Sequence[NodeListing], tried: Sequence[Assembly] | None
                    ) -> str | None:
    """The tag a restart resumes from again with load_universal on: the newest tag
    converted inside itself by an earlier reshard (:func:`converted_inside`) unless a
    complete save newer than it can be assembled (``tried``: what can, newest first). A
    launch's restart (jobs/recover.py) and a ``clusterkit sbatch`` run (jobs/slurm_reshard.py
    again) ask it; None when there is none."""
    tags = candidate_tags(listings, markers=False)
    found = converted_inside(listings, tags)
    if found is None or (tried and tried[0].complete and tried[0].tag in tags
                         and tags.index(str(tried[0].tag)) < tags.index(found)):
        return None
    return found


def again_line(tag: str, when: str) -> str:
    return (f"{tag}: resuming from its DeepSpeed tag converted by the reshard "
            f"({LATEST_UNIVERSAL_FILE}), checkpoint.load_universal on for {when}")


def convert_checkpoint(dest: str, tag: str, bare: WithoutMarkers | None, plan: JobPlan
                       ) -> Universal:
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
