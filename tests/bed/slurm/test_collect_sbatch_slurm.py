"""collect-ckpt of a finished node-local `clusterkit sbatch` job on the REAL Slurm test bed
(tests/slurmbed), through Slurm only: sshd is stopped on the job's nodes and ``ssh``
on PATH is a stand-in that records any call, so an SSH attempt fails the test.

One small job (2 nodes x 1 rank, 3 steps of the bundled workload, node-local
checkpoints) is collected twice: by clusterkit's job id (and consolidated) and by
Slurm's (issue 37 item 6: consolidated once, not twice: the second consolidation
was a torch + DeepSpeed start and the same load of the same files; what differs
between the two keys is the lookup and the collection, both still checked); no
allocation is left behind; then a node marked DOWN is named in one line.
The fake-srun unit tests are in tests/process/test_collect_slurm.py.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from tests.cli import clusterkit_cli
from tests.slurmbed import SlurmBed

pytestmark = [pytest.mark.slurm, pytest.mark.testbed]

JOB = "ckcollect"
STEPS = 3


@pytest.mark.slow
def test_collect_finished_node_local_job_through_slurm(slurm: SlurmBed, tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(f"#!/bin/sh\necho \"ssh $*\" >> {tmp_path}/ssh.log\nexit 255\n")
    (fake / "ssh").chmod(stat.S_IRWXU)
    env = {**slurm.env, "CLUSTERKIT_HOME": str(tmp_path / "home"),
           "PATH": f"{fake}:{slurm.env['PATH']}"}
    inv = slurm.tb.write_inventory(tmp_path / "inv.yaml", nodes=slurm.nodes, slots=2, gpus=2)
    r = clusterkit_cli("sbatch", "-i", str(inv), "--nodes", "2", "--gpus-per-node", "1", "--storage",
                       "node-local", "--steps", str(STEPS), "--job-id", JOB, "--precision", "fp32",
                       "--model", "tiny", "--submit", "--watch", "--poll", "0.5", env=env, timeout=500)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    m = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert m, r.stdout
    slurm_id = m.group(1)
    nodes = (slurm.tb.root / "work" / ".clusterkit" / "jobs" / JOB / "slurm_nodes").read_text()
    assert nodes.strip() == "node[1-2]"
    tag = f"global_step{STEPS}"
    stopped = slurm.nodes[:2]
    for node in stopped:
        slurm.tb.stop_sshd(node)
    try:
        for key, dest, consolidate in ((JOB, tmp_path / "by-id", True),
                                       (slurm_id, tmp_path / "by-slurm-id", False)):
            r = clusterkit_cli("collect-ckpt", key, "--to", str(dest),
                               *(("--consolidate", "fp32") if consolidate else ()), env=env,
                               timeout=300)
            assert r.returncode == 0, (key, r.stdout[-3000:], r.stderr[-3000:])
            assert f"job {JOB} (Slurm job {slurm_id}, COMPLETED): collecting" in r.stdout
            assert "node[1-2] through Slurm, a one-task allocation on each node" in r.stdout
            assert "via slurm (a socket per node)" in r.stdout, r.stdout  # not srun's stdout
            assert len(list((dest / tag).glob("*_optim_states.pt"))) == 2
            assert ("loads strictly into clusterkit.workload GPT(tiny)" in r.stdout) is consolidate, \
                r.stdout
            print(r.stdout)
        slurm.wait_all_jobs_gone(timeout=30)  # every one-task allocation was given back
        # A node Slurm has down: one line at once, naming it (srun alone waits, then says "busy").
        slurm.client(["scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=ck-test"])
        r = clusterkit_cli("collect-ckpt", JOB, "--to", str(tmp_path / "down"), env=env, timeout=60)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "node2 down (reason: ck-test)" in r.stderr and "State=RESUME" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        slurm.client(["scontrol", "update", "NodeName=node2", "State=RESUME"], check=False)
        for node in stopped:
            slurm.tb.start_sshd(node)
        slurm.wait_nodes_idle(timeout=60)
    assert not (tmp_path / "ssh.log").exists(), (tmp_path / "ssh.log").read_text()
