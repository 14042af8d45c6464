"""The programs people run under ``clusterkit sbatch``, run again after a failure, resume
(issue 38, the batch script's half of "Restarts resume") on the REAL Slurm test bed: 2
nodes x 1 CPU rank, node-local checkpoints in the job's dir. The run after the failure,
on the same nodes, is readied as a launch's restart (its ``plan`` and ``ready`` steps).
Proved inside the jobs, no reference run: the repeated step's (epoch's) loss equals, in
full, what the failed run logged for it (helpers.attempts_agree), and the job COMPLETES.

* HF Trainer (tests/programs/hf_trainer.py, run_clm.py-style), ZeRO-2 with the user's
  all-``"auto"`` ds_config: a rank killed; the same job submitted again by hand.
* extended: HF Trainer, which does not save on SIGUSR1: the time limit's USR1 (``scancel
  --signal=USR1 --batch``) after checkpoint-10 ends the step and requeues the job (row
  ``stop-end-step``), and the requeued run resumes from checkpoint-10.
* extended: pytorch's DDP tutorial on 3 nodes, a rank killed; the same job submitted
  again with ``--nodes 2`` goes on as it is (the snapshot copied from rank 0's node to
  the other node of the new allocation, nothing converted).
* extended: HF Trainer on 3 nodes, a rank killed; the same job submitted again with
  ``--nodes 2`` has checkpoint-10 converted inside its tag dir (DeepSpeed's universal
  checkpoint beside global_step10, load_universal in the derived config for that run)
  and resumes from it on 2 ranks; the same with accelerate (step_10/pytorch_model
  converted in its place, each node's own kept as pytorch_model.set-aside).
* extended: pytorch's DDP tutorial (tests/programs/ddp_snapshot.py), a rank hung; the
  hang watchdog requeues the job (``--hang-timeout 15 --max-restarts 1``, pinned:
  node-local, no replicas) and rank 0's snapshot.pt is copied from node1 to node2 before
  the ranks start, so both ranks resume at one epoch.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli import CLI, clusterkit_cli
from tests.helpers import (
    EXIT_ABORT,
    HF_DS_AUTO,
    HF_TRAINER,
    IN_PROGRESS,
    attempts_agree,
    slurm_job_dir,
)
from tests.paths import REPO
from tests.slurmbed import SlurmBed
from tests.slurmbed.fixtures import user_slurm_bed
from tests.testbed.users import assert_owned_by_user

pytestmark = [pytest.mark.slurm, pytest.mark.testbed, pytest.mark.slow]

STEPS = 20
USER = "ckslurm"  # the unprivileged user of the extended test's own bed
EXACT = re.compile(r"exact loss at step (\d+): (\S+)")
RESUMED = re.compile(r"Resuming training from checkpoint with epoch \d+ and global step 10\b"
                     r"|Continuing training from global step 10\b")


def _submit_program(bed: SlurmBed, job: str, program: list[str], *flags: str,
                    nodes: int = 2) -> str:
    """``clusterkit sbatch`` of a user's program on ``nodes`` nodes x 1 CPU rank, node-local."""
    inv = bed.tb.write_inventory(bed.tb.root / "inventory-programs.yaml", nodes=bed.nodes,
                                 slots=1, gpus=0)
    r = clusterkit_cli("sbatch", "-i", str(inv), "--nodes", str(nodes), "--gpus-per-node", "1",
                       "--storage", "node-local", "--job-id", job, "--partition", "debug",
                       *flags, "--submit", *program, env=bed.env, timeout=120)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    m = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert m, r.stdout
    return m.group(1)


def _job_output(bed: SlurmBed, job: str, slurm_id: str, job_dir: Path | None = None
                ) -> tuple[str, str, str]:
    """Wait for the job's end: (its state, .out, .err); ``job_dir``: another submitter's."""
    deadline = time.monotonic() + 600
    while (state := bed.job_state(slurm_id)) in IN_PROGRESS or state.startswith("REQUEUE"):
        assert time.monotonic() < deadline, f"job {slurm_id} still {state}"
        time.sleep(1)
    logs = (job_dir or slurm_job_dir(bed, job)) / "logs"
    return (state, (logs / f"slurm-{slurm_id}.out").read_text(errors="replace"),
            (logs / f"slurm-{slurm_id}.err").read_text(errors="replace"))


