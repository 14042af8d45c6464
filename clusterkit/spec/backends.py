"""The backend registry: one :class:`Backend` per launcher mode (pure data, bottom layer).

Every ``--launcher``/``--backend`` choice and every backend decision in clusterkit is
read from :data:`BACKENDS`; no other module lists backend names. A launch mode says
which plan it runs (``plan_backend``), which rendered command sets it needs, what
``clusterkit sbatch`` submits for it, how its ranks' output lines are marked, what the
pre-launch gate imports on every node, and how ``clusterkit doctor`` judges the nodes
for it. Adding a launcher: one entry here plus its command builder in
:mod:`clusterkit.render.commands` (docs/architecture.md, "Adding a launcher").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    """One launcher mode, as the CLI names it (``--launcher NAME``)."""

    name: str
    help: str
    # The plan this mode runs: its ``LaunchPlan.backend`` (native runs the torchrun plan).
    plan_backend: str
    # Rendered command sets this backend needs (a failure there is fatal, elsewhere noted),
    # in the order of commands.sh; the first is what `clusterkit launch` runs.
    command_sets: tuple[str, ...]
    # `clusterkit sbatch --launcher NAME` submits the batch script of this plan backend.
    sbatch_plan: str
    # The launch line written into sbatch.sh for this plan backend.
    sbatch_line: str
    # Under Slurm: one task per rank (True) or one launcher task per node (False).
    slurm_task_per_rank: bool = False
    # `clusterkit launch` can run it (Slurm modes go through `clusterkit sbatch`).
    launchable: bool = True
    # The node agents start the ranks themselves (no launcher process on the nodes).
    native: bool = False
    # How the agent reads rank labels off the launcher's output lines.
    output_prefix: str = "torchrun"
    # The launcher writes each rank's output to files (--enable_each_rank_log), which the
    # node agents tail; clusterkit launch points them at a fresh directory per run.
    rank_log_files: bool = False
    # Modules the pre-launch gate imports on every node.
    gate_needs: tuple[str, ...] = ("torch",)
    # Doctor semantics: "deepspeed" = DeepSpeed's runner on node 0 reaches the others over
    # pdsh and runs its own interpreter path everywhere; "ssh" = one launcher per node.
    doctor: str = "ssh"
    # The bundled workload's --engine under this backend.
    engine: str = "deepspeed"


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("native", "each node's agent starts its ranks with torchrun's environment "
            "(the torchrun plan, no torchrun process)", plan_backend="torchrun",
            command_sets=("torchrun",), sbatch_plan="slurm", sbatch_line="torchrun",
            native=True, output_prefix="native"),
    Backend("torchrun", "python -m torch.distributed.run on every node", plan_backend="torchrun",
            command_sets=("torchrun",), sbatch_plan="slurm", sbatch_line="torchrun"),
    Backend("deepspeed", "DeepSpeed's runner on the first node, pdsh to the others",
            plan_backend="deepspeed", command_sets=("deepspeed",), sbatch_plan="deepspeed",
            sbatch_line="deepspeed", slurm_task_per_rank=True, output_prefix="pdsh",
            rank_log_files=True,
            gate_needs=("torch", "deepspeed"), doctor="deepspeed"),
    Backend("accelerate", "accelerate launch on every node", plan_backend="accelerate",
            command_sets=("accelerate",), sbatch_plan="accelerate", sbatch_line="accelerate",
            gate_needs=("torch", "accelerate"), engine="accelerate"),
    Backend("slurm", "a Slurm batch script: srun + torchrun (clusterkit sbatch)",
            plan_backend="slurm", command_sets=("sbatch",), sbatch_plan="slurm",
            sbatch_line="torchrun", launchable=False),
)}
DEFAULT_LAUNCHER = "native"
LAUNCHER_NAMES: tuple[str, ...] = tuple(BACKENDS)
# The values a plan's ``backend`` takes (what `render` renders as "chosen").
PLAN_BACKENDS: tuple[str, ...] = tuple(dict.fromkeys(b.plan_backend for b in BACKENDS.values()))
# DeepSpeed's runner's own --launcher values (how it reaches the other nodes).
DS_LAUNCHERS: tuple[str, ...] = ("pdsh", "openmpi", "slurm")


def backend(name: str) -> Backend:
    """The registry entry for a launcher or plan backend name (KeyError: not one)."""
    return BACKENDS[name]


def launchers_help() -> str:
    return "; ".join(f"{b.name}: {b.help}" for b in BACKENDS.values())
