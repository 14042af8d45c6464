"""``--launcher deepspeed``: DeepSpeed's runner on the first node, pdsh to the others.

The runner pastes the working directory, interpreter, master address and user
arguments into its pdsh command line without quoting: those values are checked
(:mod:`clusterkit.shellsafe`), never altered.
"""

from __future__ import annotations

import shlex

from clusterkit.launchers.argv import launcher_program, pdsh_ssh_args, srun_rank_argv, uniform
from clusterkit.launchers.base import Backend, DoctorMode
from clusterkit.node.contract import ENV_JOB_ID, JobDir, exits_dir
from clusterkit.shellsafe import bare_word, ds_user_arg
from clusterkit.spec.job import JobPlan, NodeCommand, rank_log_dir

DS_RUNNER = ("-u", "-m", "deepspeed.launcher.runner")


def deepspeed_command(plan: JobPlan, run_id: str | None) -> tuple[NodeCommand, ...]:
    """DeepSpeed's runner on node 0; it starts every node itself (pdsh, openmpi or slurm)."""
    uniform(plan, "the deepspeed launcher")
    node = plan.nodes[0]
    # The runner pastes these into the pdsh command line without quoting.
    for what, value in (("workdir", node.workdir), ("python", node.python),
                        ("master address", plan.master_addr), ("job directory", node.job_dir)):
        bare_word(value, what)
    program = launcher_program(plan.programs[0], "--module")
    for arg in program:
        ds_user_arg(arg)
    # --enable_each_rank_log: each rank's output goes to <dir>/<stamp>_rank<R>.log (and
    # nothing to the console), which the node agents tail and label with node and rank.
    argv = [node.python, *DS_RUNNER, f"--hostfile={JobDir(node.job_dir).path(JobDir.HOSTFILE)}",
            f"--launcher={plan.options.deepspeed_launcher}",
            f"--master_addr={plan.master_addr}", f"--master_port={plan.master_port}",
            # clusterkit doctor checks ssh with the settings pdsh uses; DeepSpeed's own check
            # runs plain `ssh HOST hostname` without them.
            "--no_ssh_check", f"--enable_each_rank_log={rank_log_dir(node.job_dir, run_id)}",
            *program]
    env = {"PATH": node.env["PATH"], "DS_ENV_FILE": JobDir(node.job_dir).path(JobDir.DEEPSPEED_ENV),
           "PDSH_SSH_ARGS_APPEND": pdsh_ssh_args(plan),
           ENV_JOB_ID: plan.job_id}
    return (NodeCommand(label="deepspeed runner on node 0", host=node.name, node_rank=None,
                        argv=tuple(argv), env=env, cwd=node.workdir),)


def sbatch_line(plan: JobPlan, log_dir: str) -> tuple[str, str]:
    """sbatch.sh: one Slurm task per rank, as DeepSpeed's own slurm launcher does; each
    rank gets RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE from Slurm's variables and the
    exported MASTER_ADDR/PORT (argv.SLURM_RANK_RUN), as under every other launcher.
    --open-mode=append: a requeued run adds to the rank logs instead of truncating them."""
    argv = srun_rank_argv(plan, exits_dir(plan.nodes[0].job_dir),
                          [f"--output={log_dir}/%x-%j-rank%t.out", "--open-mode=append"])
    return "srun-per-rank", shlex.join(argv)


BACKEND = Backend(
    "deepspeed", "DeepSpeed's runner on the first node, pdsh to the others",
    plan_backend="deepspeed", command_sets=("deepspeed",), sbatch_plan="deepspeed",
    builders=(("deepspeed", deepspeed_command),), sbatch_line=sbatch_line,
    slurm_task_per_rank=True, output_prefix="pdsh", rank_log_files=True,
    gate_needs=("torch", "deepspeed"), doctor=DoctorMode.FIRST_NODE_PDSH)
