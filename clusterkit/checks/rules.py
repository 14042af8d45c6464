"""Doctor rules: the one registry (``ALL_RULES``, in report order) and ``run_rules``.

Each section's rules live in their own module (``rules_ssh``, ``rules_parity``,
``rules_toolchain``, ``rules_gpu``, ``rules_host``, ``rules_names``, ``rules_nccl``;
the context and shared helpers in ``rules_base``; NCCL/gloo's interface prediction
with the interface picker, ``checks/netpick.py``). A new rule is written in its
section's module and named here. The names below are re-exported, so callers
import every rule from here. Pure: node facts in, findings out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding
from clusterkit.checks.netpick import (
    NCCL_AUTO_SEARCH,
    gloo_pick,
    ifname_selected,
    nccl_pick,
    peer_iface,
)
from clusterkit.checks.rules_base import (
    ONE_MACHINE_NOTE,
    DoctorContext,
    GiB,
    Rule,
    one_machine,
    parity,
)
from clusterkit.checks.rules_env import check_jit_locks
from clusterkit.checks.rules_gpu import (
    check_gpus,
    check_topology,
)
from clusterkit.checks.rules_host import (
    NOFILE_MIN,
    SHM_MIN_BYTES,
    SKEW_FAIL_S,
    SKEW_WARN_S,
    STORAGE_MIN_FREE_BYTES,
    check_clock,
    check_limits,
    check_storage,
)
from clusterkit.checks.rules_names import (
    VIRTUAL_IFACE_PREFIXES,
    check_own_name,
    check_peer_names,
)
from clusterkit.checks.rules_nccl import (
    check_interfaces,
    check_nccl_env,
)
from clusterkit.checks.rules_parity import (
    SAME_PYTHON_BACKENDS,
    check_freeze,
    check_interpreter,
    check_versions,
    check_workdir,
)
from clusterkit.checks.rules_ssh import (
    check_master_port,
    check_probe,
)
from clusterkit.checks.rules_toolchain import (
    check_cuda,
    check_ninja,
    check_pdsh,
)

__all__ = [
    "ALL_RULES",
    "NCCL_AUTO_SEARCH",
    "NOFILE_MIN",
    "ONE_MACHINE_NOTE",
    "SAME_PYTHON_BACKENDS",
    "SHM_MIN_BYTES",
    "SKEW_FAIL_S",
    "SKEW_WARN_S",
    "STORAGE_MIN_FREE_BYTES",
    "VIRTUAL_IFACE_PREFIXES",
    "DoctorContext",
    "GiB",
    "Rule",
    "check_clock",
    "check_cuda",
    "check_freeze",
    "check_gpus",
    "check_interfaces",
    "check_interpreter",
    "check_jit_locks",
    "check_limits",
    "check_master_port",
    "check_nccl_env",
    "check_ninja",
    "check_own_name",
    "check_pdsh",
    "check_peer_names",
    "check_probe",
    "check_storage",
    "check_topology",
    "check_versions",
    "check_workdir",
    "gloo_pick",
    "ifname_selected",
    "nccl_pick",
    "one_machine",
    "parity",
    "peer_iface",
    "run_rules",
]

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
