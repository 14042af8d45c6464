"""Launch planning: ``plan_job(inventory, options, facts) -> LaunchPlan`` (pure).

A plan is a value: hosts and ranks, the rendezvous address and port, the job
environment, ds_config, every rendered file and every command line. Printing it
is the dry run; ``clusterkit launch`` executes ``plan.launch_commands``.
"""

from clusterkit.plan.build import default_job_id, plan_job
from clusterkit.plan.model import (
    BACKENDS,
    JobOptions,
    LaunchFacts,
    LaunchPlan,
    NodeCommand,
    NodePlan,
)
from clusterkit.plan.ports import master_port

__all__ = ["BACKENDS", "JobOptions", "LaunchFacts", "LaunchPlan", "NodeCommand", "NodePlan",
           "default_job_id", "master_port", "plan_job"]
