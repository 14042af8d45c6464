"""Launch planning: ``plan_job(inventory, options, facts) -> LaunchPlan`` (pure).

A plan is a value: hosts and ranks, the rendezvous address and port, the job
environment, ds_config, every rendered file and every command line. Printing it
is the dry run; ``clusterkit launch`` executes ``plan.launch_commands``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clusterkit.plan.model import (
    BACKENDS,
    JobOptions,
    LaunchFacts,
    LaunchPlan,
    NodeCommand,
    NodePlan,
)
from clusterkit.plan.ports import master_port

if TYPE_CHECKING:
    from clusterkit.plan.build import default_job_id, plan_job

__all__ = ["BACKENDS", "JobOptions", "LaunchFacts", "LaunchPlan", "NodeCommand", "NodePlan",
           "default_job_id", "master_port", "plan_job"]


def __getattr__(name: str) -> Any:
    # plan.build imports the renderers, which import plan.model: loading build lazily
    # lets `import clusterkit.render.x` and `import clusterkit.plan` work in either order.
    if name in ("plan_job", "default_job_id"):
        from clusterkit.plan import build

        return getattr(build, name)
    raise AttributeError(f"module 'clusterkit.plan' has no attribute {name!r}")
