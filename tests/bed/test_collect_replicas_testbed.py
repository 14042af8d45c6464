"""collect-ckpt completes a checkpoint from a replica over real SSH (issue 22): the
7-node test bed, one node's sshd stopped, its part read from its replica on the next
node (synthetic checkpoint and replicas, as the replication service leaves them)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit.checkpoints.collect.manifest import MANIFEST
from tests import synthetic_ckpt as synthetic
from tests.paths import REPO
from tests.testbed import Testbed

NODES = 7
TAG = "global_step20"

pytestmark = pytest.mark.testbed(nodes=NODES)


def test_collect_with_node6_unreachable_uses_its_replica(testbed: Testbed,
                                                         tmp_path: Path) -> None:
    testbed.ensure(NODES)
    nodes = testbed.nodes[:NODES]
    inside = f"{testbed.local_mountpoint}/c-replicas"
    roots = [str(testbed.node_local_path(n, inside)) for n in nodes]
    names = [n.name for n in nodes]
    synthetic.write_node_local(roots, zero_stage=2, shard_bytes=1 << 15, model_bytes=4096,
                               tag=TAG, hosts=names)
    synthetic.write_ring_replicas(roots, TAG, hosts=names)
    shard = Path(roots[5]) / TAG / "zero_pp_rank_10_mp_rank_00_optim_states.pt"
    want = hashlib.sha256(shard.read_bytes()).hexdigest()
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes, slots=2)
    dest = tmp_path / "dest"
    testbed.stop_sshd("node6")
    try:
        res = subprocess.run([sys.executable, "-m", "clusterkit", "collect-ckpt", "-i",
                              str(inv), "--dir", inside, "--to", str(dest)],
                             capture_output=True, text=True, timeout=300, cwd=REPO)
    finally:
        testbed.start_sshd("node6")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "node index 5 (node6): from its replica on node7 (global_step20, verified)" \
        in res.stdout, res.stdout
    assert hashlib.sha256((dest / TAG / shard.name).read_bytes()).hexdigest() == want
    assert (dest / TAG / MANIFEST).is_file()
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 14
