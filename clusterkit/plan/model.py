"""The values a launch plan is made of: they live in :mod:`clusterkit.spec.job`.

Kept as a name for older imports; new code imports ``clusterkit.spec.job``.
"""

from __future__ import annotations

from clusterkit.spec.backends import DS_LAUNCHERS, PLAN_BACKENDS
from clusterkit.spec.job import (
    CD_EXEC,
    RDZV_CHOICES,
    STORAGE_CHOICES,
    WORKLOAD_MODULE,
    JobOptions,
    LaunchFacts,
    LaunchPlan,
    NodeCommand,
    NodePlan,
)

BACKENDS = PLAN_BACKENDS  # the plan backends (spec.backends.BACKENDS holds the registry)

__all__ = ["BACKENDS", "CD_EXEC", "DS_LAUNCHERS", "RDZV_CHOICES", "STORAGE_CHOICES",
           "WORKLOAD_MODULE", "JobOptions", "LaunchFacts", "LaunchPlan", "NodeCommand", "NodePlan"]
