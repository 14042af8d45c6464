"""doctor's interface pick reaches the plan, unless the inventory or the shell set it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from clusterkit.checks.netpick import (
    load_picks,
    picks_from_facts,
    picks_path,
    save_picks,
)
from clusterkit.inventory import Inventory
from clusterkit.plan.build import plan_job
from clusterkit.plan.ifaces import KEYS, apply_picks
from clusterkit.render.artifacts import plan_json, render_all, summary
from clusterkit.spec.job import JobOptions
from tests.helpers import cluster, node
from tests.render_cases import FACTS, ROOT, inventory


def inventory_without_ifnames() -> Inventory:
    """The 7x2 reference inventory without its own NCCL/GLOO_SOCKET_IFNAME."""
    inv = inventory("a800-7x2")
    hosts = tuple(replace(h, env={k: v for k, v in h.env.items() if k not in KEYS})
                  for h in inv.hosts)
    return replace(inv, hosts=hosts)


def test_picks_are_the_interface_that_reaches_every_peer() -> None:
    split = {a: ("eth0" if a < "10.0.0.4" else "ens2") for a in node("node7").routes}
    picks = picks_from_facts(cluster(routes=split))
    assert picks == {f"node{i}": "eth0" for i in range(1, 7)}  # node7: ambiguous, no pick


def test_save_load_round_trip_and_junk_is_ignored(tmp_path: Path) -> None:
    path = picks_path(tmp_path, "a800 7x2")
    assert path == tmp_path / "doctor" / "a800-7x2.ifaces.json"
    assert load_picks(path) == {}  # no doctor run yet
    save_picks(path, "a800 7x2", {"node1": "eth0", "node2": "br-9f3c"})
    assert load_picks(path) == {"node1": "eth0", "node2": "br-9f3c"}
    path.write_text('{"ifaces": {"node1": "eth0; rm -rf /", "node2": 3}}')
    assert load_picks(path) == {}
    path.write_text("not json")
    assert load_picks(path) == {}


def test_plan_renders_the_exact_names_on_every_node() -> None:
    inv = inventory_without_ifnames()
    picked = apply_picks(inv, {h.name: "eth0" for h in inv.hosts[:3]}, environ={})
    plan = render_all(plan_job(picked, JobOptions(job_id="nic", backend="deepspeed", nodes=2),
                               FACTS))
    for n in plan.nodes:
        assert n.env["NCCL_SOCKET_IFNAME"] == "=eth0" and n.env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert "NCCL_SOCKET_IFNAME==eth0" in plan.artifacts["deepspeed_env"]


def test_the_plan_records_what_the_pick_set() -> None:
    """The pick is a fact of the plan (LaunchFacts.doctor_ifaces), and what it set on each
    node is a decision (JobPlan.doctor_ifaces): plan.json and the dry run show it."""
    inv = inventory_without_ifnames()
    facts = replace(FACTS, doctor_ifaces={h.name: "eth0" for h in inv.hosts[:3]})
    options = JobOptions(job_id="nic", backend="deepspeed", nodes=2)
    plan = render_all(plan_job(inv, options, facts))
    by_hand = render_all(plan_job(apply_picks(inv, facts.doctor_ifaces, {}), options, FACTS))
    assert [n.env for n in plan.nodes] == [n.env for n in by_hand.nodes]
    want = {"NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0"}
    assert plan.doctor_ifaces == {"node1": want, "node2": want}  # the selected nodes
    assert json.loads(plan_json(plan))["doctor_ifaces"] == {"node1": want, "node2": want}
    assert ("  doctor's interface pick: node[1-2]: NCCL_SOCKET_IFNAME==eth0 "
            "GLOO_SOCKET_IFNAME=eth0\n") in summary(plan)
    without = render_all(plan_job(inv, options, FACTS))  # no pick: plan.json as before
    assert "doctor_ifaces" not in json.loads(plan_json(without))
    assert "interface pick" not in summary(without)


def test_different_names_give_nccl_the_exact_list_and_gloo_nothing() -> None:
    inv = inventory_without_ifnames()
    picked = apply_picks(inv, {inv.hosts[0].name: "eth0", inv.hosts[1].name: "ens1"}, {})
    assert picked.hosts[0].env["NCCL_SOCKET_IFNAME"] == "=ens1,eth0"
    assert "GLOO_SOCKET_IFNAME" not in picked.hosts[0].env


def test_the_inventory_and_the_shell_win() -> None:
    inv = inventory_without_ifnames()
    first = inv.hosts[0]
    inv = replace(inv, hosts=(replace(first, env={**first.env, "GLOO_SOCKET_IFNAME": "bond0"}),
                              *inv.hosts[1:]))
    picked = apply_picks(inv, {first.name: "eth0"}, environ={"NCCL_SOCKET_IFNAME": "=ib0"})
    assert picked.hosts[0].env["GLOO_SOCKET_IFNAME"] == "bond0"
    assert "NCCL_SOCKET_IFNAME" not in picked.hosts[0].env
    assert picked.hosts[1].env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_render_cli_uses_the_saved_pick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`clusterkit render` after a doctor run: the exact name reaches .deepspeed_env."""
    from clusterkit.cli.main import main

    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    text = (ROOT / "hostfiles" / "a800-7x2.yaml").read_text()
    inv = tmp_path / "inv.yaml"
    inv.write_text(text.replace('    NCCL_SOCKET_IFNAME: "=ens1f0"\n', "")
                   .replace("    GLOO_SOCKET_IFNAME: ens1f0\n", ""))
    save_picks(picks_path(tmp_path / "home", "a800-7x2"), "a800-7x2",
               {f"node{i}": "ens1f1" for i in range(1, 8)})
    out = tmp_path / "out"
    argv = ["render", "-i", str(inv), "--job-id", "nic", "--launcher", "deepspeed"]
    assert main([*argv, "--out", str(out)]) == 0
    env = (out / "deepspeed_env").read_text()
    assert "NCCL_SOCKET_IFNAME==ens1f1\n" in env and "GLOO_SOCKET_IFNAME=ens1f1\n" in env
    recorded = json.loads((out / "plan.json").read_text())["doctor_ifaces"]
    assert set(recorded) == {f"node{i}" for i in range(1, 8)}
