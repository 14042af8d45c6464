"""The :class:`Backend` record: one launcher mode, with the code that renders it.

Each launcher module of this package defines one ``BACKEND = Backend(...)``;
:mod:`clusterkit.launchers` collects them into the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from clusterkit.spec.job import JobPlan, NodeCommand

# (plan, run id) -> one command set. The run id is the `clusterkit launch` run the
# commands are rendered for (None: a rendered job that a person runs).
CommandBuilder = Callable[[JobPlan, "str | None"], tuple[NodeCommand, ...]]
# (plan, the batch script's log dir) -> (variant name, the srun launch line of sbatch.sh)
SbatchLine = Callable[[JobPlan, str], tuple[str, str]]
# plan -> files this launcher reads from the job dir (name -> text)
FileBuilder = Callable[[JobPlan], dict[str, str]]


class DoctorMode(StrEnum):
    """How ``clusterkit doctor`` judges the nodes for a launcher (:attr:`Backend.doctor`).

    The values are the words doctor's rules have always used ("pdsh", "deepspeed",
    "ssh"); code compares members, never the words."""

    # DeepSpeed's runner on the launching machine reaches the nodes over pdsh (a rendered
    # job run by hand: ``deepspeed --hostfile``); the rules' default.
    HEAD_PDSH = "pdsh"
    # DeepSpeed's runner on the first selected node reaches the others over pdsh and runs
    # its own interpreter path everywhere (``clusterkit launch --launcher deepspeed``).
    FIRST_NODE_PDSH = "deepspeed"
    # One launcher per node, each with its host's own ``python:``.
    PER_NODE = "ssh"

    @property
    def same_python(self) -> bool:
        """The runner starts its own interpreter path on every node, so every node needs
        that very path (doctor FAILs a node whose path differs; per node: a WARN)."""
        return self is not DoctorMode.PER_NODE

    @property
    def runner_on_head(self) -> bool:
        return self is DoctorMode.HEAD_PDSH

    @property
    def runner_on_first_node(self) -> bool:
        return self is DoctorMode.FIRST_NODE_PDSH


@dataclass(frozen=True)
class Backend:
    """One launcher mode, as the CLI names it (``--launcher NAME``)."""

    name: str
    help: str
    # The plan this mode runs: its ``JobPlan.backend`` (native runs the torchrun plan).
    plan_backend: str
    # Rendered command sets this backend needs (a failure there is fatal, elsewhere noted),
    # in the order of commands.sh; the first is what `clusterkit launch` runs.
    command_sets: tuple[str, ...]
    # `clusterkit sbatch --launcher NAME` submits the batch script of this plan backend.
    sbatch_plan: str
    # The command sets this module renders for every job (commands.sh lists them all),
    # in registry order; a set named in some ``command_sets`` must be built by one entry.
    builders: tuple[tuple[str, CommandBuilder], ...] = ()
    # The launch line written into sbatch.sh when this is the plan backend.
    sbatch_line: SbatchLine | None = None
    # Files this launcher reads from the job dir, rendered for every job.
    files: FileBuilder | None = None
    # Under Slurm: one task per rank (True) or one launcher task per node (False).
    slurm_task_per_rank: bool = False
    # `clusterkit launch` can run it (Slurm modes go through `clusterkit sbatch`).
    launchable: bool = True
    # The node agents start the ranks themselves (no launcher process on the nodes).
    native: bool = False
    # How the agent reads rank labels off the launcher's output lines.
    output_prefix: str = "torchrun"
    # The launcher writes each rank's output to files (spec.job.rank_log_dir), which the
    # node agents tail; render_all puts them in a fresh directory per launch run.
    rank_log_files: bool = False
    # Modules the pre-launch gate imports on every node.
    gate_needs: tuple[str, ...] = ("torch",)
    # How doctor judges the nodes for it (checks/doctor_plan.py puts it into the rules'
    # context; checks/rules_toolchain.py and rules_parity.py read it).
    doctor: DoctorMode = DoctorMode.PER_NODE

    @property
    def same_python(self) -> bool:
        """The launcher starts its own interpreter path on every node (DeepSpeed's runner
        over pdsh), so every node needs that very path: the gate refuses a node whose
        path differs and doctor FAILs it. One launcher per node runs each host's own
        ``python:``; there only the versions must agree (doctor WARNs on paths)."""
        return self.doctor.same_python
    # The bundled workload's --engine under this backend.
    engine: str = "deepspeed"
