"""Checkpoint replicas on real namespace nodes (issue 22): a 3-node x 1-slot launch of the
bundled workload (native: the quickest start), node-local storage, ``--replicas 1``, two
saves; every node's checkpoints then have a complete copy on its ring successor, whose
manifest's sha256s are the source files' own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit.node import contract
from clusterkit.node.hashing import sha256_file
from tests.helpers import train, train_argv, train_env
from tests.paths import REPO
from tests.testbed.core import Testbed

pytestmark = pytest.mark.testbed



@pytest.mark.slow  # ~25-50 s: a training run with replicas
def test_each_nodes_checkpoints_are_copied_to_its_ring_successor(
        testbed: Testbed, tmp_path: Path) -> None:
    job = "replica-3x1"
    run = train(testbed, tmp_path, job, "native", 3, 1, "node-local", 4,
                ["--replicas", "1", "--save-every", "2"], timeout=240)
    assert run.code == 0, run.text[-4000:]
    assert "checkpoints replicated: global_step2 3/3, global_step4 3/3" in run.text, \
        run.text[-3000:]
    nodes = [n.name for n in testbed.ensure(3)]
    for i, node in enumerate(nodes):
        succ = nodes[(i + 1) % 3]
        src = testbed.node_local_path(node, f"ckpt/{job}")
        tags = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
        assert len(tags) >= 1, (node, tags)
        area = testbed.node_local_path(succ, contract.replica_source_dir(f"ckpt/{job}", i))
        assert sorted(p.name for p in area.iterdir()) == tags, (node, succ)
        for tag in tags:
            held = area / tag
            manifest = json.loads((held / contract.REPLICA_MANIFEST).read_text())
            assert (manifest["source"], manifest["holder"], manifest["tag"]) == (i, succ, tag)
            assert any(rel.endswith(contract.marker_name(i)) for rel in manifest["files"])
            for rel, entry in manifest["files"].items():
                assert entry["sha256"] == sha256_file(str(held / rel)), (node, rel)
                if rel == contract.LATEST_FILE:  # node 0's, as it named this tag
                    assert (held / rel).read_text().strip() == tag
                else:
                    assert entry["sha256"] == sha256_file(str(src / rel)), (node, rel)
        # The agent's record (its job dir is under the shared work dir here).
        record = contract.JobDir(str(testbed.root / "work" / ".clusterkit" / "jobs" / job))
        state = json.loads(Path(record.replica_state(node)).read_text())
        assert state == {tag: {succ: "complete"} for tag in tags}, (node, state)
        # The copy's priority (node/replicas/priority.py) applied, and the node's log says what.
        log = Path(record.node_dir(node), contract.JobDir.LAUNCHER_LOG).read_text()
        assert "replica: copies run at low priority: CPU: SCHED_IDLE" in log, log[-2000:]


@pytest.mark.extended
def test_a_users_own_deepspeed_script_is_replicated_without_markers(
        testbed: Testbed, tmp_path: Path) -> None:
    """docs/examples/train.py saves with explicit tags and writes no clusterkit marker:
    the agents' no-marker rule (every local rank's files, whole zips, nothing open,
    stable for 2 s) still copies each save, the last one in the agents' finish."""
    job = "replica-own-script"
    script = REPO / "docs" / "examples" / "train.py"
    nodes = [n.name for n in testbed.ensure(2)]
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes=nodes, slots=1)
    # Saves at steps 4 and 8 (the script never saves at its last step, 9): the step-8
    # save is one step before the ranks exit, so its copy is made in the agents' finish.
    argv = train_argv(inv, job, "native", 2, 1, "node-local", 9, [
        "--replicas", "1", str(script), "--", "--steps", "9", "--save-every", "4"])
    proc = subprocess.run(argv, capture_output=True, text=True, env=train_env(tmp_path),
                          cwd=tmp_path, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "checkpoints replicated: step4 2/2, step8 2/2" in text, text[-3000:]
    for i, node in enumerate(nodes):
        src = testbed.node_local_path(node, f"ckpt/{job}")
        area = testbed.node_local_path(nodes[1 - i], contract.replica_source_dir(f"ckpt/{job}", i))
        assert sorted(p.name for p in area.iterdir()) == ["step4", "step8"], (node, text[-3000:])
        for tag in ("step4", "step8"):
            manifest = json.loads((area / tag / contract.REPLICA_MANIFEST).read_text())
            assert f"{tag}/zero_pp_rank_{i}_mp_rank_00_optim_states.pt" in manifest["files"]
            for rel, entry in manifest["files"].items():
                if rel != contract.LATEST_FILE:
                    assert entry["sha256"] == sha256_file(str(src / rel)), (node, rel)
    # Issue 32 item 4: status counts each node's own part by the same rule, and
    # collect-ckpt of the launched job needs no --without-markers (its record says).
    status = subprocess.run([sys.executable, "-m", "clusterkit", "status", job], capture_output=True,
                            text=True, env=train_env(tmp_path), cwd=tmp_path, timeout=120)
    assert "    step8: 2/2 nodes, replicated 2/2\n" in status.stdout, status.stdout + status.stderr
    collected = subprocess.run([sys.executable, "-m", "clusterkit", "collect-ckpt", job, "--to",
                                str(tmp_path / "dest")], capture_output=True, text=True,
                               env=train_env(tmp_path), cwd=tmp_path, timeout=180)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "note: no completion markers" in collected.stdout, collected.stdout
    assert (tmp_path / "dest" / "step8" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
