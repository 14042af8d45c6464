"""Launch planning: ``plan_job(inventory, options, facts) -> JobPlan`` (pure), in
:mod:`clusterkit.plan.build` (import it from there: this package re-exports nothing).

A plan is a value: hosts and ranks, the rendezvous address and port, each node's
environment, storage, the ZeRO spec and ds_config, the programs, the warnings.
``render.artifacts.render_all(plan)`` renders every file and command line from it
(a ``LaunchPlan``); ``clusterkit launch`` executes ``launch_commands`` of that.
The value types live one layer down, in :mod:`clusterkit.spec`.
"""
