"""``--launcher slurm``: a Slurm batch script, srun + torchrun (``clusterkit sbatch``).

Renders the srun line to run inside an allocation (``salloc``) and the ``sbatch``
submission; the batch script itself is ``render.sbatch``'s, with torchrun's srun line.
"""

from __future__ import annotations

from clusterkit.launchers import torchrun
from clusterkit.launchers.argv import srun_torchrun_argv
from clusterkit.launchers.base import Backend
from clusterkit.spec.job import JobPlan, NodeCommand, launcher_log_dir


def srun_command(plan: JobPlan, run_id: str | None) -> tuple[NodeCommand, ...]:
    """The srun line to run inside an allocation (``salloc``), from the login node."""
    argv = srun_torchrun_argv(plan, plan.master_addr, str(plan.master_port),
                              launcher_log_dir(plan.job_dir))
    return (NodeCommand(label="srun inside an allocation", host=None, node_rank=None,
                        argv=tuple(argv)),)


def sbatch_command(plan: JobPlan, run_id: str | None) -> tuple[NodeCommand, ...]:
    return (NodeCommand(label="submit the batch script", host=None, node_rank=None,
                        argv=("sbatch", f"{plan.job_dir}/sbatch.sh")),)


BACKEND = Backend(
    "slurm", "a Slurm batch script: srun + torchrun (clusterkit sbatch)", plan_backend="slurm",
    command_sets=("sbatch",), sbatch_plan="slurm",
    builders=(("srun", srun_command), ("sbatch", sbatch_command)),
    sbatch_line=torchrun.sbatch_line, launchable=False)
