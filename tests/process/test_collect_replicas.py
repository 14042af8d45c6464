"""collect-ckpt completes a checkpoint from replicas (issue 22): local sessions, no test
bed. A node "down" is a node whose python cannot start (its session fails like an
unreachable node's); its part is read from its replica on the next node."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from clusterkit.checkpoints.collect.manifest import read_manifest
from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.collectplan import CheckpointIncomplete
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.errors import CheckpointError
from clusterkit.node import contract
from clusterkit.node.hashing import sha256_file
from clusterkit.remote.dispatch import DispatchTransport
from clusterkit.spec.jobrecord import JobCheckpoints
from tests import synthetic_ckpt as synthetic
from tests.collectnodes import local_collect_nodes

TAG = "global_step20"


def _write_replicated_nodes(tmp: Path, n: int = 4, replicas: int = 1) -> list[CollectNode]:
    nodes = local_collect_nodes(tmp, n)
    roots = [c.root for c in nodes]
    synthetic.write_node_local(roots, zero_stage=2, shard_bytes=4096, model_bytes=1024, tag=TAG)
    synthetic.write_ring_replicas(roots, TAG, replicas=replicas)
    return nodes


def _down(nodes: list[CollectNode], index: int, tmp: Path) -> None:
    nodes[index] = dataclasses.replace(nodes[index], python=str(tmp / "no-python"))


def _replica_shard(nodes: list[CollectNode], source: int, holder: int) -> str:
    d = os.path.join(contract.replica_dir(nodes[holder].root, source, TAG), TAG)
    return os.path.join(d, sorted(f for f in os.listdir(d) if f.endswith("_optim_states.pt"))[0])


def _flip(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 0xFF]))



def test_a_deleted_node_copy_is_completed_from_its_replica(tmp_path: Path,
                                                           transport: DispatchTransport) -> None:
    nodes = _write_replicated_nodes(tmp_path)
    own = synthetic.shard_paths(nodes[2].root, TAG)
    digests = {os.path.basename(p): sha256_file(str(p)) for p in own}
    import shutil

    shutil.rmtree(os.path.join(nodes[2].root, TAG))  # node3's copy is gone
    dest = tmp_path / "dest"
    report = collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert report.plan.tag == TAG and not report.failed
    assert report.replicas is not None
    assert report.replicas.used() == [
        "node index 2 (node3): from its replica on node4 (global_step20, verified)"]
    for name, digest in digests.items():
        assert sha256_file(str(dest / TAG / name)) == digest
    files = read_manifest(str(dest), TAG)["files"]
    entry = files[f"{TAG}/{sorted(digests)[0]}"]
    assert (entry["source"], entry["replica_on"]) == ("node3", "node4")
    first = os.path.basename(synthetic.shard_paths(nodes[0].root, TAG)[0])
    assert "replica_on" not in files[f"{TAG}/{first}"]
    parts = read_manifest(str(dest), TAG)["parts"]
    assert parts["2"]["from"] == "node4" and parts["2"]["replica"] is True
    assert parts["0"] == {"node": "node1", "from": "node1", "replica": False,
                          "root": nodes[0].root}


def test_an_unreachable_node_is_covered_by_its_replica(tmp_path: Path,
                                                       transport: DispatchTransport) -> None:
    nodes = _write_replicated_nodes(tmp_path)
    _down(nodes, 0, tmp_path)  # node 0: its replica also holds the recovery script
    dest = tmp_path / "dest"
    report = collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert not report.failed and report.plan.canonical_node == "node1"
    assert (dest / "zero_to_fp32.py").read_text() == synthetic.SCRIPT_TEXT
    assert (dest / "latest").read_text() == TAG
    assert report.replicas is not None and report.replicas.routes["node1"].holder == "node2"


def test_a_corrupted_replica_is_refused_naming_the_file(tmp_path: Path,
                                                        transport: DispatchTransport) -> None:
    nodes = _write_replicated_nodes(tmp_path)
    _down(nodes, 2, tmp_path)
    bad = _replica_shard(nodes, 2, 3)
    _flip(bad)  # same size: only the sha256 can tell
    dest = tmp_path / "dest"
    with pytest.raises(CheckpointError) as info:
        collect(transport, nodes, CollectOptions(dest=str(dest)))
    text = info.value.one_line()
    assert f"node3:{TAG}/{os.path.basename(bad)}" in text
    assert "the replica on node4 differs from its manifest (corrupted on disk)" in text
    assert "never used" in (info.value.hint or "")
    assert not (dest / TAG / os.path.basename(bad)).exists()


def test_with_two_replicas_the_intact_one_is_used(tmp_path: Path,
                                                  transport: DispatchTransport) -> None:
    nodes = _write_replicated_nodes(tmp_path, replicas=2)
    _down(nodes, 2, tmp_path)
    bad = _replica_shard(nodes, 2, 3)
    good = sha256_file(str(_replica_shard(nodes, 2, 0)))
    _flip(bad)
    dest = tmp_path / "dest"
    report = collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert not report.failed
    assert sha256_file(str(dest / TAG / os.path.basename(bad))) == good
    assert any("its replica on node4 was refused" in n and "reading its replica on node1" in n
               for n in report.notes), report.notes
    assert report.replicas is not None and report.replicas.used() == [
        "node index 2 (node3): from its replica on node1 (global_step20, verified)"]


def test_a_primary_file_that_differs_from_its_replica_manifest_is_suspect(
        tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_replicated_nodes(tmp_path)
    victim = synthetic.shard_paths(nodes[1].root, TAG)[0]
    want = sha256_file(str(victim))
    _flip(victim)  # changed since the save; its replica on node3 is intact
    dest = tmp_path / "dest"
    report = collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert not report.failed
    assert sha256_file(str(dest / TAG / os.path.basename(victim))) == want
    assert any("its own copy on node2 was refused" in n and "differs from the sha256 the "
               "manifest of its replica on node3 recorded" in n for n in report.notes), \
        report.notes


def test_unreachable_and_no_replica_is_one_clear_refusal(tmp_path: Path,
                                                         transport: DispatchTransport) -> None:
    nodes = _write_replicated_nodes(tmp_path)
    _down(nodes, 2, tmp_path)
    _down(nodes, 3, tmp_path)  # node3's replica was on node4
    with pytest.raises(CheckpointIncomplete) as info:
        collect(transport, nodes, CollectOptions(dest=str(tmp_path / "dest")))
    assert info.value.problems == (
        "node index 2 (node3): unreachable; no complete replica of global_step20 on any "
        "reachable node (unreachable: node4)",)
    assert not (tmp_path / "dest").exists()


def test_cli_json_names_the_parts_from_replicas(tmp_path: Path) -> None:
    import subprocess

    nodes = _write_replicated_nodes(tmp_path, n=3)
    inv = tmp_path / "inv.yaml"
    inv.write_text("schema_version: 1\ndefaults:\n  transport: local\n  slots: 2\n"
                   f"  python: {sys.executable}\nhosts:\n" + "".join(
                       f"  node{i + 1}:\n    address: 127.0.0.1\n    checkpoint:\n"
                       f"      local_dir: {nodes[i].root}\n" for i in range(3)))
    import shutil

    shutil.rmtree(os.path.join(nodes[1].root, TAG))
    res = subprocess.run(
        [sys.executable, "-m", "clusterkit", "collect-ckpt", "-i", str(inv), "--to",
         str(tmp_path / "dest"), "--json"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["replicas"]["used"] == [
        "node index 1 (node2): from its replica on node3 (global_step20, verified)"]
    assert out["replicas"]["parts"]["1"]["from"] == "node3"
    assert "node index 1 (node2): from its replica on node3" in res.stderr


# ------------------------------------------------------------------ status


def test_health_per_tag_newest_first(tmp_path: Path, transport: DispatchTransport) -> None:
    from clusterkit.checkpoints.replicas.health import health, list_all

    nodes = _write_replicated_nodes(tmp_path)
    roots = [n.root for n in nodes]
    synthetic.write_node_local(roots, zero_stage=2, shard_bytes=1024, model_bytes=256,
                               tag="global_step40")
    synthetic.write_ring_replicas(roots, "global_step40")
    # node4's copy of step 40 (on node1) never finished; node2 is down
    os.unlink(os.path.join(contract.replica_dir(roots[0], 3, "global_step40"),
                           contract.REPLICA_MANIFEST))
    _down(nodes, 1, tmp_path)
    listings = list_all(transport, nodes)
    # replicated counts what the reachable nodes hold: node1's replicas are on node2
    assert [h.line() for h in health(listings)] == [
        "global_step40: 3/4 nodes, replicated 2/4; complete from replicas",
        "global_step20: 3/4 nodes, replicated 3/4; complete from replicas"]
    _down(nodes, 0, tmp_path)  # node1 down too: node2's step-20 replica is on node3 still
    h = health(list_all(transport, nodes))
    assert h[0].line() == ("global_step40: 2/4 nodes, replicated 2/4; cannot be assembled: "
                           "node index 0 (node1): unreachable; no complete replica of "
                           "global_step40 on any reachable node (unreachable: node2)")


def test_status_job_shows_replica_health(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from clusterkit.cli.main import main
    from clusterkit.launch.registry import JobRecord, NodeRecord, Registry

    nodes = _write_replicated_nodes(tmp_path, n=3)
    home = tmp_path / "home"
    record = JobRecord(job_id="ck-repl-1", backend="torchrun", created=0.0, launcher_pid=0,
                       nodes=[NodeRecord(n.name, sys.executable, str(tmp_path / "jobdir"),
                                         n.target) for n in nodes])
    record.ckpt = JobCheckpoints(storage=contract.StorageKind.NODE_LOCAL,
                                 dirs={n.name: n.root for n in nodes})
    Registry(home).save(record)
    monkeypatch.setenv("CLUSTERKIT_HOME", str(home))
    assert main(["status", "ck-repl-1"]) == 0
    out = capsys.readouterr().out
    assert "  checkpoints (newest first):\n    global_step20: 3/3 nodes, replicated 3/3\n" \
        in out, out
    assert main(["status", "ck-repl-1", "--json"]) == 0
    tags = json.loads(capsys.readouterr().out)["checkpoints"]["tags"]
    assert tags == [{"tag": TAG, "nodes": 3, "own": 3, "replicated": 3, "complete": True,
                     "missing": {}, "collectable": True, "problems": []}]


def test_dry_run_names_a_corrupted_replica_and_copies_nothing(
        tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_replicated_nodes(tmp_path)
    _down(nodes, 2, tmp_path)
    bad = _replica_shard(nodes, 2, 3)
    _flip(bad)
    dest = tmp_path / "dest"
    report = collect(transport, nodes, CollectOptions(dest=str(dest), dry_run=True))
    assert f"node3:{TAG}/{os.path.basename(bad)}: the replica on node4 differs from its " \
        "manifest (corrupted on disk)" in report.notes
    assert report.replicas is not None and report.replicas.used(False) == [
        "node index 2 (node3): from its replica on node4 (global_step20, hashed)"]
    assert not (dest / TAG).exists()


def test_latest_disagreement_is_still_refused_with_replicas(
        tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_replicated_nodes(tmp_path)
    Path(nodes[1].root, "latest").write_text("global_step10")
    with pytest.raises(CheckpointIncomplete) as info:
        collect(transport, nodes, CollectOptions(dest=str(tmp_path / "dest")))
    assert "'latest' files disagree" in info.value.problems[0]


def test_a_user_scripts_save_without_markers_is_completed_from_its_replica(
        tmp_path: Path, transport: DispatchTransport) -> None:
    from clusterkit.checkpoints.collectplan import WithoutMarkers

    nodes = local_collect_nodes(tmp_path, 4)
    roots = [c.root for c in nodes]
    synthetic.write_node_local(roots, zero_stage=2, shard_bytes=4096, model_bytes=1024, tag=TAG)
    for index, root in enumerate(roots):  # engine.save_checkpoint writes no markers
        os.unlink(os.path.join(root, TAG, contract.marker_name(index)))
    synthetic.write_ring_replicas(roots, TAG)
    _down(nodes, 1, tmp_path)
    dest = tmp_path / "dest"
    report = collect(transport, nodes, CollectOptions(
        dest=str(dest), without_markers=WithoutMarkers(world_size=8)))
    assert not report.failed and report.plan.world_size == 8
    assert report.replicas is not None and report.replicas.used() == [
        "node index 1 (node2): from its replica on node3 (global_step20, verified)"]
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 8
