"""Replica health of a node-local ``clusterkit sbatch`` job (issue 31, docs/sbatch.md).

``clusterkit sbatch status JOBID`` says, below the job's state line, what ``clusterkit
status`` says for a launched job (checkpoints/replicas/health.py): per checkpoint, how
many node parts are on their own node and how many have a complete replica. The nodes
are the job's Slurm nodes (``slurm_nodes``: where the checkpoint is), listed through
Slurm as collect-ckpt reaches them (jobs/resolve.py: a step of the running job, else a
one-task allocation on each node); a node Slurm cannot reach is said, never fatal.
"""

from __future__ import annotations

from pathlib import Path

from clusterkit.checkpoints.collect.tags import answers
from clusterkit.checkpoints.collectplan import WithoutMarkers
from clusterkit.checkpoints.replicas.health import JobHealth, TagHealth, health, list_all
from clusterkit.errors import ClusterkitError
from clusterkit.jobs.resolve import NodeChoice, batch_job_nodes
from clusterkit.launch.registry import JobRecord, Registry
from clusterkit.remote.dispatch import transport_for


def batch_job_health(record: JobRecord, home: Path) -> JobHealth | None:
    """The health of a batch job's checkpoints; None when it is not node-local."""
    if not record.ckpt.node_local or not record.job_dir:
        return None
    try:
        resolved = batch_job_nodes(record, NodeChoice(job=record.job_id), None, home)
    except ClusterkitError as exc:
        return JobHealth([], {"nodes": exc.one_line()}, record.ckpt.markers)
    with transport_for() as transport:  # unused by Slurm places; the factory takes one
        listings = list_all(transport, resolved.nodes)
    slots = tuple(resolved.slots)
    tags: list[TagHealth]
    if record.ckpt.markers or all(slots):  # collect-ckpt's answer too (checkpoints/collect/tags.py)
        wm = None if record.ckpt.markers else WithoutMarkers(world_size=sum(slots), slots=slots)
        tags = list(answers(listings, expect_nodes=len(resolved.nodes), without_markers=wm))
    else:  # a user's script on nodes of unknown slots: the replicas' view alone
        tags = health(listings, expect_nodes=len(resolved.nodes), markers=False)
    return JobHealth(tags, {ls.node: ls.error for ls in listings if ls.error},
                     record.ckpt.markers)


def slurm_job_health_lines(home: Path, slurm_job_id: str) -> list[str]:
    """The lines for ``sbatch status``: none for a job this machine did not submit or
    that keeps no node-local checkpoints."""
    try:
        record = Registry(home).resolve(slurm_job_id)
    except ClusterkitError:
        return []
    if record.transport != "slurm":
        return []
    found = batch_job_health(record, home)
    return found.lines() if found is not None else []
