"""Doctor rules: the interface NCCL/gloo will use, NCCL_* settings, RDMA ports.

What NCCL and gloo would pick on their own (the prediction) lives with the
interface picker, checks/netpick.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.infiniband import parse_nccl_ib_hca, unmatched_hca_entries
from clusterkit.checks.netpick import (
    gloo_prediction,
    ifname_selected,
    nccl_prediction,
    route_ifaces,
)
from clusterkit.checks.rules_base import (
    DoctorContext,
    ok_nodes,
)
from clusterkit.hostrange import fold


def _iface_env_findings(f: NodeFacts, iface: str) -> list[Finding]:
    out = []
    nccl = f.env.get("NCCL_SOCKET_IFNAME")
    gloo = f.env.get("GLOO_SOCKET_IFNAME")
    if nccl is not None and not ifname_selected(nccl, iface):
        out.append(Finding("net.ifname", Status.FAIL, f.host,
                           f"NCCL_SOCKET_IFNAME={nccl} does not select {iface}, the interface "
                           "that reaches the peers", f"NCCL_SOCKET_IFNAME=={iface}"))
    if gloo is not None and iface not in gloo.split(","):
        out.append(Finding("net.ifname", Status.FAIL, f.host,
                           f"GLOO_SOCKET_IFNAME={gloo} is not {iface}",
                           f"GLOO_SOCKET_IFNAME={iface}"))
    out += nccl_prediction(f, iface) + gloo_prediction(f, iface)
    if not out:
        out.append(Finding("net.ifname", Status.PASS, f.host,
                           f"NCCL/gloo will use {iface}"))
    return out


def check_interfaces(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out: list[Finding] = []
    chosen: dict[str, str] = {}
    for f in ok_nodes(facts):
        routes = route_ifaces(f)
        ifaces = sorted({i or "?" for i in routes.values()})
        if not routes:
            continue
        if len(ifaces) > 1:
            out.append(Finding("net.iface", Status.WARN, f.host,
                               f"peers are reached through different interfaces: "
                               f"{', '.join(ifaces)}",
                               "NCCL/gloo use one interface for all peers: fix routes or pick "
                               "one subnet for every node's address"))
            continue
        chosen[f.host] = ifaces[0]
        out.append(Finding("net.iface", Status.PASS, f.host, f"{ifaces[0]} reaches all peers"))
        out += _iface_env_findings(f, ifaces[0])
    if len(set(chosen.values())) > 1:
        by_iface = {i: fold(h for h in ctx.hosts if chosen.get(h) == i)
                    for i in sorted(set(chosen.values()))}
        listing = "; ".join(f"{i} on {hosts}" for i, hosts in by_iface.items())
        out.append(Finding("net.iface-names", Status.WARN, "",
                           f"interface names differ across nodes: {listing}",
                           f"NCCL_SOCKET_IFNAME=={','.join(by_iface)} (exact list) and a "
                           "per-node GLOO_SOCKET_IFNAME"))
    return out


def check_nccl_env(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in ok_nodes(facts):
        out += _nccl_env_findings(f) or [Finding("nccl.env", Status.PASS, f.host,
                                                 "NCCL_* settings consistent with the node")]
        out += _ib_port_findings(f)
    return out


def _nccl_env_findings(f: NodeFacts) -> list[Finding]:
    out = []
    active = [p for p in f.ib_ports if p.active]
    if f.env.get("NCCL_IB_DISABLE", "0") not in ("0", "") and active:
        out.append(Finding("nccl.ib-disable", Status.WARN, f.host,
                           f"NCCL_IB_DISABLE={f.env['NCCL_IB_DISABLE']} while "
                           f"{len(active)} RDMA port(s) are ACTIVE: NCCL uses TCP sockets",
                           "unset NCCL_IB_DISABLE unless RDMA is known broken"))
    if f.env.get("NCCL_P2P_DISABLE", "0") not in ("0", ""):
        out.append(Finding("nccl.p2p-disable", Status.WARN, f.host,
                           f"NCCL_P2P_DISABLE={f.env['NCCL_P2P_DISABLE']}: intra-node "
                           "traffic goes through host memory",
                           "unset NCCL_P2P_DISABLE (only needed for broken P2P; check "
                           "`nvidia-smi topo -p2p r`)"))
    hca = f.env.get("NCCL_IB_HCA")
    if hca:
        spec = parse_nccl_ib_hca(hca)
        missing = [] if spec.exclude else unmatched_hca_entries(spec, f.ib_ports)
        if missing:
            have = ", ".join(p.name for p in f.ib_ports) or "none"
            out.append(Finding("nccl.ib-hca", Status.FAIL, f.host,
                               f"NCCL_IB_HCA={hca} names {', '.join(missing)}, which do not "
                               f"exist (ports: {have})",
                               "list existing devices, e.g. "
                               f"NCCL_IB_HCA=={','.join(p.name for p in active) or 'mlx5_0:1'}"))
    return out


def _ib_port_findings(f: NodeFacts) -> list[Finding]:
    if not f.ib_ports:
        return []
    active = [p for p in f.ib_ports if p.active]
    down = [p for p in f.ib_ports if not p.active]
    out = []
    if not active:
        return [Finding("rdma.ports", Status.WARN, f.host,
                        f"{len(f.ib_ports)} RDMA port(s), none ACTIVE: NCCL falls back to TCP",
                        "check cables/switch and the subnet manager (`ibstat`, opensm) or "
                        "RoCE config")]
    kinds = Counter("RoCE" if p.is_roce else "IB" for p in active)
    out.append(Finding("rdma.ports", Status.PASS, f.host, f"{len(active)} RDMA port(s) ACTIVE ("
                       + ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) + ")"))
    if down:
        names = ", ".join(f"{p.name} {p.state}" + (f"/{p.phys_state}" if p.phys_state else "")
                          for p in down)
        out.append(Finding("rdma.down", Status.WARN, f.host, f"RDMA port(s) not ACTIVE: {names}",
                           "fix the link if it should carry traffic, else exclude it with "
                           "NCCL_IB_HCA"))
    return out
