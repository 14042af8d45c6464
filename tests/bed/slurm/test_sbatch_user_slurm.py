"""A user's own script under `clusterkit sbatch` on the REAL Slurm test bed (issue 24).

* every variant (torchrun, accelerate, deepspeed) gives each rank the standard torch
  variables and the CLUSTERKIT_* contract (tests/slurmbed/usertrain.py asserts them),
  and a DeepSpeed script COMPLETES with the same final loss on all three (the torchrun
  job is the preemption test's: stopped, requeued and resumed, it must still end on the
  loss of the other two, which run straight through);
* a relative script path from the user's cwd works (made absolute before submitting);
* a failing rank's own exit code and name end the job, not the teardown's 143;
* preemption: `scancel --signal=USR1 --batch` makes a contract-following script save,
  the job requeues, resumes from that save and COMPLETES; a script that ignores the
  request is not requeued, and the script says that nothing was saved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import (
    IN_PROGRESS,
    assert_slurm_nodes_clean,
    slurm_job_dir,
    wait_slurm_finished,
    workload_summary,
)
from tests.paths import TESTS
from tests.slurmbed import SlurmBed

pytestmark = [pytest.mark.slurm, pytest.mark.testbed, pytest.mark.slow]

USERTRAIN = TESTS / "slurmbed" / "usertrain.py"
STEPS = 8


def _user_dir(bed: SlurmBed) -> Path:
    """The user's own folder on the shared filesystem, with their script in it."""
    folder = bed.tb.root / "user"
    folder.mkdir(exist_ok=True)
    shutil.copy(USERTRAIN, folder / "usertrain.py")
    (folder / "fails.py").write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "time.sleep(2 if rank == 1 else 120)\n"
        "sys.exit(2 if rank == 1 else 0)\n")
    return folder


def _sbatch_user_script(bed: SlurmBed, job: str, launcher: str, program: list[str], *extra: str,
            timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """`clusterkit sbatch` from the user's folder, the script given relative to it. The
    inventory says gpus: 0 (a CPU/gloo job: torch's Adam in ds_config.json)."""
    folder = _user_dir(bed)
    inv = bed.tb.write_inventory(bed.tb.root / "inventory-user.yaml", nodes=bed.nodes, slots=2,
                                 gpus=0)
    argv = [sys.executable, "-m", "clusterkit", "sbatch", "-i", str(inv), "--nodes", "2",
            "--gpus-per-node", "2", "--launcher", launcher, "--storage", "shared",
            "--steps", str(STEPS), "--job-id", job, "--partition", "debug", *extra,
            "--submit", *program]
    return subprocess.run(argv, capture_output=True, text=True, env=bed.env, cwd=folder,
                          timeout=timeout, check=False)


def _slurm_id(r: subprocess.CompletedProcess[str]) -> str:
    m = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert m, (r.stdout[-2000:], r.stderr[-2000:])
    return m.group(1)



def _log(bed: SlurmBed, job: str, slurm_id: str, ext: str = "out") -> str:
    return (slurm_job_dir(bed, job) / "logs" / f"slurm-{slurm_id}.{ext}").read_text(errors="replace")


@dataclass
class Preempted:
    """The torchrun job of the user's script, asked to stop (batch USR1) after step 3."""

    job: str
    slurm_id: str
    state: str
    out: str


@pytest.fixture(scope="module")
def preempted(slurm_bed: SlurmBed) -> Iterator[Preempted]:
    """One job for two tests (each Slurm job of this script costs ~30 s of 2 cores): the
    preemption test checks its save/requeue/resume, the contract test its torchrun run.
    --hold-after 3: the first run waits after step 3 for the stop request, so the request
    always lands mid-run without sleeping steps; the resumed run trains straight on."""
    slurm_bed.wait_all_jobs_gone(timeout=30)
    job = "user-preempt"
    r = _sbatch_user_script(slurm_bed, job, "torchrun",
                ["usertrain.py", "--steps", str(STEPS), "--hold-after", "3"])
    slurm_id = _slurm_id(r)
    try:
        state = _usr1_to_batch_then_wait(slurm_bed, job, slurm_id)
    except BaseException:
        slurm_bed.client(["scancel", "--full", slurm_id], check=False)
        raise
    yield Preempted(job, slurm_id, state, _log(slurm_bed, job, slurm_id))


def _assert_contract_run(bed: SlurmBed, job: str, summary: dict[str, object]) -> None:
    assert summary["world_size"] == 4 and summary["finished"] is True, summary
    plan = json.loads((slurm_job_dir(bed, job) / "plan.json").read_text())
    assert str(bed.tb.root / "user" / "usertrain.py") in json.dumps(plan)  # made absolute


# The deepspeed variant's run adds ~30 s of 2 cores; the default run starts it with a
# failing script (test_first_failing_rank_gives_the_exit_code[deepspeed]) and trains the
# torchrun (the `preempted` job) and accelerate variants.
@pytest.mark.parametrize("launcher", ["accelerate", pytest.param("deepspeed",
                                                                 marks=pytest.mark.extended)])
def test_user_script_gets_the_contract_on_every_variant(slurm: SlurmBed, preempted: Preempted,
                                                        launcher: str) -> None:
    assert preempted.state == "COMPLETED", preempted.out[-3000:]
    summary = workload_summary(preempted.out.replace("[rank0]:", ""))
    _assert_contract_run(slurm, preempted.job, summary)
    torchrun_loss = summary["final_loss"]
    job = f"user-{launcher}"
    t0 = time.monotonic()
    r = _sbatch_user_script(slurm, job, launcher, ["usertrain.py", "--steps", str(STEPS)], "--watch",
                "--poll", "0.5")
    assert r.returncode == 0, (launcher, r.stdout[-3000:], r.stderr[-3000:])
    summary = workload_summary(r.stdout)
    _assert_contract_run(slurm, job, summary)
    print(f"{launcher}: COMPLETED in {time.monotonic() - t0:.0f} s, loss {summary['final_loss']}")
    assert summary["final_loss"] == torchrun_loss, (launcher, summary, torchrun_loss)
    assert_slurm_nodes_clean(slurm)


def test_missing_script_is_refused_before_submitting(slurm: SlurmBed) -> None:
    r = _sbatch_user_script(slurm, "user-missing", "torchrun", ["nosuch.py"])
    assert r.returncode == 2, r.stderr
    assert "nosuch.py does not exist" in r.stderr and "submitted" not in r.stdout
    assert not slurm_job_dir(slurm, "user-missing").exists()


# torchrun is extended (~13 s): the deepspeed variant names the first failing rank by
# the same rule (the batch script's exits dir), and a torchrun rank's failure ends its
# job FAILED in test_sbatch_slurm.py's killed-rank test.
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.extended),
                                      "deepspeed"])
