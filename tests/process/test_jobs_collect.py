"""clusterkit.jobs: collect-ckpt end to end as a function (``collect_job``), and job
resolution (``jobs/resolve.py``), called in-process over local "nodes" (transport:
local), as the CLI verb and the Python API call them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from clusterkit.checkpoints.collectplan import CheckpointIncomplete, CollectPlan
from clusterkit.errors import CheckpointError, LaunchError
from clusterkit.inventory import Inventory, parse_inventory
from clusterkit.jobs.collect import CollectHooks, CollectRequest, CollectResult, collect_job
from clusterkit.jobs.resolve import NodeChoice, find_job, resolve_nodes
from clusterkit.launch.registry import JobRecord, NodeRecord, Registry
from clusterkit.node.contract import StorageKind, marker_name
from clusterkit.remote.base import SSHTarget
from clusterkit.spec.jobrecord import JobCheckpoints
from tests import synthetic_ckpt as synthetic

TAG = "global_step1"
JOB = "ck-jobs-1"


def _no_inventory() -> Inventory:
    raise AssertionError("the job records every node's checkpoint dir: no inventory read")


def _registered_job_home(tmp: Path, *, storage: StorageKind = StorageKind.NODE_LOCAL, markers: bool = True
         ) -> Path:
    """A launched job of 2 local nodes with 2 ranks each, its checkpoint written; the home."""
    home = tmp / "home"
    roots = [str(tmp / f"node{i}" / "ckpt") for i in (1, 2)]
    synthetic.write_node_local(roots, shard_bytes=1024, model_bytes=256)
    nodes = [NodeRecord(f"node{i}", sys.executable, f"/x/jobs/{JOB}",
                        SSHTarget(name=f"node{i}", address="127.0.0.1", local=True))
             for i in (1, 2)]
    ckpt = JobCheckpoints(storage=storage, dir=roots[0], dirs={"node2": roots[1]},
                          slots=[2, 2], markers=markers)
    Registry(home).save(JobRecord(job_id=JOB, backend="torchrun", created=0.0, launcher_pid=0,
                                  nodes=nodes, ckpt=ckpt))
    return home


def test_a_job_is_collected_into_its_dir_with_a_typed_result(tmp_path: Path) -> None:
    home = _registered_job_home(tmp_path)
    seen: list[str] = []

    def planned(plan: CollectPlan) -> None:
        seen.append(f"plan {plan.tag} {plan.world_size}")

    def collected(result: CollectResult) -> None:
        seen.append(f"collected {result.tag}")

    hooks = CollectHooks(said=seen.append, planned=planned, collected=collected)
    result = collect_job(CollectRequest(NodeChoice(job=JOB)), home=home,
                         inventory=_no_inventory, hooks=hooks)
    dest = home / "jobs" / JOB / "checkpoints"
    assert result.dest == str(dest) and result.tag == TAG and result.report is not None
    assert seen == [f"plan {TAG} 4", f"collected {TAG}"]  # no batch job: nothing said
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 4
    assert result.nodes.record is not None and result.nodes.markers is True
    report = result.to_json()
    assert report["dest"] == str(dest) and report["collect"]["tag"] == TAG
    assert report["copied_bytes"] == result.report.bytes_copied > 0
    again = collect_job(CollectRequest(NodeChoice(job=JOB), dry_run=True), home=home,
                        inventory=_no_inventory)
    assert again.dry_run and again.report is not None and again.report.bytes_copied == 0


def test_an_incomplete_checkpoint_raises_with_every_finding(tmp_path: Path) -> None:
    home = _registered_job_home(tmp_path)
    os.unlink(synthetic.shard_paths(str(tmp_path / "node2" / "ckpt"))[1])  # rank 3
    with pytest.raises(CheckpointIncomplete) as info:
        collect_job(CollectRequest(NodeChoice(job=JOB)), home=home, inventory=_no_inventory)
    assert any("node2" in p and "rank 3" in p for p in info.value.problems), info.value.problems
    assert not (home / "jobs" / JOB / "checkpoints" / TAG).exists()  # nothing copied


def test_refusals_are_the_cli_s_errors(tmp_path: Path) -> None:
    home = _registered_job_home(tmp_path)
    with pytest.raises(LaunchError, match="no job 'ck-nope' in the registry"):
        collect_job(CollectRequest(NodeChoice(job="ck-nope")), home=home,
                    inventory=_no_inventory)
    with pytest.raises(CheckpointError, match="--jobs must be >= 1"):
        collect_job(CollectRequest(NodeChoice(job=JOB), jobs=0), home=home,
                    inventory=_no_inventory)
    with pytest.raises(CheckpointError, match="--world-size is for --without-markers"):
        collect_job(CollectRequest(NodeChoice(job=JOB), world_size=4), home=home,
                    inventory=_no_inventory)
    with pytest.raises(CheckpointError, match="does nothing else"):
        collect_job(CollectRequest(NodeChoice(job=JOB), tag=TAG, scatter=True, dry_run=True),
                    home=home, inventory=_no_inventory)


def test_resolution_of_a_launched_job(tmp_path: Path) -> None:
    home = _registered_job_home(tmp_path)
    record, root = find_job(JOB, None, home)
    assert record is not None and record.job_id == JOB and root is None
    assert find_job(None, "/some/dir", home) == (None, "/some/dir")
    got = resolve_nodes(NodeChoice(job=JOB), home=home, inventory=_no_inventory)
    assert [(n.name, n.root) for n in got.nodes] == [
        ("node1", str(tmp_path / "node1" / "ckpt")), ("node2", str(tmp_path / "node2" / "ckpt"))]
    assert got.slots == [2, 2] and got.places == ""
    one = resolve_nodes(NodeChoice(job=JOB, exclude="node1"), home=home, inventory=_no_inventory)
    # One node of several: the whole checkpoint read from it (a node-local dir that was
    # one shared directory).
    assert [n.name for n in one.nodes] == ["node2"] and one.slots == [4]


def test_shared_storage_is_read_from_the_first_node(tmp_path: Path) -> None:
    home = _registered_job_home(tmp_path, storage=StorageKind.SHARED)
    got = resolve_nodes(NodeChoice(job=JOB), home=home, inventory=_no_inventory)
    assert [n.name for n in got.nodes] == ["node1"] and got.slots == [4]


def test_a_user_script_s_job_is_judged_without_markers(tmp_path: Path) -> None:
    home = _registered_job_home(tmp_path, markers=False)
    for i, node in enumerate(("node1", "node2")):
        os.unlink(tmp_path / node / "ckpt" / TAG / marker_name(i))
    result = collect_job(CollectRequest(NodeChoice(job=JOB)), home=home,
                         inventory=_no_inventory)
    assert result.report is not None and result.report.plan.world_size == 4


def test_inventory_nodes_collected_then_scattered_back(tmp_path: Path) -> None:
    """No job: the inventory's hosts (loaded only now); the scatter's result is typed too."""
    def inventory(root: Path, n: int) -> Inventory:
        hosts = {f"node{i}": {"address": "127.0.0.1",
                              "checkpoint": {"local_dir": f"{root}/node{i}/ckpt"}}
                 for i in range(1, n + 1)}
        return parse_inventory(yaml.safe_dump(
            {"schema_version": 1, "hosts": hosts,
             "defaults": {"transport": "local", "slots": 2, "python": sys.executable}}),
            str(root / "inv.yaml"))

    synthetic.write_node_local([str(tmp_path / f"node{i}" / "ckpt") for i in (1, 2)],
                               shard_bytes=1024, model_bytes=256)
    dest = tmp_path / "dest"
    loaded: list[int] = []

    def load() -> Inventory:
        loaded.append(1)
        return inventory(tmp_path, 2)

    got = collect_job(CollectRequest(dest=str(dest)), home=tmp_path / "home", inventory=load)
    assert loaded == [1] and got.nodes.record is None and got.dest == str(dest)
    fresh = tmp_path / "fresh"
    back = collect_job(CollectRequest(dest=str(dest), scatter=True), home=tmp_path / "home",
                       inventory=inventory(fresh, 2))
    assert back.scattered is not None and back.report is None and back.tag == TAG
    assert back.to_json() == {"scatter": {"nodes": {"node1": [0, 1], "node2": [2, 3]},
                                          "remapped": False}}
    assert (fresh / "node2" / "ckpt" / TAG / marker_name(1)).is_file()
