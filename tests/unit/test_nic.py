"""doctor predicts NCCL's and gloo's own interface pick (issue 14, Deliver 4): pure rules."""

from __future__ import annotations

from dataclasses import replace

from clusterkit.checks.findings import Status
from clusterkit.checks.netpick import gloo_pick, nccl_pick
from clusterkit.checks.rules_nccl import check_interfaces
from tests.helpers import ADDR, CTX, HOSTS, cluster, node, only_node7

BRIDGE = ("172.18.0.1",)  # docker's user-defined network: the same address on every node


def _ifaces(*names: str) -> dict[str, tuple[str, ...]]:
    table = {"lo": ("127.0.0.1",), "eth0": (ADDR["node7"],), "br-9f3c": BRIDGE,
             "docker0": ("172.17.0.1",), "ib0": ("192.168.50.7",), "ens2": ("10.1.0.7",)}
    return {n: table[n] for n in names}


def test_nccl_order_ib_first_then_all_but_docker_and_lo_in_kernel_order() -> None:
    f = replace(node("node7"), env={}, interfaces=_ifaces("lo", "br-9f3c", "docker0", "eth0"))
    assert nccl_pick(f) == ["br-9f3c", "eth0"]  # bridges are not skipped; docker* and lo are
    assert nccl_pick(replace(f, interfaces=_ifaces("lo", "eth0", "ib0"))) == ["ib0"]
    assert nccl_pick(replace(f, interfaces=_ifaces("lo", "docker0"))) == ["docker0"]
    assert nccl_pick(replace(f, interfaces=_ifaces("lo"))) == ["lo"]
    assert nccl_pick(replace(f, env={"NCCL_SOCKET_IFNAME": "=eth0"},
                             interfaces=_ifaces("lo", "br-9f3c", "eth0"))) == ["eth0"]


def test_gloo_follows_the_hostname_unless_told() -> None:
    f = replace(node("node7"), env={}, interfaces=_ifaces("lo", "br-9f3c", "eth0"))
    assert gloo_pick(f) == ("eth0", ADDR["node7"])
    assert gloo_pick(replace(f, env={"GLOO_SOCKET_IFNAME": "br-9f3c"})) == ("br-9f3c", BRIDGE[0])


def test_bridge_before_eth0_warns_with_the_exact_fix() -> None:
    facts = cluster(env={}, interfaces=_ifaces("lo", "br-9f3c", "eth0"))
    f = only_node7(check_interfaces(facts, CTX), "net.ifname")
    assert f.status is Status.WARN
    assert "NCCL would pick br-9f3c" in f.detail and "br-9f3c, eth0" in f.detail
    assert f.fix == "set NCCL_SOCKET_IFNAME==eth0 and GLOO_SOCKET_IFNAME=eth0 in the inventory env"


def test_bridge_after_eth0_still_warns_the_socket_transport_takes_it() -> None:
    facts = cluster(env={}, interfaces=_ifaces("lo", "eth0", "br-9f3c"))
    f = only_node7(check_interfaces(facts, CTX), "net.ifname")
    assert f.status is Status.WARN and "also use br-9f3c besides eth0" in f.detail


def test_an_unrouted_ib_interface_is_nccls_first_choice() -> None:
    facts = cluster(env={"GLOO_SOCKET_IFNAME": "eth0"}, interfaces=_ifaces("lo", "eth0", "ib0"))
    f = only_node7(check_interfaces(facts, CTX), "net.ifname")
    assert f.status is Status.WARN and "NCCL would pick ib0" in f.detail


def test_docker_and_lo_alone_beside_eth0_pass_without_any_env() -> None:
    facts = {h: replace(node(h), env={}, interfaces={**_ifaces("lo", "docker0"),
                                                      "eth0": (ADDR[h],)}) for h in HOSTS}
    found = [x for x in check_interfaces(facts, CTX) if x.check == "net.ifname"]
    assert {x.status for x in found} == {Status.PASS}
    assert found[0].detail == "NCCL/gloo will use eth0"


def test_gloo_on_another_interface_warns() -> None:
    fwd = {**node("node7").forward, "node7": ("10.1.0.7",)}  # the hostname names ens2's address
    facts = cluster(env={"NCCL_SOCKET_IFNAME": "=eth0"}, forward=fwd,
                    interfaces=_ifaces("lo", "eth0", "ens2"))
    f = only_node7(check_interfaces(facts, CTX), "net.ifname")
    assert f.status is Status.WARN and "gloo would bind 10.1.0.7 (ens2)" in f.detail
    assert f.fix == "set GLOO_SOCKET_IFNAME=eth0 in the inventory env"
