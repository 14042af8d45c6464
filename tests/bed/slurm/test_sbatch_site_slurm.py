"""`clusterkit sbatch` on site setups of a real Slurm (tests/slurmbed): Slurm clients off
the default PATH, and a job dir one compute node cannot see (issue 13).

Each test is one short job (2 nodes x 1 rank, 3 steps) or no training at all.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from clusterkit.slurm.client import SlurmClient
from tests.cli import clusterkit_cli
from tests.helpers import slurm_job_dir, workload_summary
from tests.slurmbed import SlurmBed

pytestmark = [pytest.mark.slurm, pytest.mark.testbed]

WORKLOAD = ("--precision", "fp32", "--model", "tiny")
IN_PROGRESS = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")


def _wait_finished(bed: SlurmBed, slurm_id: str, timeout: float) -> tuple[str, float]:
    t0 = time.monotonic()
    while (state := bed.job_state(slurm_id)) in IN_PROGRESS:
        assert time.monotonic() - t0 < timeout, f"job {slurm_id} still {state}"
        time.sleep(0.3)
    return state, time.monotonic() - t0


# The default launcher always; the other two variants with CLUSTERKIT_EXTENDED=1.
ALL = pytest.mark.extended


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("deepspeed", marks=ALL),
                                      pytest.param("accelerate", marks=ALL)])
def test_slurm_clients_only_on_the_submitting_shells_path(slurm: SlurmBed, launcher: str) -> None:
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
        r = clusterkit_cli("sbatch", "-i", str(inv), "--nodes", "2", "--steps", "3", "--launcher",
                           launcher, "--job-id", f"sitepath-{launcher}", *WORKLOAD, "--partition",
                           "debug", "--submit", "--watch", "--poll", "0.5", env=env, timeout=400)
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
    r = clusterkit_cli("sbatch", "-i", str(inv), "--nodes", "3", "--steps", "3", "--job-id", "unseen",
                       *WORKLOAD, "--partition", "debug", env=slurm.env, timeout=60)
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



def _site_inventory(bed: SlurmBed, slots: int) -> Path:
    return bed.tb.write_inventory(bed.tb.root / f"inventory-site-{slots}.yaml", nodes=bed.nodes,
                                  slots=slots, gpus=0)


# Full trainings (minutes on 2 shared cores): only with CLUSTERKIT_EXTENDED=1.
def _run_nodes(out: str) -> list[str]:
    """The node list of each run, from the script's "===== clusterkit: ... run N on NODES" lines."""
    return re.findall(r"^===== clusterkit: job \S+ slurm=\d+ run \d+ on (\S+)", out, re.M)


@pytest.mark.slow
@ALL
def test_node_local_requeue_resumes_on_the_same_nodes_and_keeps_both_logs(slurm: SlurmBed) -> None:
    """USR1 to the batch script of a node-local job: checkpoint, requeue. While node1 is
    taken by another job the requeued run waits for it (it would otherwise start on two
    free nodes, without its shards); then it resumes there. The output file holds both
    runs."""
    job = "nl-requeue"
    inv = _site_inventory(slurm, 1)
    # Enough steps that USR1 lands mid-run, few enough to finish under load (2 shared cores).
    r = clusterkit_cli("sbatch", "-i", str(inv), "--nodes", "2", "--storage", "node-local", "--steps",
                       "60", "--job-id", job, *WORKLOAD, "--partition", "debug", "--submit", "--",
                       "--log-every", "1", env=slurm.env, timeout=60)
    assert r.returncode == 0, r.stderr
    m = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert m, r.stdout
    slurm_id = m.group(1)
    out_file = slurm_job_dir(slurm, job) / "logs" / f"slurm-{slurm_id}.out"
    deadline = time.monotonic() + 240
    while "step 2/" not in (out_file.read_text(errors="replace") if out_file.exists() else ""):
        assert time.monotonic() < deadline and slurm.job_state(slurm_id) in IN_PROGRESS
        time.sleep(0.5)
    first = _run_nodes(out_file.read_text())[0]
    # Hold the first node of the run as soon as the job lets go of it.
    first_node = slurm.client(["scontrol", "show", "hostnames", first]).stdout.split()[0]
    blocker_script = slurm.tb.root / "nl-blocker.sh"
    blocker_script.write_text("#!/bin/bash\nsleep 600\n")
    blocker = SlurmClient(env=slurm.env).submit(
        blocker_script,
        extra=[f"--nodelist={first_node}", "--exclusive", "--partition=debug",
               f"--output={slurm.tb.root / 'nl-blocker.out'}"])
    try:
        assert clusterkit_cli("sbatch", "cancel", slurm_id, "--signal", "USR1", "--batch",
                              env=slurm.env, timeout=400).returncode == 0
        # Requeued and held back by the blocker on first_node: PENDING, never RUNNING elsewhere.
        deadline = time.monotonic() + 120
        while slurm.job_state(blocker) != "RUNNING":
            assert time.monotonic() < deadline, slurm.job_state(blocker)
            state = slurm.job_state(slurm_id)
            assert state in (*IN_PROGRESS, "REQUEUED", "REQUEUE_HOLD"), state
            time.sleep(0.3)
        time.sleep(5)  # a scheduler pass or two: the requeued job must not start elsewhere
        assert slurm.job_state(slurm_id) in ("PENDING", "REQUEUED", "REQUEUE_HOLD")
    finally:
        slurm.client(["scancel", blocker], check=False)
    state, _ = _wait_finished(slurm, slurm_id, 600)
    out = out_file.read_text(errors="replace")
    assert state == "COMPLETED", out[-3000:]
    runs = _run_nodes(out)
    assert runs == [first, first], runs  # both runs in the file, on the same nodes
    summary = workload_summary(out)
    assert str(summary["resumed_from"]).startswith("global_step"), summary



def test_node_local_resubmission_on_other_nodes_stops(slurm: SlurmBed) -> None:
    """The job dir records the first run's nodes (JOBDIR/slurm_nodes, written by the script;
    here written as a first run on node[1-2] would have): a run on other nodes must not
    start afresh without its shards. Forced there by a later #SBATCH --nodelist."""
    job = "nl-moved"
    inv = _site_inventory(slurm, 1)
    r = clusterkit_cli("sbatch", "-i", str(inv), "--nodes", "2", "--storage", "node-local", "--steps",
                       "3", "--job-id", job, *WORKLOAD, "--partition", "debug",
                       "--sbatch-arg=--nodelist=node3,node4", env=slurm.env, timeout=60)
    assert r.returncode == 0, r.stderr
    job_dir = slurm_job_dir(slurm, job)
    (job_dir / "slurm_nodes").write_text("node[1-2]\n")
    slurm_id = SlurmClient(env=slurm.env).submit(job_dir / "sbatch.sh")
    state, took = _wait_finished(slurm, slurm_id, 120)
    logs = job_dir / "logs"
    err = (logs / f"slurm-{slurm_id}.err").read_text()
    out = (logs / f"slurm-{slurm_id}.out").read_text()
    assert state == "FAILED", (out[-2000:], err[-2000:])
    assert "node[3-4]" in _run_nodes(out), out[-2000:]
    lines = [ln for ln in err.splitlines() if "collect-ckpt --scatter" in ln]
    assert len(lines) == 1 and "node[1-2]" in lines[0], err
    assert "CLUSTERKIT_SUMMARY" not in out  # nothing trained
    print(f"node-local job moved to node[3-4]: FAILED {took:.1f} s after submit: {lines[0]}")
