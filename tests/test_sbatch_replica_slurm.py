"""A node-local `clusterkit sbatch` job with `--replicas 1` survives a node lost for good
(issue 31 items 1 and 2), on a real Slurm of its own (tests/slurmbed, 5 nodes with
node-private scratch): 4 x 2 ranks, the bundled workload, ZeRO-2. Once node index 2's
part of a save is replicated on its ring successor, node3 is destroyed (its processes
killed, slurmd with them, its scratch removed) and set DOWN; Slurm requeues the job,
which runs on the other 4 nodes: the parts are moved before the ranks start (node
index 2's from its replica), and the job ends with the uninterrupted run's final loss.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterkit.node.contract import REPLICA_MANIFEST
from tests.slurmbed import SlurmBed
from tests.slurmbed.cluster import slurm_unavailable_reason
from tests.testbed import temporary

pytestmark = [pytest.mark.slurm, pytest.mark.testbed, pytest.mark.slow]

WORKLOAD = ("--precision", "fp32", "--model", "tiny", "--zero-stage", "2")
IN_PROGRESS = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING")
STEPS, SAVE_EVERY = 16, 4  # node3 is lost once step 4 is replicated: 12 steps to go
LOST = "node3"
EXTENDED = os.environ.get("CLUSTERKIT_EXTENDED") == "1"  # + the 3-node reshard (~2 min)


def _sbatch(bed: SlurmBed, inv: Path, job: str, *extra: str) -> str:
    r = subprocess.run([sys.executable, "-m", "clusterkit", "sbatch", "-i", str(inv),
                        "--nodes", "4", "--storage", "node-local",
                        "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--job-id", job,
                        *WORKLOAD, "--partition", "debug", *extra, "--submit",
                        "--", "--log-every", "1"],
                       capture_output=True, text=True, env=bed.env, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert m, r.stdout
    return m.group(1)


def _wait_end(bed: SlurmBed, slurm_id: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    while (state := bed.job_state(slurm_id)) in IN_PROGRESS or state.startswith("REQUEUE"):
        assert time.monotonic() < end, f"job {slurm_id} still {state}"
        time.sleep(1)
    return state


def _out(bed: SlurmBed, job: str, slurm_id: str, kind: str = "out") -> str:
    path = bed.tb.root / "work" / ".clusterkit" / "jobs" / job / "logs" / f"slurm-{slurm_id}.{kind}"
    return path.read_text(errors="replace") if path.exists() else ""


def _summary(bed: SlurmBed, job: str) -> dict[str, object]:
    """The workload's run/summary.json (the last run's; srun --label may cut the line)."""
    path = bed.tb.root / "work" / ".clusterkit" / "jobs" / job / "run" / "summary.json"
    return dict(json.loads(path.read_text()))


def _reshard_on_3_nodes(bed: SlurmBed, inv: Path) -> None:
    """The same job resubmitted on 3 nodes, no spare: its newest checkpoint (4 nodes) is
    gathered in the job dir, converted to DeepSpeed's universal checkpoint, copied to the
    3 nodes, and the workload resumes from it on 6 ranks and finishes."""
    r = subprocess.run([sys.executable, "-m", "clusterkit", "sbatch", "-i", str(inv), "--nodes", "3",
                        "--storage", "node-local", "--steps", str(STEPS + 4), "--save-every",
                        str(SAVE_EVERY), "--job-id", "lost", *WORKLOAD, "--partition", "debug",
                        "--replicas", "1", "--submit", "--", "--log-every", "1"],
                       capture_output=True, text=True, env=bed.env, timeout=120, check=False)
    assert r.returncode == 0 and "submitting on any 3 free nodes" in r.stderr, r.stdout + r.stderr
    slurm_id = re.search(r"submitted Slurm job (\d+)", r.stdout).group(1)  # type: ignore[union-attr]
    state = _wait_end(bed, slurm_id, 900)
    out = _out(bed, "lost", slurm_id)
    err = _out(bed, "lost", slurm_id, "err")
    if state != "COMPLETED":
        print(out[-3000:], "\n".join(ln for ln in err.splitlines() if "clusterkit" in ln
                                      or "Error" in ln)[-3000:])
    assert state == "COMPLETED"
    assert f"resharding global_step{STEPS}" in out and "converted to " in out, out[-4000:]
    got = _summary(bed, "lost")
    assert got["resumed_from"] == f"global_step{STEPS}_universal" and got["world_size"] == 6, got
    print("\n".join(ln for ln in out.splitlines() if ln.startswith("clusterkit: "))[:3000])


def test_a_lost_node_costs_a_restore_not_the_run(testbed_required: None, tmp_path: Path) -> None:
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    t0 = time.monotonic()
    with temporary(5) as tb:
        bed = SlurmBed.start(tb, 5)
        try:
            inv = tb.write_inventory(tmp_path / "inv.yaml", slots=2, gpus=0)
            ref_id = _sbatch(bed, inv, "ref")
            assert _wait_end(bed, ref_id, 600) == "COMPLETED", _out(bed, "ref", ref_id)[-3000:]
            ref = _summary(bed, "ref")
            t_ref = time.monotonic() - t0

            slurm_id = _sbatch(bed, inv, "lost", "--replicas", "1")
            # node index 2 (node3)'s first save, replicated on node4 (its ring successor).
            manifest = tb.node_local_path("node4", f"ckpt/lost.replicas/node2/global_step{SAVE_EVERY}/"
                                                    f"{REPLICA_MANIFEST}")
            end = time.monotonic() + 600
            while not manifest.exists():
                assert time.monotonic() < end and bed.job_state(slurm_id) in IN_PROGRESS, \
                    _out(bed, "lost", slurm_id)[-3000:]
                time.sleep(0.3)
            tb.destroy(LOST)  # every process of node3 (slurmd too), its scratch
            bed.client(["scontrol", "update", f"NodeName={LOST}", "State=DOWN",
                        "Reason=lost-for-good"])
            state = _wait_end(bed, slurm_id, 900)
            out, err = _out(bed, "lost", slurm_id), _out(bed, "lost", slurm_id, "err")
            assert state == "COMPLETED", (out[-4000:], err[-3000:])
            got = _summary(bed, "lost")
            # sbatch status: the checkpoints' replica health, listed through Slurm.
            status = subprocess.run([sys.executable, "-m", "clusterkit", "sbatch", "status", slurm_id],
                                    capture_output=True, text=True, env=bed.env, timeout=180,
                                    check=False)
            assert f"global_step{STEPS}: 4/4 nodes, replicated 4/4" in status.stdout, \
                status.stdout + status.stderr
            status = subprocess.run([sys.executable, "-m", "clusterkit", "status", "lost"],
                                    capture_output=True, text=True, env=bed.env, timeout=180,
                                    check=False)
            assert f"global_step{STEPS}: 4/4 nodes, replicated 4/4" in status.stdout, \
                status.stdout + status.stderr
            if EXTENDED:
                _reshard_on_3_nodes(bed, inv)
        finally:
            bed.stop()
    runs = re.findall(r"^===== clusterkit: job lost slurm=\d+ run \d+ on (\S+)", out, re.M)
    assert runs[0] == "node[1-4]" and runs[-1] == "node[1-2,4-5]", runs
    assert "node index 2 (was node3) -> node4: from its replica on node4" in out, out[-4000:]
    assert re.search(r"restored global_step\d+'s node index 2 part onto node4", out), out[-4000:]
    assert str(got["resumed_from"]).startswith("global_step"), got
    assert got["world_size"] == 8
    assert got["final_loss"] == ref["final_loss"], (got, ref)
    print(f"reference run {t_ref:.0f} s; lost-node run to COMPLETED {time.monotonic() - t0 - t_ref:.0f} s "
          f"(load {os.getloadavg()[0]:.1f}); resumed from {got['resumed_from']}")
    print("\n".join(ln for ln in out.splitlines() if ln.startswith("clusterkit: ")
                    and "step" not in ln[:20])[:3000])


TRAIN = Path(__file__).resolve().parent.parent / "docs" / "examples" / "train.py"


@pytest.mark.extended
def test_a_user_script_survives_a_lost_node_and_goes_on_on_fewer(testbed_required: None,
                                                                  tmp_path: Path) -> None:
    """The same with a user's own script (docs/examples/train.py, no markers), 4 x 1:
    node3 lost after its step4 part is replicated; Slurm's requeue restores it onto node5
    and the job finishes; submitted again on 3 nodes, its newest checkpoint is resharded
    and the script loads $CLUSTERKIT_RESUME_TAG with load_universal on, and finishes."""
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)

    def submit(bed: SlurmBed, inv: Path, nodes: int, steps: int, *extra: str) -> str:
        r = subprocess.run([sys.executable, "-m", "clusterkit", "sbatch", "-i", str(inv),
                            "--nodes", str(nodes), "--storage", "node-local", "--zero-stage", "2",
                            "--job-id", "user", "--partition", "debug", "--replicas", "1",
                            *extra, "--submit", str(TRAIN), "--steps", str(steps),
                            "--save-every", "4"],
                           capture_output=True, text=True, env=bed.env, timeout=120, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        return re.search(r"submitted Slurm job (\d+)", r.stdout).group(1)  # type: ignore[union-attr]

    with temporary(5) as tb:
        bed = SlurmBed.start(tb, 5)
        try:
            inv = tb.write_inventory(tmp_path / "inv.yaml", slots=1, gpus=0)
            slurm_id = submit(bed, inv, 4, 16)
            manifest = tb.node_local_path("node4", f"ckpt/user.replicas/node2/step4/{REPLICA_MANIFEST}")
            end = time.monotonic() + 600
            while not manifest.exists():
                assert time.monotonic() < end and bed.job_state(slurm_id) in IN_PROGRESS, \
                    _out(bed, "user", slurm_id)[-3000:]
                time.sleep(0.3)
            tb.destroy(LOST)
            bed.client(["scontrol", "update", f"NodeName={LOST}", "State=DOWN", "Reason=lost"])
            state = _wait_end(bed, slurm_id, 900)
            out = _out(bed, "user", slurm_id)
            assert state == "COMPLETED", (out[-3000:], _out(bed, "user", slurm_id, "err")[-3000:])
            assert "node index 2 (was node3) -> node4: from its replica on node4" in out, out[-3000:]
            again = submit(bed, inv, 3, 20)
            state = _wait_end(bed, again, 900)
            out = _out(bed, "user", again)
            err = _out(bed, "user", again, "err")
            if state != "COMPLETED":
                print(out[-3000:], "\n".join(ln for ln in err.splitlines() if "clusterkit" in ln
                                              or "Error" in ln)[-3000:])
            assert state == "COMPLETED"
            # train.py saves every 4 steps but not at its last (16): step12 is the newest.
            assert "resumed from step12_universal at step 12 on 3 ranks" in out, out[-3000:]
            assert "world size 4 -> 3" in out, out[-3000:]
            print("\n".join(ln for ln in out.splitlines() if ln.startswith("clusterkit: "))[:3000])
        finally:
            bed.stop()
