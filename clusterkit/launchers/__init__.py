"""The backend registry: one module per launcher mode, each one ``BACKEND`` record.

Every ``--launcher``/``--backend`` choice and every backend decision in clusterkit is
read from :data:`BACKENDS`; no other module lists backend names. A launcher's module
says which plan it runs, which command sets it needs, what ``clusterkit sbatch``
submits for it, how its ranks' output lines are marked, what the pre-launch gate
imports on every node, how ``clusterkit doctor`` judges the nodes for it, and holds
the code that renders its command lines (and any files of its own). Adding a launcher:
one module here, named in :data:`MODULES` (docs/architecture.md, "Adding a launcher").
"""

from __future__ import annotations

from clusterkit.launchers import accelerate, deepspeed, native, slurm, torchrun
from clusterkit.launchers.base import Backend

# The registry, in the order of every --launcher choice list and of commands.sh.
MODULES = (native, torchrun, deepspeed, accelerate, slurm)
BACKENDS: dict[str, Backend] = {m.BACKEND.name: m.BACKEND for m in MODULES}
DEFAULT_LAUNCHER = native.BACKEND.name

__all__ = ["BACKENDS", "DEFAULT_LAUNCHER", "Backend", "backend", "launcher_name",
           "launchers_help", "plan_backends"]


def backend(name: str) -> Backend:
    """The registry entry for a launcher or plan backend name (KeyError: not one)."""
    return BACKENDS[name]


def plan_backends() -> tuple[str, ...]:
    """The values a plan's ``backend`` takes (what `render` renders as "chosen")."""
    return tuple(dict.fromkeys(b.plan_backend for b in BACKENDS.values()))


def launcher_name(plan_backend: str, native: bool) -> str:
    """The ``--launcher`` a job was started with, from its plan backend and whether the
    agents start the ranks themselves (``native`` runs the torchrun plan)."""
    return next((b.name for b in BACKENDS.values()
                 if b.plan_backend == plan_backend and b.native == native), plan_backend)


def launchers_help() -> str:
    return "; ".join(f"{b.name}: {b.help}" for b in BACKENDS.values())
