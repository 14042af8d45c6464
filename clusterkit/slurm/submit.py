"""What ``clusterkit sbatch`` decides around one submission (docs/sbatch.md).

The verb (``cli/cmd_sbatch.py``) parses and prints; here: the script path made absolute
and checked, the ``--cpus-per-task`` default from ``sinfo``, the replica count of a
node-local job, a site template's ``bash -n``, and the submission itself (a node-local
job submitted again prefers the nodes its checkpoint is on).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from clusterkit import ship
from clusterkit.errors import ClusterkitError, LaunchError, RenderError
from clusterkit.fsutil import atomic_write_text
from clusterkit.hostrange import HostRangeError, expand_list
from clusterkit.inventory import Inventory, replicas_problem
from clusterkit.launchers import BACKENDS
from clusterkit.node.contract import (
    OTHER_WORLD_AS_IS,
    OTHER_WORLD_CONVERT,
    OTHER_WORLD_REFUSE,
    JobDir,
)
from clusterkit.plan.build import plan_job
from clusterkit.render.artifacts import render_all
from clusterkit.render.jobops import job_ops
from clusterkit.render.sbatch import SlurmSite
from clusterkit.slurm.client import SlurmClient
from clusterkit.slurm.steps import unavailable
from clusterkit.spec.job import JobOptions, JobPlan, LaunchFacts, LaunchPlan
from clusterkit.spec.resume import plan_rule

SCRIPT = "sbatch.sh"
NODES_FILE = JobDir.SLURM_NODES  # the node list a node-local job's checkpoint is on (the script writes it)


def absolute_script(options: JobOptions, cwd: str) -> JobOptions:
    """The script as an absolute path, checked here before anything is written or
    submitted: the ranks run in the workdir, where a path relative to the user's cwd
    names nothing (the job failed 12 s after submitting). A path that is not a file
    here is refused; so is one that only exists relative to the workdir elsewhere."""
    script = options.script
    if script is None:
        return options
    path = os.path.normpath(os.path.join(cwd, os.path.expanduser(script)))
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise LaunchError(f"script {script} {what} ({path})", key="SCRIPT", path=path,
                          hint="give the path of your training script, relative to this "
                               "directory or absolute, on the filesystem the nodes share")
    return dataclasses.replace(options, script=path)


def sbatch_plan(inv: Inventory, options: JobOptions, facts: LaunchFacts, site: SlurmSite,
                client: SlurmClient | None) -> tuple[LaunchPlan, int]:
    """The plan with its batch script rendered, and its replica count K. ``client``: ask
    Slurm for the nodes' CPUs when --cpus-per-task is not given (None: do not ask)."""
    # Replicas (issue 31): made by node/slurm/replica.py steps of the batch script, not by
    # launch's agents: the plan has none, the script gets K (SlurmSite.replicas).
    asked = options.replicas if options.replicas is not None else \
        inv.hosts[0].checkpoint.replicas if inv.hosts else None
    if asked is not None and (why := replicas_problem(asked)):
        raise RenderError(why, key="--replicas")
    options = dataclasses.replace(options, replicas=None)
    plan = plan_job(inv, options, facts)  # + doctor's interface pick
    site = dataclasses.replace(site, replicas=replica_count(plan, asked))
    rendered = render_all(plan, site=site, require=(SCRIPT,))  # every refusal before Slurm
    if options.cpus_per_task is None and client is not None:
        cpus = default_cpus(client, plan)
        if cpus is not None:
            plan = dataclasses.replace(plan, options=dataclasses.replace(options,
                                                                         cpus_per_task=cpus))
            rendered = render_all(plan, site=site, require=(SCRIPT,))
    return rendered, site.replicas


def default_cpus(client: SlurmClient, plan: JobPlan) -> int | None:
    """--cpus-per-task default: a node's CPUs (sinfo, the partition's smallest node)
    shared by the Slurm tasks on it; None when Slurm cannot say (documented)."""
    try:
        cpus = client.node_cpus(plan.options.partition)
    except ClusterkitError as exc:
        print(f"clusterkit: warning: no --cpus-per-task default ({exc.one_line()})",
              file=sys.stderr)
        return None
    if cpus is None or cpus <= 0:
        return None
    tasks = plan.nodes[0].nproc if BACKENDS[plan.backend].slurm_task_per_rank else 1
    return max(1, cpus // tasks)


def replica_count(plan: JobPlan, asked: int | None) -> int:
    """K copies of each node's part (node/slurm/replica.py): node-local storage on two
    nodes or more; elsewhere a warning, as for launch, and none."""
    if not asked:
        return 0
    if plan.node_local and len(plan.nodes) > 1:
        return asked
    why = "one node" if plan.node_local else f"{plan.storage} storage"
    print(f"clusterkit: warning: --replicas {asked}: no checkpoint replicas with {why} (they "
          "copy node-local checkpoints to other nodes)", file=sys.stderr)
    return 0


def bash_syntax(script: str, template_dir: str) -> None:
    """A site template must still be a bash script: `bash -n` on the rendered text."""
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True,
                          timeout=30, check=False)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise RenderError(f"the rendered script is not valid bash: {lines[0] if lines else ''}",
                          path=f"{template_dir}/sbatch.sh.j2", key="--template-dir",
                          hint="line numbers refer to the rendered script (--dry-run prints it)")


