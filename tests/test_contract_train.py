"""The user-script contract (clusterkit/contract.py, docs/launch.md "Your own training script").

* unit: every node of a plan carries the contract variables in its rank env, whatever
  the backend, and ``--deepspeed-config-arg`` appends DeepSpeed's own argument;
* test bed: the documented example ``docs/examples/train.py`` (not the bundled
  workload) trains with ZeRO-3 and node-local checkpoints on 2 nodes x 1 rank, one
  rank is killed mid-run, ``clusterkit launch`` with the same ``--job-id`` resumes it
  from its newest complete checkpoint and it ends on the uninterrupted run's loss;
  ``collect-ckpt --without-markers`` then gathers and consolidates the script's saves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterkit.node.contract import CONTRACT_NAMES, DEEPSPEED_CONFIG_ARG
from tests.helpers import rank_pid, train_env, workload_summary
from tests.render_cases import plan_for
from tests.testbed.core import Testbed

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "train.py"
_CKPT_DONE = re.compile(r"checkpoint (step\d+) complete")


@pytest.mark.parametrize("backend", ["torchrun", "deepspeed", "accelerate", "slurm"])
def test_every_backend_carries_the_contract(backend: str) -> None:
    plan = plan_for("a800-7x2", backend, nodes=2, gpus_per_node=1, storage="node-local",
                    script="train.py")
    for node in plan.nodes:
        env = node.env
        assert set(CONTRACT_NAMES) <= set(env), env
        assert env["CLUSTERKIT_JOB_DIR"] == node.job_dir
        assert env["CLUSTERKIT_DS_CONFIG"] == f"{node.job_dir}/ds_config.json"
        assert env["CLUSTERKIT_CKPT_DIR"] == node.ckpt_dir
        assert env["CLUSTERKIT_STORAGE"] == "node-local"
        assert env["CLUSTERKIT_JOB_ID"] == plan.job_id
    if backend == "deepspeed":  # remote ranks read it from .deepspeed_env
        assert "CLUSTERKIT_CKPT_DIR=" in plan.artifacts["deepspeed_env"]


def test_deepspeed_config_arg_follows_the_script_args() -> None:
    plan = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=1, script="train.py",
                    script_args=("--lr", "3e-4"), deepspeed_config_arg=True)
    for node, program in zip(plan.nodes, plan.programs, strict=True):
        assert program == ("train.py", "--lr", "3e-4", DEEPSPEED_CONFIG_ARG,
                           f"{node.job_dir}/ds_config.json")
    plain = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=1, script="train.py")
    assert DEEPSPEED_CONFIG_ARG not in plain.program


# ------------------------------------------------------------------ test bed

# The kill follows the first save (step 10) as the test reads it, which can be up to
# ~20 steps late (tests/test_hang_testbed.py): 40 steps after it are room enough (80
# cost each of the three runs 30 more ZeRO-3 steps and 3 more saves).
STEPS = 50
SAVE_EVERY = 10


def _argv(inv: Path, job: str) -> list[str]:
    return [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id", job,
            "--nodes", "2", "--gpus-per-node", "1", "--zero-stage", "3",
            "--storage", "node-local", "--steps", str(STEPS), "--grace", "2", "--skip-checks",
            str(EXAMPLE), "--", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]


def _run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=train_env(tmp_path),
                          cwd=tmp_path, timeout=300)


def _kill_after_first_checkpoint(argv: list[str], tmp_path: Path, job: str) -> str:
    """Launch, SIGKILL rank 1 (node2) once a checkpoint is complete; the job fails."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=train_env(tmp_path), cwd=tmp_path, start_new_session=True)
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if _CKPT_DONE.search(line):
                pid = rank_pid(job, 1)
                assert pid is not None, "".join(seen)[-3000:]
                os.kill(pid, signal.SIGKILL)
                break
        rest, _ = proc.communicate(timeout=120)
        seen.append(rest)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(seen)
    assert proc.returncode not in (0, None), text[-3000:]
    assert "killed by SIGKILL" in text, text[-3000:]
    return text


@pytest.mark.testbed
@pytest.mark.slow
def test_example_script_resumes_zero3_node_local_after_a_kill(testbed: Testbed,
                                                              tmp_path: Path) -> None:
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes=[x.name for x in testbed.ensure(2)],
                                  slots=1)
    t0 = time.monotonic()
    ref = _run(_argv(inv, "contract-ref"), tmp_path)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    ref_loss = workload_summary(ref.stdout)["final_loss"]
    print(f"reference run {time.monotonic() - t0:.1f} s")

    job = "contract-resume"
    killed = _kill_after_first_checkpoint(_argv(inv, job), tmp_path, job)
    before = killed.split("stopping the job", 1)[0]
    newest = _CKPT_DONE.findall(before)[-1]  # the newest save the failure report follows

    again = _run(_argv(inv, job), tmp_path)  # same --job-id: the same checkpoint dirs
    text = again.stdout + again.stderr
    assert again.returncode == 0, text[-4000:]
    s = workload_summary(again.stdout)
    assert s["resumed_from"] is not None, text[-3000:]
    # The kill can land after one more save completed than the console had shown.
    assert int(s["resumed_from"].removeprefix("step")) >= int(newest.removeprefix("step"))
    assert s["steps_run"] < STEPS and s["storage"] == "node-local" and s["world_size"] == 2
    assert s["final_loss"] == ref_loss, (s["final_loss"], ref_loss)

    # The script's saves carry no clusterkit markers, and the job record says so: collect-ckpt
    # judges them by DeepSpeed's own files with no flag (issue 32's one completeness rule)
    # and consolidates them.
    collect = [sys.executable, "-m", "clusterkit", "collect-ckpt", job]
    got = _run([*collect, "--consolidate", "fp32", "--json"], tmp_path)
    assert got.returncode == 0, (got.stdout + got.stderr)[-3000:]
    report = json.loads(got.stdout)
    assert (report["collect"]["world_size"], report["collect"]["zero_stage"]) == (2, 3), report
    assert [n["ranks"] for n in report["collect"]["nodes"]] == [[0], [1]], report
    assert report["consolidated"]["tensors"] > 0, report
