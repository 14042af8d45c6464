"""Launch planning: ``plan_job(inventory, options, facts) -> LaunchPlan`` (pure).

A plan is a value: hosts and ranks, the rendezvous address and port, the job
environment, ds_config, every rendered file and every command line. Printing it
is the dry run; ``clusterkit launch`` executes ``plan.launch_commands``.
The value types live one layer down, in :mod:`clusterkit.spec`.
"""

from __future__ import annotations

from clusterkit.plan.build import plan_job
from clusterkit.spec.backends import PLAN_BACKENDS as BACKENDS
from clusterkit.spec.job import (
    JobOptions,
    LaunchFacts,
    LaunchPlan,
    NodeCommand,
    NodePlan,
    default_job_id,
)
from clusterkit.spec.ports import master_port

__all__ = ["BACKENDS", "JobOptions", "LaunchFacts", "LaunchPlan", "NodeCommand", "NodePlan",
           "default_job_id", "master_port", "plan_job"]
