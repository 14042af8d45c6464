"""doctor on test-bed nodes that carry docker's kind of bridge (issue 14, Deliver 4).

Every node gets ``br-9f3c`` with the same address (172.18.0.1/16), as docker's
user-defined networks do. The bridge has no ports: nothing leaves the test bed.
NCCL without NCCL_SOCKET_IFNAME does not skip ``br-*``, so doctor must say so and
name the fix instead of "NCCL/gloo will use eth0".
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterkit.checks.netpick import saved_picks
from clusterkit.cli.main import main
from clusterkit.inventory import load_inventory
from clusterkit.plan.ifaces import apply_picks
from tests.testbed import Testbed, TestNode

pytestmark = pytest.mark.testbed
BRIDGE, BRIDGE_ADDR = "br-9f3c", "172.18.0.1/16"


def _doctor_json(inventory: Path) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["doctor", "--json", "--connect-timeout", "5", "-i", str(inventory)])
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def _ifname(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in report["findings"]:
        if f["check"] == "net.ifname":
            out.setdefault(f["host"], []).append(f)
    return out


@contextlib.contextmanager
def _bridges(tb: Testbed, nodes: list[TestNode]) -> Iterator[None]:
    added: list[TestNode] = []
    try:
        for n in nodes:
            for argv in (["ip", "link", "add", BRIDGE, "type", "bridge"],
                         ["ip", "addr", "add", BRIDGE_ADDR, "dev", BRIDGE],
                         ["ip", "link", "set", BRIDGE, "up"]):
                tb.exec(n, argv, timeout=20, check=True)
                if argv[2] == "add" and argv[1] == "link":
                    added.append(n)
        yield
    finally:
        for n in added:
            tb.exec(n, ["ip", "link", "del", BRIDGE], timeout=20)


@pytest.mark.testbed(nodes=2)
def test_bridge_with_the_same_address_everywhere_warns(
        testbed: Testbed, testbed_nodes: list[TestNode], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(key, raising=False)
    inv = testbed.write_inventory(tmp_path / "inventory.yaml", testbed_nodes)
    before = _ifname(_doctor_json(inv))
    for n in testbed_nodes:
        assert [f["status"] for f in before[n.name]] == ["PASS"], before[n.name]
        assert before[n.name][0]["detail"] == "NCCL/gloo will use eth0"
    with _bridges(testbed, testbed_nodes):
        order = testbed.exec(testbed_nodes[0], ["ip", "-o", "-4", "addr", "show"],
                             check=True).stdout
        after = _ifname(_doctor_json(inv))
    bridge_first = order.index(BRIDGE) < order.index("eth0")
    for n in testbed_nodes:
        found = after[n.name]
        assert [f["status"] for f in found] == ["WARN"], found
        want = f"NCCL would pick {BRIDGE}" if bridge_first else f"also use {BRIDGE} besides eth0"
        assert want in found[0]["detail"], (order, found)
        assert found[0]["fix"] == ("set NCCL_SOCKET_IFNAME==eth0 and GLOO_SOCKET_IFNAME=eth0 "
                                   "in the inventory env")
    # doctor kept its pick, and the plan renders exactly that name on every node
    loaded = load_inventory(inv)
    picked = apply_picks(loaded, saved_picks(tmp_path / "home", loaded.name), {})
    for host in picked.hosts:
        assert host.env["NCCL_SOCKET_IFNAME"] == "=eth0", host.env
        assert host.env["GLOO_SOCKET_IFNAME"] == "eth0"
    # gone again: the next test sees the nodes as they were
    left = testbed.exec(testbed_nodes[0], ["ip", "-o", "link", "show"], check=True).stdout
    assert BRIDGE not in left