def _completed_or_exit_abort(state: str, out: str, err: str, done: str) -> None:
    """It COMPLETED; ``done``: what the program prints last: a job that FAILED only by
    torch 2.13's gloo abort at interpreter exit after that (helpers.EXIT_ABORT,
    docs/launch.md: about 1 run in 12; the work is done) counts."""
    if state == "FAILED" and EXIT_ABORT in err and done in out + err:
        print("torch's exit-time abort after the work was done (counted)")
    elif state != "COMPLETED":
        print(out[-6000:], err[-20000:])
        assert state == "COMPLETED", state


def test_hf_trainer_killed_then_submitted_again_resumes_from_its_checkpoint(
        slurm: SlurmBed) -> None:
    """Rank 1 killed (SIGKILL) at step 16, after checkpoint-10 and the step-15 log: a rank
    that fails ends the batch job (no requeue: docs/sbatch.md), FAILED with that rank's
    status. The user submits the same job again, unchanged: it goes to the recorded
    nodes, its plan step finds checkpoint-10 complete on both, the ready step writes
    DeepSpeed's ``checkpoint-10/latest`` on node2 (global rank 0 wrote it on node1 only),
    and the program gets ``--resume_from_checkpoint <ckpt>/checkpoint-10``; before this,
    the second job began at step 0 and ended COMPLETED."""
    inv = slurm.tb.write_inventory(slurm.tb.root / "inventory-programs.yaml", nodes=slurm.nodes,
                                   slots=1, gpus=0)
    _killed_then_submitted_again(slurm, inv, slurm.tb.root, slurm.tb.local_mountpoint / "ckpt",
                                 slurm_job_dir(slurm, "hf-again"), slurm.env, None)


# ~1.5 minutes (a Slurm of its own for the user's bed): extended.
@pytest.mark.extended
def test_hf_trainer_as_a_user_killed_then_submitted_again_resumes(testbed_required: None
                                                                  ) -> None:
    """The same as the test bed's unprivileged user (its own bed and Slurm: the batch
    script, its steps and the ranks are the user's): the user's checkpoint dir on each
    node, the user's job dir; what the job wrote on the nodes is the user's."""
    with user_slurm_bed(USER, slots=1) as (bed, inv):
        user = bed.tb.user
        assert user is not None
        ckpt = user.local_dir / "ckpt"
        _killed_then_submitted_again(bed, inv, user.home, ckpt,
                                     user.workdir / ".clusterkit" / "jobs" / "hf-again",
                                     bed.user_env, bed.tb.user_argv)
        assert_owned_by_user(user, [p for n in bed.nodes for p in
                                    bed.tb.node_local_path(n, f"{USER}/ckpt/hf-again").rglob("*")])


