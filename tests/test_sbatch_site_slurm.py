"""`clusterkit sbatch` on site setups of a real Slurm (tests/slurmbed): Slurm clients off
the default PATH, and a job dir one compute node cannot see (issue 13).

Each test is one short job (2 nodes x 1 rank, 3 steps) or no training at all.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time

import pytest

from clusterkit.slurm import SlurmClient
from tests.slurmbed import SlurmBed

pytestmark = [pytest.mark.slurm, pytest.mark.testbed]

WORKLOAD = ("--precision", "fp32", "--model", "tiny")
IN_PROGRESS = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")


def _cli(env: dict[str, str], args: list[str], timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterkit", "sbatch", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, check=False)


def _wait_finished(bed: SlurmBed, slurm_id: str, timeout: float) -> tuple[str, float]:
    t0 = time.monotonic()
    while (state := bed.job_state(slurm_id)) in IN_PROGRESS:
        assert time.monotonic() - t0 < timeout, f"job {slurm_id} still {state}"
        time.sleep(0.3)
    return state, time.monotonic() - t0


@pytest.mark.slow
def test_slurm_clients_only_on_the_submitting_shells_path(slurm: SlurmBed) -> None:
    with slurm.clients_off_default_path() as env:
        bin_dir = env["PATH"].split(":", 1)[0]
        # Control: the old script's `export PATH=<system dirs>` finds only the stubs.
        raw = slurm.tb.root / "path-control.sh"
        raw.write_text("#!/bin/bash\nexport PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                       "/usr/bin:/sbin:/bin\nsrun --nodes=1 true\n")
        out = slurm.tb.root / "path-control.out"
        client = SlurmClient(env=env)
        slurm_id = client.submit(raw, extra=["--nodes=1", f"--output={out}", "--partition=debug"])
        state, _ = _wait_finished(slurm, slurm_id, 60)
        assert state == "FAILED", out.read_text()
        assert "Slurm clients are in /opt/slurm/bin" in out.read_text()
        assert shutil.which("srun", path=bin_dir) is not None
        # clusterkit's script keeps the submitting shell's PATH: the job completes.
        inv = slurm.tb.write_inventory(slurm.tb.root / "inventory-sitepath.yaml",
                                       nodes=slurm.nodes, slots=1, gpus=0)
        r = _cli(env, ["-i", str(inv), "--nodes", "2", "--steps", "3", "--job-id", "sitepath",
                       *WORKLOAD, "--partition", "debug", "--submit", "--watch", "--poll", "0.5"])
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        assert "COMPLETED" in r.stderr and "CLUSTERKIT_SUMMARY" in r.stdout


def test_job_dir_one_node_cannot_see_fails_naming_it(slurm: SlurmBed) -> None:
    """The workdir on /scratch, which every test-bed node mounts privately: the files are
    copied to every node but the last, as if its mount of the shared filesystem failed."""
    tb = slurm.tb
    nodes = slurm.nodes[:3]
    work = tb.local_mountpoint / "work"  # the host's own dir; nodes see their private one
    inv = tb.write_inventory(tb.root / "inventory-scratchwork.yaml", nodes=nodes, slots=1,
                             gpus=0, workdir=str(work))
    r = _cli(slurm.env, ["-i", str(inv), "--nodes", "3", "--steps", "3", "--job-id", "unseen",
                         *WORKLOAD, "--partition", "debug"], timeout=60)
    assert r.returncode == 0, r.stderr
    job_dir = work / ".clusterkit" / "jobs" / "unseen"
    for node in nodes[:-1]:
        shutil.copytree(job_dir, tb.node_local_path(node, job_dir), dirs_exist_ok=True)
    # Pinned: the batch host (the first node) must see the job dir to open its logs.
    names = ",".join(n.name for n in nodes)
    slurm_id = SlurmClient(env=slurm.env).submit(job_dir / "sbatch.sh", extra=[f"--nodelist={names}"])
    state, took = _wait_finished(slurm, slurm_id, 60)
    head = nodes[0]
    err = tb.node_local_path(head, job_dir / "logs" / f"slurm-{slurm_id}.err").read_text()
    assert state == "FAILED", err
    lines = [ln for ln in err.splitlines() if "not visible" in ln]
    assert len(lines) == 1, err
    assert re.search(rf"\b{nodes[-1].name}\b", lines[0]), lines
    assert not any(re.search(rf"\b{n.name}\b", lines[0]) for n in nodes[:-1]), lines
    print(f"job dir unseen on {nodes[-1].name}: FAILED {took:.1f} s after submit")



def test_node_cpus_from_real_sinfo(slurm: SlurmBed) -> None:
    client = SlurmClient(env=slurm.env)
    cpus = slurm.spec.cpus_per_node
    assert client.node_cpus("debug") == cpus
    assert client.node_cpus("debug", [n.name for n in slurm.nodes[:2]]) == cpus
