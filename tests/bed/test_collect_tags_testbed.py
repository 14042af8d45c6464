"""status and collect-ckpt give one answer with a node's disk wiped (issue 38 item 4),
over real SSH on the test bed: an HF Trainer-style save (``checkpoint-N/`` with
DeepSpeed's ``global_stepN/`` inside, no markers) on 3 nodes x 2 ranks with a replica of
each node's part on the next node, then node2's checkpoint dir removed. Before, status
said ``complete from replicas`` while ``collect-ckpt JOB`` exited 2 (``checkpoint ?
cannot be collected ... node2: checkpoint directory ... does not exist``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from clusterkit.launch.registry import JobRecord, NodeRecord, Registry
from clusterkit.spec.jobrecord import JobCheckpoints
from tests import synthetic_ckpt as synthetic
from tests.cli import clusterkit_cli, home_env
from tests.paths import REPO
from tests.testbed import Testbed

NODES = 3
JOB = "ck-tags-1"

pytestmark = pytest.mark.testbed(nodes=NODES)


def test_status_and_collect_agree_with_a_node_disk_wiped(testbed: Testbed,
                                                        tmp_path: Path) -> None:
    testbed.ensure(NODES)
    nodes = testbed.nodes[:NODES]
    inside = f"{testbed.local_mountpoint}/c-tags"
    roots = [str(testbed.node_local_path(n, inside)) for n in nodes]
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)
    for step in (30, 50):
        tag = synthetic.write_hf_save(roots, step)
        synthetic.write_ring_replicas(roots, tag, hosts=[n.name for n in nodes])
    home = tmp_path / "home"
    record = JobRecord(job_id=JOB, backend="torchrun", created=0.0, launcher_pid=0,
                       state="succeeded",
                       nodes=[NodeRecord(n.name, testbed.node_python(), f"{inside}-jobdir",
                                         testbed.ssh_target(n)) for n in nodes])
    record.ckpt = JobCheckpoints.from_dict({
        "dirs": {n.name: inside for n in nodes}, "storage": "node-local", "slots": [2] * NODES,
        "rank_map": [[n.name, 2 * i, 2] for i, n in enumerate(nodes)], "markers": False})
    Registry(home).save(record)
    shutil.rmtree(roots[1])  # node2's /scratch wiped

    status = clusterkit_cli("status", JOB, cwd=REPO, env=home_env(home))
    assert status.returncode == 0, status.stdout + status.stderr
    assert "checkpoint-50: 2/3 nodes, replicated 3/3; complete from replicas" in status.stdout, \
        status.stdout
    dest = tmp_path / "dest"
    res = clusterkit_cli("collect-ckpt", JOB, "--to", str(dest), cwd=REPO, env=home_env(home))  # no --tag
    assert res.returncode == 0, res.stdout + res.stderr
    assert "checkpoint checkpoint-50: step 50," in res.stdout, res.stdout
    assert "node index 1 (node2): from its replica on node3 (checkpoint-50, verified)" \
        in res.stdout, res.stdout
    assert len(list((dest / "checkpoint-50" / "global_step50").glob("*_optim_states.pt"))) == 6
