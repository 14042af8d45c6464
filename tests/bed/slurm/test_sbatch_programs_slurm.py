"""A Hugging Face Trainer program under ``clusterkit sbatch``, requeued, resumes (issue 38,
the batch script's half of "Restarts resume") on the REAL Slurm test bed.

tests/programs/hf_trainer.py (run_clm.py-style, unmodified in what clusterkit touches),
2 nodes x 1 CPU rank, node-local checkpoints in the job's dir (``--output_dir``), ZeRO-2
with the user's all-``"auto"`` ds_config, ``--hang-timeout 20 --max-restarts 1``. Rank 1
hangs at step 16 (after checkpoint-10 and the step-15 log); the batch script's watchdog
ends the step and requeues the job (pinned: node-local, no replicas). The requeued run,
on the same nodes, is readied as a launch's restart: its ``plan`` step finds
checkpoint-10 complete on both nodes, the ``ready`` step writes DeepSpeed's
``checkpoint-10/latest`` on node2 (global rank 0 wrote it on node1 only), and the
program gets ``--resume_from_checkpoint <ckpt>/checkpoint-10``. Before this, the
requeued run began at step 0 (no resume argument) and ended COMPLETED.

Proved inside the job, no reference run: HF says it resumed from global step 10, and the
resumed run's step-15 loss equals, in full, what the first run logged for it
(helpers.attempts_agree); it trains on to step 20 and the job COMPLETES.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.cli import clusterkit_cli
from tests.helpers import HF_DS_AUTO, HF_TRAINER, IN_PROGRESS, attempts_agree, slurm_job_dir
from tests.slurmbed import SlurmBed

pytestmark = [pytest.mark.slurm, pytest.mark.testbed, pytest.mark.slow]

STEPS = 20
EXACT = re.compile(r"exact loss at step (\d+): (\S+)")
RESUMED = re.compile(r"Resuming training from checkpoint with epoch \d+ and global step 10\b"
                     r"|Continuing training from global step 10\b")


def _submit_hf_job(bed: SlurmBed, job: str) -> str:
    root = bed.tb.root
    inv = bed.tb.write_inventory(root / "inventory-hf.yaml", nodes=bed.nodes, slots=1, gpus=0)
    ds = root / "ds_config_z2.json"
    ds.write_text(json.dumps(HF_DS_AUTO, indent=1))
    out_dir = str(bed.tb.local_mountpoint / "ckpt" / job)  # the job's checkpoint dir
    marker = root / f"{job}-hung"
    args = ["--output_dir", out_dir, "--deepspeed", str(ds), "--use_cpu", "--max_steps",
            str(STEPS), "--save_steps", "10", "--logging_steps", "5",
            "--per_device_train_batch_size", "4", "--report_to", "none", "--learning_rate",
            "1e-3", "--seed", "7", "--exact_losses", "True", "--crash_at_step", "16",
            "--crash_rank", "1", "--crash_once", str(marker), "--crash_how", "hang"]
    r = clusterkit_cli("sbatch", "-i", str(inv), "--nodes", "2", "--gpus-per-node", "1",
                       "--storage", "node-local", "--job-id", job, "--partition", "debug",
                       "--hang-timeout", "20", "--max-restarts", "1", "--submit",
                       str(HF_TRAINER), *args, env=bed.env, timeout=120)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "program profile: hf-trainer" in r.stdout + r.stderr, r.stdout + r.stderr
    m = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert m, r.stdout
    return m.group(1)


def test_hf_trainer_requeued_after_a_hang_resumes_from_its_checkpoint(slurm: SlurmBed) -> None:
    job = "hf-requeue"
    slurm_id = _submit_hf_job(slurm, job)
    deadline = time.monotonic() + 600
    while (state := slurm.job_state(slurm_id)) in IN_PROGRESS or state.startswith("REQUEUE"):
        assert time.monotonic() < deadline, f"job {slurm_id} still {state}"
        time.sleep(1)
    logs = slurm_job_dir(slurm, job) / "logs"
    out = (logs / f"slurm-{slurm_id}.out").read_text(errors="replace")
    err = (logs / f"slurm-{slurm_id}.err").read_text(errors="replace")
    text = out + err
    if state != "COMPLETED":
        print(out[-6000:], "\n".join(ln for ln in err.splitlines()
                                    if "clusterkit" in ln or "Error" in ln or "=====" in ln)[-6000:])
    assert state == "COMPLETED", state
    runs = re.findall(rf"===== clusterkit: job {job} slurm={slurm_id} run (\d) on (\S+) ", out)
    assert [n for n, _ in runs] == ["1", "2"] and runs[0][1] == runs[1][1], runs
    assert "hf-trainer: resuming from checkpoint-10, the newest checkpoint complete on every " \
           "node (--resume_from_checkpoint " in out, out[-5000:]
    assert re.search(r"clusterkit: node\d+: checkpoint-10/latest -> global_step10", out), out[-5000:]
    assert RESUMED.search(text), text[-5000:]
    # step 15 logged by the first run (before the hang) and by the resumed one, in full
    attempts_agree([(int(s), loss) for s, loss in EXACT.findall(text)], [15])
    assert max(int(s) for s, _ in EXACT.findall(text)) == STEPS
    first_run = text.split(f"run 2 on {runs[1][1]}", 1)[0]
    assert "resuming from checkpoint-10" not in first_run