def submit(client: SlurmClient, plan: JobPlan, path: Path, template_dir: str | None, *,
           replicas: int, remove_on_refusal: bool) -> str:
    """sbatch (after --test-only for a site template); a refused job's directory, made by
    this command, is removed again: nothing is left of a submission that never was."""
    extra = pinned_nodes(client, plan, replicas)
    try:
        if template_dir is not None:
            print(f"clusterkit: sbatch --test-only: {client.test_only(path, extra)}",
                  file=sys.stderr)
        return client.submit(path, extra)
    except ClusterkitError:
        if remove_on_refusal:
            shutil.rmtree(plan.job_dir, ignore_errors=True)
        raise


def write_node_program(plan: JobPlan) -> None:
    """The node programs the batch script runs, job files beside ds_config.json, each
    given to its tasks on stdin: a node-local job's node/slurm/replica.py, and
    node/provision/jitbatch.py when the ranks would JIT-build ops (the build step before them)."""
    if plan.node_local:
        atomic_write_text(Path(plan.job_dir) / JobDir.SLURM_PROGRAM,
                          ship.bundle("slurm.replica").decode("utf-8"))
    if any(job_ops(plan).values()):
        atomic_write_text(Path(plan.job_dir) / JobDir.JITOPS_PROGRAM,
                          ship.bundle("provision.jitbatch").decode("utf-8"))


def pinned_nodes(client: SlurmClient, plan: JobPlan, replicas: int) -> list[str]:
    """A node-local job submitted again goes where its checkpoint is, when it can: with
    replicas, a node of that list that Slurm has down or drained gives way to any free
    node (the batch script moves the parts first); without, the list is pinned."""
    if not plan.node_local:
        return []
    try:
        first = (Path(plan.job_dir) / NODES_FILE).read_text().strip()
    except OSError:
        return []
    if not first:
        return []
    try:
        recorded = expand_list(first)
    except HostRangeError:
        recorded = []
    if recorded and len(recorded) != len(plan.nodes):
        rule = plan_rule(plan, node_local=True)
        return other_count(rule, plan.job_id, first, recorded, len(plan.nodes))
    bad = unavailable(client, recorded) if replicas else {}
    if bad:
        what = ", ".join(f"{n} {state}" for n, (state, _) in bad.items())
        print(f"clusterkit: node-local checkpoints of job {plan.job_id} are on {first}, but "
              f"Slurm has {what}: submitting on any free nodes (replicated: the parts are "
              "moved before the ranks start)", file=sys.stderr)
        return []
    print(f"clusterkit: node-local checkpoints of job {plan.job_id} are on {first}: "
          f"submitting with --nodelist={first}", file=sys.stderr)
    return [f"--nodelist={first}"]


def other_count(rule: dict[str, Any], job_id: str, first: str, recorded: list[str],
                now: int) -> list[str]:
    """A node-local job submitted again on another number of nodes, by its program's
    ``rule`` (spec/resume.resume_rule; empty: the bundled workload, converted): the sbatch
    arguments it goes with, or the refusal the plan step (node/slurm/replica.py) would
    make, said now."""
    world = rule.get("other_world", OTHER_WORLD_CONVERT)
    if world == OTHER_WORLD_REFUSE:
        why, fix = rule.get("other_world_why"), rule.get("other_world_fix")
        raise LaunchError(
            f"job {job_id}'s node-local checkpoints are on {first}, {len(recorded)} nodes, and "
            f"clusterkit sbatch converts no {rule['name']} checkpoint for {now}"
            + (f": {why}" if why else ""), key="--nodes",
            hint=f"submit it on {len(recorded)} nodes, " + (f"or {fix}, " if fix else "")
                 + f"or take its weights: clusterkit collect-ckpt {job_id} --consolidate "
                   "fp32 (docs/programs.md)")
    if world == OTHER_WORLD_AS_IS:
        # Rank 0 saved the snapshot on node index 0 only, and a node's local disk is read
        # only when the node is in the allocation: that node goes with the job.
        print(f"clusterkit: node-local checkpoints of job {job_id} are on {first}, "
              f"{len(recorded)} nodes: submitting on {now} nodes including {recorded[0]} "
              "(rank 0's node, where its snapshot is saved: the batch script puts it on "
              "every node; it loads on any world size as it is)", file=sys.stderr)
        return [f"--nodelist={recorded[0]}"]
    print(f"clusterkit: node-local checkpoints of job {job_id} are on {first}, "
          f"{len(recorded)} nodes: submitting on any {now} free nodes (the batch script "
          "reshards the checkpoint before the ranks start)", file=sys.stderr)
    return []