def _killed_then_submitted_again(bed: SlurmBed, inv: Path, home: Path, ckpt: Path,
                                 job_dir: Path, env: dict[str, str],
                                 as_user: Callable[[list[str]], list[str]] | None) -> None:
    """The HF job of the two tests above, submitted from ``home`` (its ds_config there,
    its checkpoints in ``ckpt`` on each node), twice; ``as_user``: the bed's user's argv."""
    job = "hf-again"
    ds = home / "ds_config_z2.json"
    ds.write_text(json.dumps(HF_DS_AUTO, indent=1))
    ds.chmod(0o644)
    program = [
        str(HF_TRAINER), "--output_dir", str(ckpt / job), "--deepspeed", str(ds), "--use_cpu",
        "--max_steps", str(STEPS), "--save_steps", "10", "--logging_steps", "5",
        "--per_device_train_batch_size", "4", "--report_to", "none", "--learning_rate", "1e-3",
        "--seed", "7", "--exact_losses", "True", "--crash_at_step", "16", "--crash_rank", "1",
        "--crash_once", str(home / f"{job}-killed")]

    def submit() -> str:
        argv = [*CLI, "sbatch", "-i", str(inv), "--nodes", "2",
                "--gpus-per-node", "1", "--storage", "node-local", "--job-id", job,
                "--partition", "debug", "--submit", *program]
        r = subprocess.run(as_user(argv) if as_user else argv, capture_output=True, text=True,
                           env=env, cwd=home, timeout=120, check=False)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        m = re.search(r"submitted Slurm job (\d+)", r.stdout)
        assert m, r.stdout
        return m.group(1)

    state, first, err = _job_output(bed, job, submit(), job_dir)
    assert state == "FAILED", (state, first[-3000:], err[-3000:])
    assert "killed by signal 9" in err, err[-3000:]
    assert "resuming from" not in first  # the first run had nothing to resume from
    state, out, err = _job_output(bed, job, submit(), job_dir)
    _completed_or_exit_abort(state, out, err, f"final loss at step {STEPS}:")
    assert "hf-trainer: resuming from checkpoint-10, the newest checkpoint complete on every " \
           "node (--resume_from_checkpoint " in out, out[-5000:]
    assert re.search(r"clusterkit: node\d+: checkpoint-10/latest -> global_step10", out), out[-5000:]
    assert RESUMED.search(out + err), (out + err)[-5000:]
    # step 15 logged by the killed job and by the resumed one, in full
    attempts_agree([(int(s), loss) for text in (first, out) for s, loss in EXACT.findall(text)],
                   [15])
    assert max(int(s) for s, _ in EXACT.findall(out)) == STEPS


def _hf_program(bed: SlurmBed, job: str, *extra: str) -> list[str]:
    ds = bed.tb.root / "ds_config_z2.json"
    ds.write_text(json.dumps(HF_DS_AUTO, indent=1))
    out_dir = str(bed.tb.local_mountpoint / "ckpt" / job)  # the job's checkpoint dir
    return [str(HF_TRAINER), "--output_dir", out_dir, "--deepspeed", str(ds), "--use_cpu",
            "--max_steps", str(STEPS), "--save_steps", "10", "--per_device_train_batch_size", "4",
            "--report_to", "none", "--learning_rate", "1e-3", "--seed", "7",
            "--exact_losses", "True", *extra]


# ~2 minutes of HF on 2 cores; the decision itself is tested without Slurm
# (test_slurm_end_rules.py, test_sbatch_units.py's stop-end-step and stop-run-on).
@pytest.mark.extended
def test_hf_trainer_at_the_time_limit_warning_is_requeued_and_resumes(slurm: SlurmBed) -> None:
    """HF Trainer ignores SIGUSR1. Once rank 0 logged step 12 (each step logged, 2 s each:
    both ranks finished saving checkpoint-10 before step 11's gradients), USR1 to the batch
    script, as Slurm's ``--signal=B:USR1@90`` sends: the script asks no rank to save, sees
    checkpoint-10 written since the run began on its node, ends the step and requeues the
    job (pinned: node-local, no replicas); the second run resumes from checkpoint-10 (the
    steps after it are trained again, with the same losses) and the job COMPLETES."""
    job = "hf-usr1"
    program = _hf_program(slurm, job, "--logging_steps", "1", "--step_sleep", "2")
    slurm_id = _submit_program(slurm, job, program)
    logs = slurm_job_dir(slurm, job) / "logs"
    deadline = time.monotonic() + 400
    while "exact loss at step 12:" not in _text(logs / f"slurm-{slurm_id}.out"):
        assert time.monotonic() < deadline and slurm.job_state(slurm_id) in IN_PROGRESS, \
            _text(logs / f"slurm-{slurm_id}.err")[-5000:]
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", slurm_id], env=slurm.env, check=True,
                   timeout=30)
    state, out, err = _job_output(slurm, job, slurm_id)
    _completed_or_exit_abort(state, out, err, f"final loss at step {STEPS}:")
    runs = re.findall(rf"===== clusterkit: job {job} slurm={slurm_id} run (\d) on (\S+) ", out)
    assert [n for n, _ in runs] == ["1", "2"] and runs[0][1] == runs[1][1], runs
    first, second = out.split(f"slurm={slurm_id} run 2 ", 1)
    assert "asking every rank to save" not in out, out[-5000:]
    # every node listed at USR1: checkpoint-10 is complete on both (node-local)
    assert ("this program (hf-trainer) does not save on SIGUSR1; it saved checkpoint "
            "checkpoint-10 (complete on every node) since this run began: ending the step"
            in first), first[-5000:]
    assert "the steps since that save are lost" in first and "the steps since that save are lost" in err
    assert "hf-trainer: resuming from checkpoint-10, the newest checkpoint complete on every " \
           "node (--resume_from_checkpoint " in second, second[-5000:]
    assert RESUMED.search(second + err), (second + err)[-5000:]
    logged = [(int(s), loss) for text in (first, second) for s, loss in EXACT.findall(text)]
    lost = [int(s) for s, _ in EXACT.findall(first) if int(s) > 10]  # ended before the save of 20
    assert lost[:2] == [11, 12] and max(lost) < STEPS, lost
    attempts_agree(logged, lost)  # trained again after the resume, the same losses
    assert max(int(s) for s, _ in EXACT.findall(second)) == STEPS


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


