"""A :class:`~clusterkit.spec.job.LaunchPlan` turned into what the agents run (pure).

torchrun and ``accelerate launch`` run one command per node; DeepSpeed's runner
runs on the first node only and starts the others through pdsh — those nodes
still get an agent that only watches, so a teardown stays job-scoped on every
node (it kills by ``CLUSTERKIT_JOB_ID``, never by command line).
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from clusterkit.errors import LaunchError
from clusterkit.launch.gate import node_needs, script_is_here
from clusterkit.launch.jobspec import JobSpec, NodeTask
from clusterkit.launchers import BACKENDS
from clusterkit.node.ckpt.ready import prep_doc
from clusterkit.node.contract import JobDir, StorageKind
from clusterkit.node.protocol import DEFAULT_GRACE_S
from clusterkit.remote.base import target_for as target_for  # the one host -> target function
from clusterkit.spec.job import JobPlan, LaunchPlan, NodeCommand, NodePlan, RunOptions
from clusterkit.spec.resume import latest_rules


def _native_task(plan: LaunchPlan, node: NodePlan, cmd: NodeCommand) -> NodeTask:
    """The node's ranks started by the agent itself, with torchrun's environment.

    Saves torchrun's own ``import torch`` on every node (seconds under load); the
    rendezvous is the static one torchrun would do (same master address and port,
    ranks ``first_rank..`` on this node), so the rank->node mapping is unchanged.
    """
    program = plan.programs[node.node_rank]
    native = {"nproc": node.nproc, "first_rank": node.first_rank, "world_size": plan.world_size,
              "node_rank": node.node_rank, "nnodes": len(plan.nodes),
              "master_addr": plan.master_addr, "master_port": plan.master_port}
    return NodeTask(node=node.name, target=target_for(node.host), python=node.python,
                    argv=(node.python, "-u", *program), rank_offset=node.first_rank,
                    nprocs=node.nproc, env=dict(cmd.env), files=dict(plan.artifacts),
                    cwd=cmd.cwd, prefix="native", job_dir=node.job_dir, native=native,
                    needs=node_needs(plan, node))


def replica_spec(plan: LaunchPlan, index: int, secret: str,
                 ending: frozenset[int] | None = None) -> dict[str, Any] | None:
    """``AgentSpec.replica`` of node ``index`` (node/replicas/service.py's REPLICA_KEYS):
    None when the plan has it neither send nor hold copies. ``secret`` is the run's
    (on the agent's stdin only: never argv, env, plan.json or a log). ``ending``: the
    nodes whose agents see their ranks end and so say BYE (None: all); a watch-only
    agent (a pdsh peer) is closed only after the others ended, so no one waits for it."""
    targets = plan.replica_targets[index] if plan.replica_targets else ()
    if not targets and not plan.replica_sources(index):
        return None
    sources = tuple(i for i in plan.replica_sources(index) if ending is None or i in ending)
    node = plan.nodes[index]
    return {"index": index, "address": node.host.address, "ckpt_dir": node.ckpt_dir,
            "ranks": list(node.ranks), "markers": plan.options.uses_workload,
            "targets": [{"node": plan.nodes[j].name, "index": j,
                         "address": plan.nodes[j].host.address} for j in targets],
            "sources": list(sources), "secret": secret}


def checkpoint_prep(plan: JobPlan, node: NodePlan) -> str:
    """What ``node``'s agent does to its checkpoint dir before the ranks start
    (node/ckpt/ready.ready_checkpoints): create it; on a restart or relaunch, move the
    tags that cannot be assembled aside, point DeepSpeed's ``latest`` at the resume tag
    (a program that picks its tag by ``latest``), and write the ``latest`` that DeepSpeed
    leaves on global rank 0's node only inside each tag dir (HF's checkpoint-N/)."""
    top, nested = latest_rules(plan.profile, node_local=plan.storage == StorageKind.NODE_LOCAL)
    return prep_doc(node.ckpt_dir, aside=plan.set_aside,
                    latest=plan.resume_from if top else None, nested_latest=nested)


def job_from_plan(plan: LaunchPlan, *, attempt: int = 0, native: bool = False,
                  run: RunOptions | None = None, gate_need: tuple[str, ...] | None = None,
                  hang_timeout_s: float = 0.0, replica_secret: str | None = None) -> JobSpec:
    """The plan's commands as they are rendered (``render_all(plan, run_id=...)`` names
    the run's per-rank log dir, ``plan.rank_log_dir``, which the agents tail).
    ``native``: with the torchrun backend, the agents start the ranks themselves
    instead of running torchrun. ``run``: launch's runtime options (None: the
    agents' own defaults, no dead-man switch); ``gate_need``/``hang_timeout_s``: as
    :class:`JobSpec`. ``replica_secret``: the checkpoint replicas' per-run secret (None:
    a fresh ``secrets.token_hex(32)``, once per call, i.e. per run)."""
    if native and not any(b.native and b.plan_backend == plan.backend for b in BACKENDS.values()):
        raise LaunchError(f"native launch replaces torchrun, not {plan.backend}",
                          key="--launcher")
    if not BACKENDS[plan.backend].launchable:
        raise LaunchError(f"clusterkit launch does not run the {plan.backend!r} backend",
                          key="--launcher", hint="use `clusterkit sbatch` for Slurm")
    by_host: dict[str | None, NodeCommand] = {c.host: c for c in plan.launch_commands}
    files = plan.job_files
    secret = replica_secret or secrets.token_hex(32)
    ending = frozenset(n.node_rank for n in plan.nodes if n.name in by_host)
    tasks = []
    for node in plan.nodes:
        cmd = by_host.get(node.name)
        replica = replica_spec(plan, node.node_rank, secret, ending)
        own = {**files, JobDir.ckpt_prep(node.name): checkpoint_prep(plan, node)}
        if native and cmd is not None:
            tasks.append(replace(_native_task(plan, node, cmd), replica=replica, files=own))
            continue
        # No command: a pdsh peer whose ranks DeepSpeed's runner starts; its agent watches.
        argv, env, cwd = ((), {}, None) if cmd is None else \
            (cmd.argv, dict(cmd.env), cmd.cwd)
        tasks.append(NodeTask(
            node=node.name, target=target_for(node.host), python=node.python, argv=argv,
            rank_offset=node.first_rank, nprocs=node.nproc, env=env, files=own, cwd=cwd,
            prefix=BACKENDS[plan.backend].output_prefix, job_dir=node.job_dir,
            rank_log_dir=plan.rank_log_dir, needs=node_needs(plan, node), replica=replica,
        ))
    if not any(t.argv for t in tasks):
        raise LaunchError("the plan has no command for any selected node", key="--launcher")
    return JobSpec(job_id=plan.job_id, tasks=tuple(tasks), attempt=attempt,
                   grace_s=run.grace_s if run else DEFAULT_GRACE_S,
                   keepalive_s=run.keepalive_s if run else 0.0, gate_need=gate_need,
                   gate_same_python=BACKENDS[plan.backend].same_python,
                   gate_script_here=script_is_here(plan),
                   hang_timeout_s=hang_timeout_s)
