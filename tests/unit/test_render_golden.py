"""Every artifact of every backend for the three reference inventories, byte for byte."""

from __future__ import annotations

import pytest

from clusterkit.render.artifacts import dry_run_text
from tests.golden import assert_golden
from tests.render_cases import BACKENDS, INVENTORIES, plan_for


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inv", INVENTORIES)
def test_artifacts_match_golden(inv: str, backend: str) -> None:
    plan = plan_for(inv, backend)
    for name, text in plan.artifacts.items():
        assert_golden(f"render/{inv}/{backend}/{name}", text)
    if backend == "torchrun":  # the dry run repeats every file; one listing per inventory
        assert_golden(f"render/{inv}/DRY_RUN.txt", dry_run_text(plan))


def test_a800_node_local_is_complete() -> None:
    """The 7x2 node-local example: one command, a complete and consistent set."""
    plan = plan_for("a800-7x2", "torchrun")
    assert plan.storage == "node-local" and plan.world_size == 14
    assert set(plan.artifacts) == {
        "hostfile", "deepspeed_env", "ssh_config", "ds_config.json", "sbatch.sh", "commands.sh",
        "plan.json", *(f"accelerate_config.rank{i}.yaml" for i in range(7))}
    assert plan.ds_config["checkpoint"]["use_node_local_storage"] is True
    assert plan.ds_config["train_batch_size"] == 14
    assert not plan.skipped
    assert [c.host for c in plan.launch_commands] == [f"node{i}" for i in range(1, 8)]
    assert all("--storage" in c.argv and "node-local" in c.argv for c in plan.launch_commands)
    assert "srun --nodes=7 --ntasks-per-node=1 mkdir -p -- /scratch/ckpt" in plan.artifacts["sbatch.sh"]
