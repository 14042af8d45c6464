"""Grouped per-host outcomes on the scripted fake transport: timeouts, drops, partial failure."""

from __future__ import annotations

import json
import threading

import pytest

from clusterkit.checkpoints.collect.discover import verify
from clusterkit.checkpoints.collectplan import CheckpointIncomplete
from clusterkit.checkpoints.sources.base import CollectNode, list_nodes
from clusterkit.hostrange import fold_by_text
from clusterkit.launch.gate import GateNode, gate_error, run_gate
from clusterkit.remote import fanout
from clusterkit.remote.base import GroupError
from clusterkit.ship import bundle
from tests.fake_transport import FakeTransport, dropped, exits, fails, hangs, ok, targets, timeout

NODES = [f"node{i}" for i in range(1, 8)]
RESOLVE = fails("resolve", "cannot resolve the host's address ([Errno -2] Name or service not known)",
                "check the address in the inventory")


def test_seven_identical_failures_fold_into_one_row() -> None:
    fake = FakeTransport(dict.fromkeys(NODES, RESOLVE))
    group = fake.run_all(targets(NODES), ["true"], timeout=5)
    assert group.folded_failures() == [(
        "node[1-7]", "resolve: cannot resolve the host's address ([Errno -2] Name or service "
        "not known) — check the address in the inventory")]
    with pytest.raises(GroupError) as info:
        group.raise_on_failure("ssh check")
    assert info.value.message.count("node") == 1  # one row, not seven
    assert "failed on 7 of 7 host(s): node[1-7]: resolve:" in info.value.message


def test_partial_failure_timeout_and_drop_keep_order_and_successes() -> None:
    script = {**dict.fromkeys(NODES, ok("fine\n")), "node2": timeout(), "node3": dropped(),
              "node5": timeout(), "node6": exits(3, "boom\nlast words\n")}
    group = FakeTransport(script).run_all(targets(NODES), ["x"], timeout=2)
    assert [r.host for r in group] == NODES
    assert [r.host for r in group.succeeded] == ["node1", "node4", "node7"]
    assert group.folded_failures() == [
        ("node[2,5]", "command-timeout: command did not finish within 2s (killed)"),
        ("node3", "dropped: the SSH connection dropped while the command ran"),
        ("node6", "exit 3: last words")]


def test_a_host_hung_past_its_timeouts_is_cut_by_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "_SLACK_S", 0.0)
    release = threading.Event()
    try:
        script = {**dict.fromkeys(NODES[:3], ok()), "node2": hangs(release)}
        group = FakeTransport(script).run_all(targets(NODES[:3]), ["x"], timeout=0.3)
    finally:
        release.set()
    assert [r.host for r in group.failed] == ["node2"]
    assert group["node2"].error is not None and group["node2"].error.kind == "timeout"


def test_gate_folds_nodes_with_the_same_problem() -> None:
    facts = {"python": "/usr/bin/python3", "version": "3.11.2", "torch": None, "deepspeed": None,
             "accelerate": None, "clusterkit": None}
    script = {**dict.fromkeys(NODES, ok(json.dumps(facts) + "\n")), "node7": dropped()}
    fake = FakeTransport(script)
    result = run_gate(fake, [GateNode(n, "/usr/bin/python3", t)
                             for n, t in zip(NODES, targets(NODES), strict=True)], need=("torch",))
    text = gate_error(result).message
    assert "node[1-6]: torch is not installed for /usr/bin/python3" in text
    assert text.count("node7: ") == 1 and text.count("node[1-6]: ") == 1
    # The gate's facts come from the shipped node program: the bundle on stdin, once per node.
    assert all(stdin == bundle("facts.gatefacts") for _, _, stdin in fake.calls)


def test_collect_listing_failures_fold(tmp_path: object) -> None:
    fake = FakeTransport({**dict.fromkeys(NODES, RESOLVE), "node4": dropped()})
    nodes = [CollectNode(n, t, "python3", f"/ckpt/{n}") for n, t in zip(NODES, targets(NODES), strict=True)]
    with pytest.raises(CheckpointIncomplete) as info:
        verify(list_nodes(fake, nodes, None))
    problems = info.value.problems
    assert problems[0].startswith("node[1-3,5-7]: cannot list (resolve)")
    assert problems[1].startswith("node4: cannot list (dropped)")


def test_fold_by_text_keeps_rank_order() -> None:
    rows = fold_by_text([("node3", "a"), ("node1", "a"), ("node2", "b")], ["node1", "node2", "node3"])
    assert rows == [("node[1,3]", "a"), ("node2", "b")]


def test_doctor_prints_seven_identical_unreachable_nodes_as_one_row() -> None:
    """The issue's cluster: an inventory listing only node[1-7] that nobody can resolve."""
    from clusterkit.checks.doctor import run_doctor
    from clusterkit.checks.doctor_plan import plan_doctor
    from clusterkit.inventory import Host

    hosts = tuple(Host(name=n, address=n, python="/usr/bin/python3") for n in NODES)
    plan = plan_doctor(hosts, head_python="/usr/bin/python3", head_cwd="/work",
                       head_tools={"pdsh": None}, master_port=None)
    report = run_doctor(plan, FakeTransport(dict.fromkeys(NODES, RESOLVE)))
    rows = [g for g in report.groups() if g.check == "ssh"]
    assert len(rows) == 1 and rows[0].host_range == "node[1-7]", rows
    assert "cannot resolve the host's address" in rows[0].detail
