"""What every doctor rule shares: the context, the rule signature, the parity helper.

Every rule has the signature ``(facts, ctx) -> list[Finding]`` where ``facts``
maps inventory host name -> :class:`NodeFacts` (in inventory order) and ``ctx``
is the :class:`DoctorContext` (what the inventory and the launching machine
say). Rules report one finding per host (and subject) so the report can fold
identical results into host ranges; parity rules name the majority value and
the hosts that hold it (node/facts/parity.py's rule, the launch gate's too). Nodes whose
probe failed are skipped by every rule but ``rules_ssh.check_probe``, which reports
them once. Pure: no I/O, no clock, no environment.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.hostrange import fold
from clusterkit.launchers.base import DoctorMode
from clusterkit.node.facts.parity import holders as holders_of
from clusterkit.node.facts.parity import majority

GiB = 1024**3


@dataclass(frozen=True)
class DoctorContext:
    """What the checks compare facts against (from the inventory and the launching machine)."""

    hosts: tuple[str, ...]  # inventory order = rank order
    slots: Mapping[str, int] = field(default_factory=dict)
    gpus: Mapping[str, int] = field(default_factory=dict)  # GPUs the inventory declares
    # How doctor judges the nodes for the launcher (the registry's Backend.doctor); a word
    # ("pdsh", "deepspeed", "ssh") is taken as its DoctorMode.
    backend: DoctorMode = DoctorMode.HEAD_PDSH
    head_tools: Mapping[str, str | None] = field(default_factory=dict)  # which() on the head
    head_python: str | None = None  # sys.executable of the launcher (pdsh reuses it)
    checkpoint_bytes: int | None = None  # estimated size of one checkpoint on a node
    # Checkpoint replicas (issue 22): a node-local dir (host -> checkpoint.local_dir) also
    # holds copies of `replicas` other nodes' checkpoints, each about checkpoint_bytes.
    replicas: int = 0
    local_dirs: Mapping[str, str] = field(default_factory=dict)
    # The job's storage when doctor is told (--storage): node-local makes a local_dir that
    # several nodes share a FAIL (rules_storage), shared skips that check; None: WARN.
    storage: str | None = None
    # Local clock (time.time()) just before sending / after receiving each node's probe.
    probe_windows: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # Every node is this machine (the embedded default's virtual nodes, or loopback
    # addresses): the ranks talk over loopback, so how names resolve for *other*
    # machines cannot matter and those checks only inform (see one_machine()).
    one_machine: bool = False
    # The inventory's spares among ``hosts`` (not selected; checked because launch
    # --replace runs a lost node's ranks there: a spare that fails is no spare).
    spares: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", DoctorMode(self.backend))


Rule = Callable[[Mapping[str, NodeFacts], DoctorContext], list[Finding]]
T = TypeVar("T", bound=Hashable)


# ----------------------------------------------------------------------------- helpers


def ok_nodes(facts: Mapping[str, NodeFacts]) -> list[NodeFacts]:
    return [f for f in facts.values() if f.ok]


def show(value: object) -> str:
    return "not installed" if value is None else str(value)


def parity(check: str, label: str, values: Mapping[str, T], ctx: DoctorContext,
           bad: Status, fix: Callable[[str, T], str]) -> list[Finding]:
    """One finding per host: PASS for the majority value, ``bad`` for the odd ones."""
    if not values:
        return []
    common = majority(values, ctx.hosts)  # the gate's rule too (node/facts/parity.py)
    holders = fold(holders_of(values, common, ctx.hosts))
    out = []
    for host, value in values.items():
        if value == common:
            out.append(Finding(check, Status.PASS, host, f"{label} {show(value)}"))
        else:
            out.append(Finding(check, bad, host,
                               f"{label} {show(value)} ≠ {show(common)} on {holders}",
                               fix(host, common)))
    return out


def python_of(facts: Mapping[str, NodeFacts], host: str) -> str:
    return facts[host].python_executable or "python"


@functools.lru_cache(maxsize=4096)
def is_loopback(addr: str) -> bool:
    # Asked for every (node, peer) pair: 32k times at 128 nodes, ~0.7 s of ipaddress
    # parsing uncached; the distinct addresses are only the peers'.
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def one_machine(transports_and_addresses: Iterable[tuple[str, str]]) -> bool:
    """True when every node is this machine: ``local`` transport or a loopback address."""
    nodes = list(transports_and_addresses)
    return bool(nodes) and all(t == "local" or is_loopback(a) or a == "localhost"
                               for t, a in nodes)


ONE_MACHINE_NOTE = "fine here: every node is this machine (a FAIL on an inventory of several machines)"


def short_name(name: str) -> str:
    return name.split(".", 1)[0].lower()


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"
