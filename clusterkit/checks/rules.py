"""Doctor rules: the one registry (``ALL_RULES``, in report order) and ``run_rules``.

Each section's rules live in their own module (``rules_ssh``, ``rules_parity``,
``rules_toolchain``, ``rules_gpu``, ``rules_host``, ``rules_names``, ``rules_nccl``;
the context and shared helpers in ``rules_base``; NCCL/gloo's interface prediction
with the interface picker, ``checks/netpick.py``). A new rule is written in its
section's module and named here; callers import a rule, a constant or the context
(``rules_base.DoctorContext``) from the module that defines it (no re-exports here).
Pure: node facts in, findings out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding
from clusterkit.checks.rules_base import (
    DoctorContext,
    Rule,
)
from clusterkit.checks.rules_env import check_jit_locks
from clusterkit.checks.rules_gpu import (
    check_gpus,
    check_topology,
)
from clusterkit.checks.rules_host import (
    check_clock,
    check_limits,
    check_storage,
)
from clusterkit.checks.rules_names import (
    check_own_name,
    check_peer_names,
)
from clusterkit.checks.rules_nccl import (
    check_interfaces,
    check_nccl_env,
)
from clusterkit.checks.rules_parity import (
    check_freeze,
    check_interpreter,
    check_versions,
    check_workdir,
)
from clusterkit.checks.rules_ssh import (
    check_probe,
)
from clusterkit.checks.rules_toolchain import (
    check_cuda,
    check_ninja,
    check_pdsh,
)

__all__ = ["ALL_RULES", "run_rules"]

ALL_RULES: tuple[Rule, ...] = (
    check_probe, check_interpreter, check_versions, check_freeze, check_workdir,
    check_ninja, check_jit_locks, check_cuda, check_pdsh, check_gpus, check_topology, check_storage,
    check_limits, check_clock, check_own_name, check_peer_names, check_interfaces,
    check_nccl_env,
)


def run_rules(facts: Mapping[str, NodeFacts], ctx: DoctorContext,
              rules: Sequence[Rule] = ALL_RULES) -> list[Finding]:
    out: list[Finding] = []
    for rule in rules:
        out += rule(facts, ctx)
    return out
