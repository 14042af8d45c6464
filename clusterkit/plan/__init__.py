"""Launch planning: ``plan_job(inventory, options, facts) -> JobPlan`` (pure).

A plan is a value: hosts and ranks, the rendezvous address and port, each node's
environment, storage, the ZeRO spec and ds_config, the programs, the warnings.
``render.artifacts.render_all(plan)`` renders every file and command line from it
(a ``LaunchPlan``); ``clusterkit launch`` executes ``launch_commands`` of that.
The value types live one layer down, in :mod:`clusterkit.spec`.
"""

from __future__ import annotations

from clusterkit.plan.build import plan_job

__all__ = ["plan_job"]
