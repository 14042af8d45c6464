"""A :class:`~clusterkit.plan.model.LaunchPlan` turned into what the agents run (pure).

torchrun and ``accelerate launch`` run one command per node; DeepSpeed's runner
runs on the first node only and starts the others through pdsh — those nodes
still get an agent that only watches, so a teardown stays job-scoped on every
node (it kills by ``CLUSTERKIT_JOB_ID``, never by command line).
"""

from __future__ import annotations

from clusterkit.errors import LaunchError
from clusterkit.inventory import Host
from clusterkit.launch.orchestrator import JobSpec, NodeTask
from clusterkit.plan.model import LaunchPlan, NodeCommand
from clusterkit.remote.base import SSHTarget

LAUNCH_BACKENDS = ("torchrun", "deepspeed", "accelerate")
# How each launcher marks its ranks' lines (see agent.Spec.prefix).
OUTPUT_PREFIX = {"torchrun": "torchrun", "deepspeed": "pdsh", "accelerate": "torchrun"}


def target_for(host: Host) -> SSHTarget:
    return SSHTarget(
        name=host.name, address=host.address, user=host.ssh.user, port=host.ssh.port,
        identity_file=host.ssh.identity_file, proxy_jump=host.ssh.proxy_jump,
        config_file=host.ssh.config_file, known_hosts_file=host.ssh.known_hosts_file,
        local=host.transport == "local",
    )


def _launcher_argv(backend: str, cmd: NodeCommand) -> tuple[str, ...]:
    argv = list(cmd.argv)
    if backend == "deepspeed":
        # With --enable_each_rank_log DeepSpeed sends every rank's output to files
        # only; the agent already writes per-rank logs and must see the lines to
        # stream them and to find the CLUSTERKIT_SUMMARY.
        argv = [a for a in argv if not a.startswith("--enable_each_rank_log")]
    return tuple(argv)


def job_from_plan(plan: LaunchPlan, *, attempt: int = 0, grace_s: float = 3.0) -> JobSpec:
    if plan.backend not in LAUNCH_BACKENDS:
        raise LaunchError(f"clusterkit launch does not run the {plan.backend!r} backend",
                          key="--launcher", hint="use `clusterkit sbatch` for Slurm")
    by_host: dict[str | None, NodeCommand] = {c.host: c for c in plan.launch_commands}
    files = dict(plan.artifacts)
    tasks = []
    for node in plan.nodes:
        cmd = by_host.get(node.name)
        # No command: a pdsh peer whose ranks DeepSpeed's runner starts; its agent watches.
        argv, env, cwd = ((), {}, None) if cmd is None else \
            (_launcher_argv(plan.backend, cmd), dict(cmd.env), cmd.cwd)
        tasks.append(NodeTask(
            node=node.name, target=target_for(node.host), python=node.python, argv=argv,
            rank_offset=node.first_rank, nprocs=node.nproc, env=env, files=files, cwd=cwd,
            prefix=OUTPUT_PREFIX[plan.backend], job_dir=node.job_dir,
        ))
    if not any(t.argv for t in tasks):
        raise LaunchError("the plan has no command for any selected node", key="--launcher")
    return JobSpec(job_id=plan.job_id, tasks=tuple(tasks), attempt=attempt, grace_s=grace_s)