DDP = REPO / "tests" / "programs" / "ddp_snapshot.py"
EPOCH_LOSS = re.compile(r"epoch (\d+) loss ([0-9.]+)")
EPOCHS = 8


# ~50 s more of the suite's 12 minutes: the default run has the snapshot's copy on three
# nodes at once against one plan (tests/process/test_slurm_resume.py), the batch
# script's readiness end to end in the HF job above, and the hang requeue in
# test_sbatch_user_slurm.py; this job is the extended variant.
@pytest.mark.extended
def test_ddp_snapshot_requeued_after_a_hang_resumes_on_every_node(slurm: SlurmBed) -> None:
    """pytorch's DDP tutorial (CPU): rank 0 saves snapshot.pt every 2 epochs on node1 only;
    rank 1 hangs after epoch 5 (logged; the newest snapshot is epoch 4's). The requeued
    run's plan step copies snapshot.pt from node1 to node2 (sha256 checked) before the
    ranks start, so both resume at epoch 5 and its loss equals the first run's."""
    job = "ddp-requeue"
    snap = str(slurm.tb.local_mountpoint / "ckpt" / job / "snapshot.pt")
    slurm_id = _submit_program(slurm, job, [
        str(DDP), str(EPOCHS), "2", "--snapshot_path", snap, "--crash_at_epoch", "5",
        "--crash_rank", "1", "--crash_once", str(slurm.tb.root / f"{job}-hung"),
        "--crash_how", "hang"], "--hang-timeout", "15", "--max-restarts", "1")
    state, out, err = _job_output(slurm, job, slurm_id)
    _completed_or_exit_abort(state, out, err, f"epoch {EPOCHS - 1} loss")
    runs = re.findall(rf"===== clusterkit: job {job} slurm={slurm_id} run (\d) on (\S+) ", out)
    assert [n for n, _ in runs] == ["1", "2"] and runs[0][1] == runs[1][1], runs
    text = out + err
    assert re.search(r"clusterkit: snapshot\.pt: written by node\d+ only; copied to node\d+ "
                     r"\(sha256 verified\) before the ranks start", out), out[-5000:]
    assert re.search(r"clusterkit: node\d+: snapshot\.pt: copied from node\d+ \(sha256 "
                     r"verified\)", out), out[-5000:]
    assert text.count("Resuming training from snapshot at Epoch 5") == 2, text[-5000:]  # both ranks
    logged = [(int(e), loss) for e, loss in EPOCH_LOSS.findall(text)]
    attempts_agree(logged, [5])
    assert logged[-1][0] == EPOCHS - 1, logged