def test_first_failing_rank_gives_the_exit_code(slurm: SlurmBed, launcher: str) -> None:
    job = f"user-fails-{launcher}"
    r = _sbatch_user_script(slurm, job, launcher, ["fails.py"], "--watch", "--poll", "0.5")
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert "ended FAILED (exit code 2" in r.stderr, r.stderr[-2000:]
    slurm_id = _slurm_id(r)
    err = _log(slurm, job, slurm_id, "err")
    assert re.search(r"clusterkit: rank 1 on node\d failed first \(exit code 2\)", err), err[-2000:]
    assert_slurm_nodes_clean(slurm)


def _wait_line(bed: SlurmBed, job: str, slurm_id: str, needle: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    out = slurm_job_dir(bed, job) / "logs" / f"slurm-{slurm_id}.out"
    while not (out.exists() and needle in out.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{needle!r} not in job {slurm_id}'s output"
        assert bed.job_state(slurm_id) in IN_PROGRESS
        time.sleep(0.5)


def _usr1_to_batch_then_wait(bed: SlurmBed, job: str, slurm_id: str) -> str:
    _wait_line(bed, job, slurm_id, "step 3 loss")
    subprocess.run(["scancel", "--signal=USR1", "--batch", slurm_id], env=bed.env, check=True,
                   timeout=30)
    deadline = time.monotonic() + 400
    while (state := bed.job_state(slurm_id)) in IN_PROGRESS:
        assert time.monotonic() < deadline, f"job {slurm_id} still {state}"
        time.sleep(0.5)
    return state


def test_preemption_saves_requeues_and_resumes(slurm: SlurmBed, preempted: Preempted) -> None:
    job, slurm_id, out = preempted.job, preempted.slurm_id, preempted.out
    assert preempted.state == "COMPLETED", out[-3000:]
    assert "stop requested: saved step" in out and "requeueing job" in out, out[-3000:]
    runs = re.findall(rf"===== clusterkit: job {job} slurm={slurm_id} run (\d)", out)
    assert runs == ["1", "2"], runs
    saved = re.search(r"stop requested: saved (step\d+)", out)
    assert saved and f"resumed from {saved.group(1)}" in out, out[-3000:]
    assert saved.group(1) == "step3"  # the run held after step 3 until the request came
    summary = workload_summary(out.replace("[rank0]:", ""))
    assert summary["finished"] is True and summary["resumed_from"] == saved.group(1)
    assert_slurm_nodes_clean(slurm)


# ~90 s of real Slurm: the default run covers the decision with Slurm stubbed
# (test_sbatch_units.py::test_script_requeues_only_for_a_save_after_the_stop_request).
@pytest.mark.extended
def test_a_script_that_ignores_the_stop_is_not_requeued(slurm: SlurmBed) -> None:
    job = "user-ignores"
    r = _sbatch_user_script(slurm, job, "torchrun", ["usertrain.py", "--steps", "15", "--step-sleep", "1",
                                         "--ignore-stop"])
    slurm_id = _slurm_id(r)
    state = _usr1_to_batch_then_wait(slurm, job, slurm_id)
    out = _log(slurm, job, slurm_id)
    assert state == "COMPLETED", out[-3000:]
    assert "nothing was saved" in out and "not requeueing" in out, out[-3000:]
    assert "requeueing job" not in out.replace("not requeueing job", "")
    assert re.findall(rf"slurm={slurm_id} run (\d)", out) == ["1"]
    assert wait_slurm_finished(slurm, slurm_id) == "COMPLETED"


# ~2 min of real Slurm, most of it a silent start on purpose: the rule itself is tested
# without Slurm (test_hangrule.py, the watch with a fake clock).
@pytest.mark.extended
def test_a_silent_start_within_the_allowance_is_not_a_hang(slurm: SlurmBed) -> None:
    """Issue 31 item 5: ranks silent at start-up for longer than --hang-timeout (a sleep
    standing in for DeepSpeed building fused_adam) are not ended as hung: the start-up
    allowance, 2 x --hang-timeout as launch's, holds until the first step line. It counts
    from the launch step's start: here torchrun, the imports and deepspeed.initialize took
    ~31 s before the silence began (load 10), so the silence + that must fit in 150 s."""
    job, hang, silent = "user-slowstart", 75, 80
    r = _sbatch_user_script(slurm, job, "torchrun", ["usertrain.py", "--steps", "3", "--silent-start",
                                         str(silent)], "--hang-timeout", str(hang))
    slurm_id = _slurm_id(r)
    state = wait_slurm_finished(slurm, slurm_id, timeout=400)
    out = _log(slurm, job, slurm_id)
    assert state == "COMPLETED", out[-3000:]
    assert f"silent start: {silent} s" in out and "step 3 loss" in out, out[-3000:]
    assert "clusterkit: no progress" not in out and "no sign of training" not in out
    assert not (slurm_job_dir(slurm, job) / "hang").exists()
    assert_slurm_nodes_clean(slurm)


def test_a_stopped_rank_is_named_and_ends_the_step(slurm: SlurmBed) -> None:
    """One rank SIGSTOPped mid-run: within --hang-timeout + 15 s the watchdog prints a
    folded stack summary naming that rank, and the step ends with that reason.
    --hang-timeout 20, as the issue's own acceptance (30 before issue 37 item 6: 10 s of
    4 stalled ranks and a held Slurm job fewer)."""
    job, hang = "user-hang", 20
    r = _sbatch_user_script(slurm, job, "torchrun", ["usertrain.py", "--steps", "300", "--step-sleep", "0.5"],
                "--hang-timeout", str(hang))
    slurm_id = _slurm_id(r)
    _wait_line(slurm, job, slurm_id, "step 3 loss")
    victim = None
    for pid, cmd in slurm.job_processes("node2"):
        if "usertrain.py" in cmd and not cmd.startswith(("sh ", "/bin/sh ")) \
                and "torch.distributed.run" not in cmd:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            victim = (pid, next(e for e in env if e.startswith(b"RANK=")).decode()[5:])
            break
    assert victim is not None, slurm.job_processes("node2")
    os.kill(victim[0], signal.SIGSTOP)
    stopped_at = time.monotonic()
    state = wait_slurm_finished(slurm, slurm_id, timeout=hang + 120)
    out = _log(slurm, job, slurm_id)
    print("\n".join(ln for ln in out.splitlines()
                    if ln.startswith(("clusterkit: no progress", "  rank", "clusterkit: ending",
                                      "clusterkit: the step hung"))))
    detected = re.search(r"clusterkit: no progress on any rank for (\d+) s", out)
    assert detected, out[-3000:]
    assert time.monotonic() - stopped_at < hang + 15 + 60  # detection + teardown
    assert int(detected.group(1)) <= hang + 15
    assert re.search(rf"  rank {victim[1]} \(node2, stopped\): .*odd one out", out), out[-3000:]
    assert "ending the step: no progress on any rank for" in out
    assert f"rank {victim[1]} on node2 is stopped" in out
    assert state == "FAILED", state
    hangs = list((slurm_job_dir(slurm, job) / "hangs").glob(f"{slurm_id}.1/rank*.txt"))
    assert len(hangs) == 4, hangs
    assert_slurm_nodes_clean(slurm)
