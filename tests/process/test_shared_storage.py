"""A "node-local" checkpoint dir that is one filesystem for several nodes (issue 32).

The token logic (node/facts/gatefacts.py: token_seen, drop_tokens, shared_groups) on this
machine's filesystem, the gate's verdict from the nodes' facts (launch/gate.py), doctor's
finding (checks/rules_storage.py) and collect-ckpt's one line (checkpoints/collect/discover.py).
The test bed runs the same over SSH (tests/bed/test_shared_storage_testbed.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest

from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.collectplan import CheckpointIncomplete, WithoutMarkers
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.checks.findings import Status
from clusterkit.checks.rules_base import DoctorContext
from clusterkit.checks.rules_storage import check_shared_dirs
from clusterkit.launch.gate import judge, node_needs, shared_dirs
from clusterkit.node.facts.gatefacts import (
    TOKEN_PREFIX,
    TOKEN_STALE_S,
    drop_tokens,
    gate_facts,
    need_unshared,
    shared_groups,
    token_seen,
)
from clusterkit.remote.base import SSHTarget
from clusterkit.remote.dispatch import DispatchTransport
from tests import synthetic_ckpt as synthetic


def _token_names(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(".clusterkit-token"))


def test_the_second_writer_sees_the_first_and_the_drop_leaves_nothing(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    assert token_seen(str(d), "j1", "node1") == {"seen": []}
    assert token_seen(str(d), "j1", "node2") == {"seen": ["node1"]}
    assert token_seen(str(d), "j1", "node3") == {"seen": ["node1", "node2"]}
    assert token_seen(str(d), "other-run", "node4") == {"seen": []}  # another round's
    for node in ("node1", "node2", "node3"):
        drop_tokens([need_unshared(str(d), "j1", node)])
    drop_tokens([need_unshared(str(d), "other-run", "node4")])
    assert _token_names(d) == []


def test_own_dirs_see_nothing(tmp_path: Path) -> None:
    for node in ("node1", "node2"):
        (tmp_path / node).mkdir()
        assert token_seen(str(tmp_path / node), "j", node) == {"seen": []}


def test_a_dir_not_created_yet_is_compared_by_its_full_path(tmp_path: Path) -> None:
    """Nothing is created: the token goes to the nearest existing parent, naming the
    rest of the path, so /shared/{host} (a dir per node on one disk) is not shared."""
    a = token_seen(str(tmp_path / "ck" / "node1"), "j", "node1")
    b = token_seen(str(tmp_path / "ck" / "node2"), "j", "node2")
    c = token_seen(str(tmp_path / "ck" / "node1"), "j", "node3")
    assert (a, b, c) == ({"seen": []}, {"seen": []}, {"seen": ["node1"]})
    assert not (tmp_path / "ck").exists()
    for node, sub in (("node1", "node1"), ("node2", "node2"), ("node3", "node1")):
        drop_tokens([need_unshared(str(tmp_path / "ck" / sub), "j", node)])
    assert _token_names(tmp_path) == []


def test_drop_finds_the_token_after_the_dir_was_created(tmp_path: Path) -> None:
    token_seen(str(tmp_path / "ck"), "j", "node1")
    (tmp_path / "ck").mkdir()  # the agent created it between the facts and GO
    drop_tokens([need_unshared(str(tmp_path / "ck"), "j", "node1")])
    assert _token_names(tmp_path) == []


def test_a_stale_token_is_swept(tmp_path: Path) -> None:
    token_seen(str(tmp_path), "old", "node9")
    stale = tmp_path / _token_names(tmp_path)[0]
    old = time.time() - TOKEN_STALE_S - 10
    os.utime(stale, (old, old))
    assert token_seen(str(tmp_path), "old", "node1") == {"seen": []}
    assert not stale.exists()
    drop_tokens([need_unshared(str(tmp_path), "old", "node1")])


def test_an_unwritable_dir_is_an_error_not_a_verdict(tmp_path: Path) -> None:
    out = token_seen("/proc/nope", "j", "node1")
    assert list(out) == ["error"] and "/proc" in out["error"]


def test_shared_groups_either_direction_transitive_in_order() -> None:
    order = ["node1", "node2", "node3", "node4", "node5"]
    assert shared_groups({"node1": [], "node2": ["node1"], "node3": []}, order) == [
        ["node1", "node2"]]
    # node4 saw node3, node5 saw node4: one group; node1/node2 their own
    assert shared_groups({"node2": ["node1"], "node4": ["node3"], "node5": ["node4"]},
                         order) == [["node1", "node2"], ["node3", "node4", "node5"]]
    assert shared_groups({"node1": [], "node2": []}, order) == []
    assert shared_groups({"node1": ["node1"]}, order) == []


def test_gate_facts_report_tokens_only_when_asked(tmp_path: Path) -> None:
    assert "unshared" not in gate_facts([])
    facts = gate_facts([need_unshared(str(tmp_path), "j", "node1")])
    assert facts["unshared"] == {str(tmp_path): {"seen": []}}
    drop_tokens([need_unshared(str(tmp_path), "j", "node1")])


def test_judge_refuses_each_sharing_node_with_one_folded_line() -> None:
    facts: dict[str, dict[str, object]] = {
        f"node{i}": {"unshared": {"/home/u/ck/j": {"seen": [f"node{j}" for j in range(1, i)]}}}
        for i in range(1, 5)}
    facts["node5"] = {"unshared": {"/home/u/ck/j": {"seen": []}}}
    order = [f"node{i}" for i in range(1, 6)]
    problems = judge(facts, {}, order, same_python=False).problems
    assert sorted(problems) == order[:4]
    assert len(set(problems.values())) == 1
    line = problems["node1"]
    assert line.startswith("checkpoint dir /home/u/ck/j is one directory shared by node[1-4]")
    assert line.endswith("use --storage shared, or a checkpoint.local_dir (--ckpt-dir) on "
                         "each node's own disk")
    assert shared_dirs({"node1": {"unshared": {"/x": {"error": "no"}}}}, order) == {}


def test_node_needs_ask_for_tokens_on_node_local_with_several_nodes() -> None:
    from clusterkit.inventory import local_inventory
    from clusterkit.plan.build import plan_job
    from clusterkit.spec.job import JobOptions
    from tests.render_cases import FACTS

    inv = local_inventory("/tmp/ck")
    two = plan_job(inv, JobOptions(job_id="j", nodes=2, storage="node-local"), FACTS)
    assert [node_needs(two, n)[-1] for n in two.nodes] == [
        need_unshared(n.ckpt_dir, "j", n.name) for n in two.nodes]
    one = plan_job(inv, JobOptions(job_id="j", nodes=1, storage="node-local"), FACTS)
    shared = plan_job(inv, JobOptions(job_id="j", nodes=2, storage="shared"), FACTS)
    assert not any(x.startswith("unshared:") for p in (one, shared) for n in p.nodes
                   for x in node_needs(p, n))
    assert TOKEN_PREFIX.startswith(".")  # hidden: the replica watcher skips it


# ------------------------------------------------------------------ doctor


def _ctx(storage: str | None = None) -> DoctorContext:
    return DoctorContext(hosts=("node1", "node2", "node3"), storage=storage,
                         local_dirs=dict.fromkeys(("node1", "node2", "node3"), "/home/u/ck"))


TOKENS: dict[str, dict[str, object]] = {
    "node1": {"/home/u/ck": {"seen": []}}, "node2": {"/home/u/ck": {"seen": ["node1"]}},
    "node3": {"/home/u/ck": {"seen": []}}}


def test_doctor_warns_fails_for_node_local_and_skips_for_shared() -> None:
    warn = check_shared_dirs(TOKENS, _ctx())
    assert [(f.host, f.status) for f in warn] == [
        ("node1", Status.WARN), ("node2", Status.WARN), ("node3", Status.PASS)]
    assert warn[0].detail == warn[1].detail == (
        "checkpoint dir /home/u/ck is one directory shared by node[1-2] (a file written on one "
        "is seen on the others): node-local checkpoints and replicas would collide there")
    assert warn[0].fix == ("use --storage shared, or a checkpoint.local_dir (--ckpt-dir) on "
                           "each node's own disk")
    fail = check_shared_dirs(TOKENS, _ctx("node-local"))
    assert [f.status for f in fail] == [Status.FAIL, Status.FAIL, Status.PASS]
    assert check_shared_dirs(TOKENS, _ctx("shared")) == []
    err = check_shared_dirs({"node1": {"/x": {"error": "cannot write a token in /x"}}}, _ctx())
    assert [(f.status, f.detail.split(":")[0]) for f in err] == [
        (Status.WARN, "cannot tell whether checkpoint.local_dir is this node's own")]


def test_doctor_finds_a_local_dir_two_local_nodes_share(tmp_path: Path) -> None:
    """Two virtual nodes with one checkpoint.local_dir, a third with its own; the phase
    leaves no token behind."""
    from clusterkit.checks.doctor import run_doctor
    from clusterkit.checks.doctor_plan import plan_doctor
    from clusterkit.inventory import local_inventory
    from clusterkit.remote.dispatch import DispatchTransport

    inv = local_inventory(str(tmp_path), nodes=3)
    common = str(tmp_path / "common")
    hosts = [dataclasses.replace(h, checkpoint=dataclasses.replace(h.checkpoint,
                                                                   local_dir=common))
             if i < 2 else h for i, h in enumerate(inv.hosts)]
    plan = plan_doctor(hosts, head_python=sys.executable, head_cwd=str(tmp_path),
                       head_tools={}, master_port=None, storage="node-local")
    with DispatchTransport() as transport:
        report = run_doctor(plan, transport)
    found = {f.host: f for f in report.findings if f.check == "storage.node-local"}
    assert found["local1"].status is Status.FAIL and found["local2"].status is Status.FAIL
    assert "shared by local[1-2]" in found["local1"].detail
    assert found["local3"].status is Status.PASS
    assert not list(tmp_path.rglob(".clusterkit-token*"))


# ------------------------------------------------------------------ collect-ckpt


def _shared_nodes(tmp: Path, n: int = 4) -> list[CollectNode]:
    """n nodes whose "node-local" dir is one directory: each wrote its part there."""
    common = str(tmp / "home" / "ckpt")
    synthetic.write_node_local([common] * n, zero_stage=2, shard_bytes=1024, model_bytes=256)
    return [CollectNode(f"node{i + 1}", SSHTarget(name=f"node{i + 1}", address="127.0.0.1",
                                                  local=True), sys.executable, common)
            for i in range(n)]


@pytest.mark.parametrize("markers", [True, False])
def test_collect_says_shared_in_one_line(tmp_path: Path, markers: bool) -> None:
    nodes = _shared_nodes(tmp_path)
    options = CollectOptions(dest=str(tmp_path / "dest"),
                             without_markers=None if markers else WithoutMarkers(8))
    with DispatchTransport() as transport, pytest.raises(CheckpointIncomplete) as info:
        collect(transport, nodes, options)
    assert list(info.value.problems) == [
        f"global_step1 is the same files on node[1-4]: its checkpoint dir {nodes[0].root} is "
        "one directory shared by node[1-4] (a file written on one is seen on the others): "
        "node-local checkpoints and replicas would collide there"]
    assert info.value.hint is not None and "--include node1" in info.value.hint
    assert "--storage shared" in info.value.hint
    assert not (tmp_path / "dest" / "global_step1").exists()


def test_collect_from_one_node_of_a_shared_dir_works(tmp_path: Path) -> None:
    """What the hint says: --include one node reads the whole checkpoint from it."""
    nodes = _shared_nodes(tmp_path)
    with DispatchTransport() as transport:
        report = collect(transport, nodes[:1], CollectOptions(dest=str(tmp_path / "dest")))
    assert not report.failed and report.plan.world_size == 8
