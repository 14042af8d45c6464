"""``--launcher native`` (the default): the node agents start the ranks themselves.

It runs the torchrun plan (same rendezvous, same rank -> node mapping) without a
torchrun process: ``launch.fromplan`` turns each node's torchrun command into the
ranks with torchrun's environment. Nothing of its own to render.
"""

from __future__ import annotations

from clusterkit.launchers.base import Backend

BACKEND = Backend(
    "native", "each node's agent starts its ranks with torchrun's environment "
    "(the torchrun plan, no torchrun process)", plan_backend="torchrun",
    command_sets=("torchrun",), sbatch_plan="slurm", native=True, output_prefix="native")
