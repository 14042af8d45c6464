"""``clusterkit launch`` training the bundled ZeRO-2 workload on the namespace test bed.

* restart acceptance: a rank is killed mid-run (after a complete checkpoint, well
  before the end); ``--max-restarts 1`` relaunches, the workload resumes from the
  newest complete checkpoint and ends on exactly the uninterrupted run's loss (CPU,
  fp32, gloo: bit-exact); continuing that node-local job on another rank->node
  mapping is refused with a pointer to ``collect-ckpt --scatter``.
* per-backend acceptance: the torchrun plan (run natively by the agents, the
  default), DeepSpeed's runner over pdsh and accelerate each train to completion
  once at 7 nodes x 2 ranks and once, with the other storage mode, at a smaller
  shape (torchrun itself, shared, is the restart test's reference run at 2 x 2;
  deepspeed and accelerate at 2 x 1). Tiny model, few steps. The full
  matrix at 7 x 2 is run by hand (docs/launch.md lists the times).

The expensive runs are session fixtures (tests/conftest.py), each launched once and
checked by every test that needs it: the 2 x 2 reference (restart test here, hang
test in test_hang_testbed.py) and the node-local 7 x 2 runs (native ZeRO-2 and
deepspeed ZeRO-3, which also dump their weights: test_collect_testbed.py collects
and consolidates their checkpoints).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.testbed.core import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

_CKPT_DONE = re.compile(r"checkpoint (global_step\d+) complete")
_LABEL = re.compile(r"^\[node\d+ r(\d+)\] ")


@dataclass
class Run:
    code: int
    text: str
    summary: dict[str, Any]


def _argv(inv: Path, job: str, backend: str, n: int, g: int, storage: str, steps: int,
          extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id", job,
            "--launcher", backend, "--nodes", str(n), "--gpus-per-node", str(g),
            "--storage", storage, "--steps", str(steps), "--grace", "2", "--skip-checks", *extra]


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1")


def _summary(text: str) -> dict[str, Any]:
    lines = [ln for ln in text.splitlines() if ln.startswith("CLUSTERKIT_SUMMARY ")]
    assert lines, text[-4000:]
    value = json.loads(lines[-1].split(" ", 1)[1])
    assert isinstance(value, dict)
    return value


def _train(tb: Testbed, tmp_path: Path, job: str, backend: str, n: int, g: int, storage: str,
           steps: int, extra: Sequence[str] = (), timeout: float = 300) -> Run:
    inv = tb.write_inventory(tmp_path / f"{job}.yaml", nodes=[x.name for x in tb.ensure(n)], slots=g)
    proc = subprocess.run(_argv(inv, job, backend, n, g, storage, steps, extra),
                          capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path,
                          timeout=timeout)
    text = proc.stdout + proc.stderr
    return Run(proc.returncode, text, _summary(text) if proc.returncode == 0 else {})


def _rank_pid(job: str, rank: int) -> int | None:
    """The host pid of one rank of ``job`` (node PID namespaces are visible from the host)."""
    want = {b"CLUSTERKIT_JOB_ID=" + job.encode(), b"RANK=" + str(rank).encode()}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = set(Path(f"/proc/{name}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= env and any(x.startswith(b"LOCAL_RANK=") for x in env):
            return int(name)
    return None


def _assert_trained(run: Run, steps: int, world: int) -> None:
    assert run.code == 0, run.text[-4000:]
    s = run.summary
    assert s["finished"] and s["steps"] == steps and s["world_size"] == world, s
    assert isinstance(s["final_loss"], float)
    # every rank's lines carry their label, whatever the launcher
    ranks = {int(m.group(1)) for ln in run.text.splitlines() if (m := _LABEL.match(ln))}
    assert 0 in ranks, run.text[-2000:]


# ------------------------------------------------------------------ shared runs

# The uninterrupted 2 x 2 reference (torchrun, shared storage) of the restart and hang
# tests: long enough for a stop after the first save (every 10 steps), a kill after the
# restarted attempt's first save and a last attempt that resumes mid-run, although the
# test sees each line up to ~20 steps late (60 steps were too few on a quiet machine:
# attempt 2 had finished before the kill).
REF_STEPS = 120
# Every step of a 14-rank ZeRO-3 run costs ~4 s on this 2-core machine: three steps
# show training as well as six did.
SHARED_7X2_STEPS = 3
# key -> (launcher, storage, ZeRO stage). The node-local ones dump their weights for
# test_collect_testbed.py (ZeRO-2 and ZeRO-3 collect + consolidate).
SHARED_7X2: dict[str, tuple[str, str, int]] = {
    "native": ("native", "node-local", 2),
    "deepspeed": ("deepspeed", "node-local", 3),
    "accelerate": ("accelerate", "shared", 2),
}


@dataclass
class Launched:
    """One launched job shared by several tests (session fixtures in tests/conftest.py)."""

    run: Run
    wall: float
    job: str
    storage: str
    zero_stage: int
    weights: Path | None  # the workload's --dump-weights file (shared dir), if asked for


def launch_reference(tb: Testbed, tmp_path: Path) -> Run:
    t0 = time.monotonic()
    ref = _train(tb, tmp_path, "ref-run", "torchrun", 2, 2, "shared", REF_STEPS)
    _assert_trained(ref, REF_STEPS, 4)
    print(f"reference run {time.monotonic() - t0:.1f} s")
    return ref


def launch_7x2(tb: Testbed, tmp_path: Path, key: str) -> Launched:
    backend, storage, stage = SHARED_7X2[key]
    job = f"b7-{key}"
    extra = ["--zero-stage", str(stage)]
    weights = None
    if storage == "node-local":
        weights = tb.shared_dir / f"{job}-weights.pt"
        extra += ["--set-env", f"CLUSTERKIT_DUMP_WEIGHTS={weights}"]
    started = time.monotonic()
    run = _train(tb, tmp_path, job, backend, 7, 2, storage, SHARED_7X2_STEPS, extra)
    return Launched(run, time.monotonic() - started, job, storage, stage, weights)


# A rank killed mid-run (restart, resume to the same loss, no fresh start on another
# mapping): tests/test_hang_testbed.py, in the same job as the stopped rank.


# ------------------------------------------------------------------ backends


@pytest.mark.parametrize("key", list(SHARED_7X2))
def test_backend_trains_at_7x2(launched_7x2: Callable[[str], Launched], key: str) -> None:
    launched = launched_7x2(key)  # native/deepspeed: node-local, also collected elsewhere
    run = launched.run
    _assert_trained(run, SHARED_7X2_STEPS, 14)
    assert run.summary["storage"] == launched.storage
    assert run.summary["zero_stage"] == launched.zero_stage
    # The launcher returned promptly: no agent left waiting after the summary.
    assert launched.wall < 280


@pytest.mark.parametrize(("backend", "storage"), [("deepspeed", "shared"),
                                                  ("accelerate", "node-local")])
def test_backend_trains_at_2x1_other_storage(testbed: Testbed, tmp_path: Path, backend: str,
                                             storage: str) -> None:
    run = _train(testbed, tmp_path, f"b2-{backend}", backend, 2, 1, storage, 6)
    _assert_trained(run, 6, 2)
    assert run.summary["storage"] == storage
