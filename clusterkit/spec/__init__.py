"""The job spec: the bottom layer every verb, planner and renderer shares (pure values).

* :mod:`clusterkit.spec.job`: job options (the job flags), launch facts, the plan values
  (``JobPlan``: the decisions; ``LaunchPlan``: the decisions and what was rendered).
* :mod:`clusterkit.spec.zero`: the ZeRO spec, the ds_config builder, the precision rule.
* :mod:`clusterkit.spec.ports`: the rendezvous port rule (job id -> port).
* :mod:`clusterkit.spec.batch`: the batch split when a job resumes on another world size.

Imports only the standard library and the base modules (errors, inventory); the backend
registry sits one layer up, in :mod:`clusterkit.launchers`. docs/architecture.md gives
the whole layer order.
"""
