"""``clusterkit launch`` training the bundled ZeRO-2 workload on the namespace test bed.

* restart acceptance: a rank is killed mid-run (after a complete checkpoint, well
  before the end); ``--max-restarts 1`` relaunches, the workload resumes from the
  newest complete checkpoint and ends on exactly the uninterrupted run's loss (CPU,
  fp32, gloo: bit-exact); continuing that node-local job on another rank->node
  mapping is refused with a pointer to ``collect-ckpt --scatter``.
* per-backend acceptance: the torchrun plan (run natively by the agents, the
  default), DeepSpeed's runner over pdsh and accelerate each train to completion
  once at 7 nodes x 2 ranks and once, with the other storage mode, at a smaller
  shape (torchrun's own agents run a job in tests/bed/test_titles_testbed.py; deepspeed and
  accelerate at 2 x 1). Tiny model, few steps. The 7 x 2 runs of
  deepspeed and accelerate (~110-170 s each on the 2-core suite) are extended
  variants; by default the 7-node shape runs natively, DeepSpeed's runner at 2 x 1
  (shared, below) and 2 x 2 (node-local ZeRO-3, collected and consolidated in
  tests/bed/test_collect_testbed.py), accelerate at 2 x 1 (node-local, below) and under
  Slurm (tests/bed/slurm/test_sbatch_user_slurm.py, shared). The full matrix at 7 x 2 is run by
  hand (docs/launch.md lists the times).

The node-local 7 x 2 runs (native ZeRO-2 and deepspeed ZeRO-3, which also dump their
weights) are this module's fixture ``launched_7x2``, launched once and checked by every
test that needs it: the backend test, and the collect test at the end, which collects
and consolidates their checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import (
    SHARED_7X2,
    SHARED_7X2_STEPS,
    Launched,
    assert_collected_exact,
    assert_trained,
    launch_7x2,
    train,
)
from tests.testbed.core import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

# A rank killed mid-run (restart, resume to the same loss, no fresh start on another
# mapping): tests/bed/test_hang_testbed.py, in the same job as the stopped rank.


@pytest.fixture(scope="module")
def launched_7x2(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory
                 ) -> Callable[[str], Launched]:
    """``launched_7x2(key)``: the 7 x 2 run of tests/helpers.SHARED_7X2[key], launched on
    first use and kept for this module (a failed run is kept too: every test that shares
    it then reports the same failure instead of launching it again). A module fixture, so
    `--dist loadfile` keeps its users on one worker (tests/conftest.py)."""
    runs: dict[str, Launched] = {}

    def get(key: str) -> Launched:
        if key not in runs:
            runs[key] = launch_7x2(testbed, tmp_path_factory.mktemp(f"launch-7x2-{key}"), key)
        return runs[key]

    return get


# ------------------------------------------------------------------ backends


@pytest.mark.parametrize("key", [k if k == "native" else pytest.param(k, marks=pytest.mark.extended)
                                 for k in SHARED_7X2])
def test_backend_trains_at_7x2(launched_7x2: Callable[[str], Launched], key: str) -> None:
    launched = launched_7x2(key)  # native/deepspeed: node-local, also collected elsewhere
    run = launched.run
    assert_trained(run, SHARED_7X2_STEPS, 14)
    assert run.summary["storage"] == launched.storage
    assert run.summary["zero_stage"] == launched.zero_stage
    # The launcher returned promptly: no agent left waiting after the summary.
    assert launched.wall < 280


# deepspeed-shared is extended (~20 s: pdsh and DeepSpeed's runner import DeepSpeed on
# every node before the ranks do): DeepSpeed's runner trains by default at 2 x 2 in
# test_collect_testbed.py, shared storage in the Slurm bed's jobs (test_sbatch_user_slurm.py)
# and test_workload_dist.py.
@pytest.mark.parametrize(("backend", "storage"), [
    pytest.param("deepspeed", "shared", marks=pytest.mark.extended),
    ("accelerate", "node-local")])
def test_backend_trains_at_2x1_other_storage(testbed: Testbed, tmp_path: Path, backend: str,
                                             storage: str) -> None:
    run = train(testbed, tmp_path, f"b2-{backend}", backend, 2, 1, storage, 6)
    assert_trained(run, 6, 2)
    assert run.summary["storage"] == storage


@pytest.mark.slow
@pytest.mark.parametrize(("key", "stage"), [
    ("native", 2),
    # ZeRO-3 collect + consolidate runs by default at 2 x 2 (the next test)
    pytest.param("deepspeed", 3, marks=pytest.mark.extended)])
def test_workload_7x2_collect_and_consolidate_exact(
        testbed: Testbed, tmp_path: Path, launched_7x2: Callable[[str], Launched], key: str,
        stage: int) -> None:
    """The node-local 7 x 2 run the backend test above launched (the module fixture;
    native = ZeRO-2, deepspeed = ZeRO-3, weights dumped by the live model), collected and
    consolidated."""
    launched = launched_7x2(key)
    assert launched.zero_stage == stage
    assert_collected_exact(testbed, tmp_path, launched, nodes=7, ranks=14)
