"""Resharding a node-local job's checkpoint for another rank->node mapping.

A continued job on fewer nodes (a lost node with no spare, ``--exclude``, ``--nodes``)
cannot resume from node-local parts tied to the old mapping: its newest checkpoint is
gathered here (collect-ckpt, replicas standing in for lost nodes), converted to
DeepSpeed's universal checkpoint, and pushed to every node of the new plan, marker last
(docs/lost-a-node.md). The bundled workload resumes from it on the new world size; a
user's script gets its next attempt's plan (``checkpoint.load_universal``,
``CLUSTERKIT_RESUME_TAG``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os

from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.collectplan import WithoutMarkers
from clusterkit.checkpoints.convert.universal import (
    Universal,
    convert_to_universal,
    user_resume,
)
from clusterkit.checkpoints.replicas.assemble import Assembly
from clusterkit.errors import CheckpointError, LaunchError
from clusterkit.jobs.resolve import recorded_nodes
from clusterkit.jobs.restore import Say, collect_node, push_files, staging_dir
from clusterkit.launch.registry import JobRecord
from clusterkit.node.contract import ENV_RESUME_TAG
from clusterkit.node.hashing import sha256_file
from clusterkit.remote.base import Transport
from clusterkit.spec.job import JobPlan
from clusterkit.spec.jobrecord import RankMap


def reshard(transport: Transport, plan: JobPlan, prior: JobRecord,
             old_map: RankMap, a: Assembly, home: str, say: Say) -> JobPlan | None:
    """Gather ``a.tag`` here (collect-ckpt, replicas standing in for lost nodes), convert
    it to DeepSpeed's universal checkpoint and push that to every node of the new plan,
    marker last; the bundled workload then resumes from it on the new world size, a
    user's script from the plan returned (:func:`_user_plan`)."""
    assert a.tag is not None
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
        files = _local_files(dest, u.tag)
        say(f"3/3 pushing {u.tag} ({len(files)} files, "
            f"{sum(size for size, _ in files.values()) / 1e6:.1f} MB) to {len(plan.nodes)} nodes")
        targets = [collect_node(n, n.ckpt_dir) for n in plan.nodes]
        with cf.ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
            list(pool.map(lambda t: push_files(transport, t, dest, files), targets))
    if bare is None:
        say(f"every node holds {u.tag}: the workload resumes from it on {plan.world_size} ranks")
        return None
    return _user_plan(plan, u, say)


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


def _local_files(root: str, tag: str) -> dict[str, tuple[int, str]]:
    out = {}
    for d, _dirs, names in os.walk(os.path.join(root, tag)):
        for name in names:
            path = os.path.join(d, name)
            out[os.path.relpath(path, root).replace(os.sep, "/")] = (os.path.getsize(path),
                                                                     sha256_file(path))
    return out