SNAP_RESUMED = re.compile(r"Resuming training from snapshot at Epoch (\d+)")


@pytest.mark.extended
def test_ddp_snapshot_submitted_again_on_fewer_nodes_goes_on_as_it_is(slurm: SlurmBed) -> None:
    """pytorch's DDP tutorial (CPU) on 3 nodes: rank 0 saves snapshot.pt every 2 epochs on
    its own node; rank 1 killed at epoch 5 ends the job (FAILED). Submitted again with
    ``--nodes 2``: clusterkit puts rank 0's node in the node list, the plan step converts
    nothing and copies snapshot.pt to the other node (sha256 checked), and both ranks of
    the smaller world resume at the same epoch and finish."""
    job = "ddp-fewer"
    snap = str(slurm.tb.local_mountpoint / "ckpt" / job / "snapshot.pt")
    program = [str(DDP), str(EPOCHS), "2", "--snapshot_path", snap, "--crash_at_epoch", "5",
               "--crash_rank", "1", "--crash_once", str(slurm.tb.root / f"{job}-killed")]
    state, first, err = _job_output(slurm, job, _submit_program(slurm, job, program, nodes=3))
    assert state == "FAILED", (state, first[-3000:], err[-3000:])
    state, out, err = _job_output(slurm, job, _submit_program(slurm, job, program, nodes=2))
    _completed_or_exit_abort(state, out, err, f"epoch {EPOCHS - 1} loss")
    assert re.search(r"this run got 2 nodes, \S+; the checkpoint was saved on 3, \S+: it "
                     r"loads on any world size as it is", out), out[-5000:]
    assert re.search(r"clusterkit: node\d+: snapshot\.pt: copied from node\d+ \(sha256 "
                     r"verified\)", out), out[-5000:]
    resumed = SNAP_RESUMED.findall(out + err)
    assert len(resumed) == 2 and len(set(resumed)) == 1 and int(resumed[0]) > 0, resumed
    assert max(int(e) for e, _ in EPOCH_LOSS.findall(out + err)) == EPOCHS - 1


@pytest.mark.extended
def test_hf_trainer_submitted_again_on_fewer_nodes_is_converted_and_resumes(
        slurm: SlurmBed) -> None:
    """HF Trainer on 3 nodes, node-local, --replicas 1 (every node's part of a save also on
    its ring successor), the user's all-"auto" ds_config (clusterkit derives its own copy):
    rank 1 killed at step 16, after checkpoint-10 -> FAILED. Submitted again with
    ``--nodes 2``: the plan step reshards checkpoint-10 (3 parts from the 2 nodes, the third
    from its replica), the conversion step converts global_step10 beside itself
    (checkpoint-10/global_step10_universal, latest_universal) with load_universal on in the
    derived config for that run, every node gets the tag dir, HF resumes from checkpoint-10
    on 2 ranks with finite losses and the job COMPLETES; the derived config is plain again
    after it (the run's .plain put back at its end)."""
    job = "hf-fewer"
    # 2 s a step: the copies (the lowest CPU priority) of checkpoint-10 are made before the kill
    program = _hf_program(slurm, job, "--logging_steps", "5", "--step_sleep", "2",
                          "--crash_at_step", "16", "--crash_rank", "1",
                          "--crash_once", str(slurm.tb.root / f"{job}-killed"))
    out, err = _killed_on_3_then_on_2(slurm, job, program)
    said = _resharded(out, "checkpoint-10")
    assert "converted to checkpoint-10_universal in " in out, said
    assert ("world size 3 -> 2: DeepSpeed loads checkpoint-10/global_step10_universal "
            "(latest_universal) with checkpoint.load_universal on in ds_config.program.json, "
            "this run only") in out, said
    assert "every node holds checkpoint-10/global_step10_universal: resuming from it on 2 " \
           "ranks" in out, said
    assert "hf-trainer: resuming from checkpoint-10, the newest checkpoint complete on every " \
           "node (--resume_from_checkpoint " in out, said
    assert RESUMED.search(out + err), (out + err)[-5000:]
    losses = [(int(s), float(loss)) for s, loss in EXACT.findall(out)]
    assert losses and min(s for s, _ in losses) > 10 and max(s for s, _ in losses) == STEPS, losses
    assert all(math.isfinite(loss) for _, loss in losses), losses
    derived = slurm_job_dir(slurm, job) / "ds_config.program.json"
    assert "load_universal" not in derived.read_text()
    assert not derived.with_name(derived.name + ".plain").exists()


