"""Moved: the ZeRO spec and the ds_config builder live in :mod:`clusterkit.spec.zero`.

Kept as a name for older imports; new code imports ``clusterkit.spec.zero``.
"""

from __future__ import annotations

from clusterkit.spec.zero import (
    OFFLOAD_CHOICES,
    PRECISION_CHOICES,
    ZERO_STAGES,
    Offload,
    Precision,
    ZeroSpec,
    build_ds_config,
)

__all__ = ["OFFLOAD_CHOICES", "PRECISION_CHOICES", "ZERO_STAGES", "Offload", "Precision",
           "ZeroSpec", "build_ds_config"]
