"""Doctor rules: each node's own name and its peers' names, forward and reverse."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.rules_base import (
    ONE_MACHINE_NOTE,
    DoctorContext,
    is_loopback,
    ok_nodes,
    short_name,
)
from clusterkit.hostrange import fold
from clusterkit.node.facts.parity import majority

# Interfaces that never carry inter-node traffic.
VIRTUAL_IFACE_PREFIXES = ("lo", "docker", "virbr", "veth", "br-", "cni", "flannel", "tun", "tap")


# ----------------------------------------------------------------------------- names and network


def _own_ip(f: NodeFacts) -> str | None:
    """The address this node uses toward its peers (what its hostname should resolve to)."""
    routed = [i for a, i in f.routes.items() if i and not is_loopback(a)]
    names = routed + [i for i in f.interfaces if not i.startswith(VIRTUAL_IFACE_PREFIXES)]
    for ifname in names:
        addrs = [a for a in f.interfaces.get(ifname, ()) if not is_loopback(a)]
        if addrs:
            return addrs[0]
    return None


def check_own_name(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in ok_nodes(facts):
        name = f.self_name or f.hostname or f.host
        addrs = f.forward.get(name)
        if (isinstance(addrs, str) or addrs is None) and ctx.one_machine:
            # torch's gloo falls back to loopback when the hostname does not resolve.
            out.append(Finding("names.self", Status.WARN, f.host,
                               f"own hostname {name} does not resolve: {addrs}; gloo falls back "
                               "to loopback, " + ONE_MACHINE_NOTE,
                               f"add `127.0.1.1 {name}` to /etc/hosts"))
        elif isinstance(addrs, str) or addrs is None:
            out.append(Finding("names.self", Status.FAIL, f.host,
                               f"own hostname {name} does not resolve: {addrs}",
                               f"add `<ip> {name}` to /etc/hosts"))
        elif any(is_loopback(a) for a in addrs) and ctx.one_machine:
            lo = next(a for a in addrs if is_loopback(a))
            out.append(Finding("names.self", Status.PASS, f.host,
                               f"own hostname {name} resolves to loopback {lo}: "
                               + ONE_MACHINE_NOTE))
        elif any(is_loopback(a) for a in addrs):
            ip = _own_ip(f) or "<this node's IP>"
            lo = next(a for a in addrs if is_loopback(a))
            out.append(Finding(
                "names.self", Status.FAIL, f.host,
                f"own hostname {name} resolves to loopback {lo}: gloo/NCCL advertise it and "
                f"peers cannot connect",
                f"in /etc/hosts replace `{lo} {name}` with `{ip} {name}`"))
        else:
            out.append(Finding("names.self", Status.PASS, f.host,
                               "own hostname resolves to a non-loopback address"))
    return out


def _peer_names(nodes: Sequence[NodeFacts]) -> list[str]:
    names: list[str] = []
    for f in nodes:
        for n in f.forward:
            if n != f.self_name and n not in names:
                names.append(n)
    return names


def check_peer_names(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    nodes = ok_nodes(facts)
    out: list[Finding] = []
    bad_hosts: set[str] = set()
    for name in _peer_names(nodes):
        answers = {f.host: f.forward[name] for f in nodes if name in f.forward}
        good = {h: a[0] for h, a in answers.items() if not isinstance(a, str) and a}
        for host, ans in answers.items():
            if isinstance(ans, str) or not ans:
                out.append(Finding("names.peer", Status.FAIL, host, f"cannot resolve {name}: {ans}",
                                   f"add {name} to /etc/hosts or DNS on this node"))
                bad_hosts.add(host)
        if not good:
            continue
        common = majority(good, ctx.hosts)
        holders = fold(h for h in ctx.hosts if good.get(h) == common)
        for host, addr in good.items():
            if addr != common:
                out.append(Finding("names.peer", Status.FAIL, host,
                                   f"{name} resolves to {addr} here but {common} on {holders}",
                                   f"make /etc/hosts agree: `{common} {name}`"))
                bad_hosts.add(host)
            elif (is_loopback(addr) and not ctx.one_machine
                  and short_name(name) != short_name(facts[host].self_name or host)):
                out.append(Finding("names.peer", Status.WARN, host,
                                   f"peer name {name} resolves to loopback {addr}: ranks on "
                                   "other nodes cannot reach it under that name",
                                   "use each node's routable name/address in the inventory"))
                bad_hosts.add(host)
        out += _reverse_findings(name, common, nodes, bad_hosts)
    for f in nodes:
        if f.host not in bad_hosts:
            out.append(Finding("names.peer", Status.PASS, f.host,
                               "peer names resolve consistently"))
    return out


def _reverse_findings(name: str, addr: str, nodes: Sequence[NodeFacts],
                      bad_hosts: set[str]) -> list[Finding]:
    out = []
    try:
        ipaddress.ip_address(name)
        return []  # given as an address: nothing to compare
    except ValueError:
        pass
    for f in nodes:
        back = f.reverse.get(addr)
        if back and short_name(back) != short_name(name):
            out.append(Finding("names.reverse", Status.WARN, f.host,
                               f"{addr} ({name}) reverse-resolves to {back}",
                               f"put `{addr} {name}` first for that address in /etc/hosts "
                               "(or fix the PTR record)"))
            bad_hosts.add(f.host)
    return out
