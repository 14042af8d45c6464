"""Checkpoint replicas on real namespace nodes (issue 22): a 3-node x 1-slot launch of the
bundled workload (native: the quickest start), node-local storage, ``--replicas 1``, two
saves; every node's checkpoints then have a complete copy on its ring successor, whose
manifest's sha256s are the source files' own."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from clusterkit.node import contract
from tests.helpers import train
from tests.testbed.core import Testbed

pytestmark = pytest.mark.testbed


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
                assert entry["sha256"] == _sha(held / rel), (node, rel)
                if rel == contract.LATEST_FILE:  # node 0's, as it named this tag
                    assert (held / rel).read_text().strip() == tag
                else:
                    assert entry["sha256"] == _sha(src / rel), (node, rel)
        # The agent's record (its job dir is under the shared work dir here).
        record = contract.JobDir(str(testbed.root / "work" / ".clusterkit" / "jobs" / job))
        state = json.loads(Path(record.replica_state(node)).read_text())
        assert state == {tag: {succ: "complete"} for tag in tags}, (node, state)