def _killed_on_3_then_on_2(bed: SlurmBed, job: str, program: list[str]) -> tuple[str, str]:
    """``program`` submitted on 3 nodes with --replicas 1 (a rank of it killed: FAILED),
    then again with ``--nodes 2``, which completed: that job's (.out, .err)."""
    state, first, err = _job_output(bed, job, _submit_program(bed, job, program, "--replicas",
                                                              "1", nodes=3))
    assert state == "FAILED", (state, first[-3000:], err[-3000:])
    assert "killed by signal 9" in err, err[-3000:]
    state, out, err = _job_output(bed, job, _submit_program(bed, job, program, "--replicas", "1",
                                                            nodes=2))
    _completed_or_exit_abort(state, out, err, f"final loss at step {STEPS}:")
    return out, err


def _resharded(out: str, tag: str) -> str:
    """The plan step's reshard line for ``tag`` (3 nodes -> 2) is in ``out``: clusterkit's
    lines (printed, for a failure's report)."""
    said = "\n".join(ln for ln in out.splitlines() if ln.startswith("clusterkit: "))
    print(said[:4000])
    assert re.search(r"this run got 2 nodes, \S+; the checkpoint was saved on 3, \S+: "
                     rf"resharding {re.escape(tag)} ", out), said
    return said


ACCELERATE = REPO / "tests" / "programs" / "accelerate_save_state.py"
ACC_STEP_LOSS = re.compile(r"step (\d+) loss (\S+)")


@pytest.mark.extended
def test_accelerate_submitted_again_on_fewer_nodes_is_converted_in_place_and_resumes(
        slurm: SlurmBed) -> None:
    """accelerate (tests/programs/accelerate_save_state.py: DeepSpeedPlugin ZeRO-2, its
    config clusterkit's derived one through ACCELERATE_DEEPSPEED_CONFIG_FILE) on 3 nodes,
    --replicas 1, rank 1 killed at step 15 -> FAILED; submitted again with ``--nodes 2``:
    step_10/pytorch_model converted in its place (each node's own kept as
    pytorch_model.set-aside), load_universal on for that run, its own load_state resumes
    from step_10 on 2 ranks with finite losses and the job COMPLETES."""
    job = "acc-fewer"
    out_dir = str(slurm.tb.local_mountpoint / "ckpt" / job)
    program = [str(ACCELERATE), "--output_dir", out_dir, "--steps", str(STEPS), "--save_every",
               "10", "--step_sleep", "2", "--crash_at_step", "15", "--crash_rank", "1",
               "--crash_once", str(slurm.tb.root / f"{job}-killed")]
    out, err = _killed_on_3_then_on_2(slurm, job, program)
    said = _resharded(out, "step_10")
    assert ("accelerate's load_state loads step_10/pytorch_model, now DeepSpeed's universal "
            "checkpoint (the old world's tag kept as step_10/pytorch_model.set-aside) with "
            "checkpoint.load_universal on in ds_config.program.json") in out, said
    assert re.search(r"node\d: moved step_10/pytorch_model aside to "
                     r"step_10/pytorch_model\.set-aside \(kept\)", out), said
    assert "resumed from step_10" in out + err, (out + err)[-5000:]
    losses = [(int(s), float(loss)) for s, loss in ACC_STEP_LOSS.findall(out)]
    assert losses and min(s for s, _ in losses) > 10 and max(s for s, _ in losses) == STEPS, losses
    assert all(math.isfinite(loss) for _, loss in losses), losses
