"""Continuing a job by its id: same checkpoint dir, and the node-local mapping rule."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from clusterkit.errors import LaunchError
from clusterkit.launch.continuation import check_continue, resume_note
from clusterkit.launch.fromplan import job_from_plan
from clusterkit.launch.registry import Registry
from clusterkit.launch.run import _record
from tests.helpers import recorded_failed_job
from tests.render_cases import plan_for


def test_a_new_job_id_is_not_a_continuation(tmp_path: Path) -> None:
    plan = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=2)
    assert check_continue(plan, Registry(tmp_path).find(plan.job_id)) is None


def test_same_id_continues_and_says_where_the_checkpoints_are(tmp_path: Path) -> None:
    registry = recorded_failed_job(tmp_path, nodes=2, gpus_per_node=2)
    plan = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=2)
    record = registry.find(plan.job_id)
    assert record is not None
    assert record.ckpt.dirs == {"node1": "/scratch/ckpt/golden-a800-7x2",
                                "node2": "/scratch/ckpt/golden-a800-7x2"}
    note = check_continue(plan, record)
    assert note is not None and "continuing job golden-a800-7x2 (failed before)" in note
    assert "/scratch/ckpt/golden-a800-7x2" in note and "newest complete checkpoint" in note


def test_node_local_refuses_a_changed_rank_to_node_mapping(tmp_path: Path) -> None:
    registry = recorded_failed_job(tmp_path, nodes=2, gpus_per_node=2, script="train.py")
    plan = plan_for("a800-7x2", "torchrun", nodes=4, gpus_per_node=1,
                    script_args=("--resume", "never"))
    assert plan.storage == "node-local"
    with pytest.raises(LaunchError) as err:
        check_continue(plan, registry.find(plan.job_id))
    # The bundled workload (--resume auto) is resharded instead (issue 22, tests/process/test_recover.py).
    workload = plan_for("a800-7x2", "torchrun", nodes=4, gpus_per_node=1)
    assert "resharded first" in (check_continue(workload, registry.find(plan.job_id)) or "")
    # So is a user's script (issue 31: its newest checkpoint converted for it).
    user = plan_for("a800-7x2", "torchrun", nodes=4, gpus_per_node=1, script="train.py")
    assert "resharded first" in (check_continue(user, registry.find(plan.job_id)) or "")
    assert "different rank->node mapping" in str(err.value)
    assert "collect-ckpt --scatter" in (err.value.hint or "")
    # Shared storage: any mapping may resume (the workload checks the world size itself).
    shared = plan_for("a800-7x2", "torchrun", nodes=4, gpus_per_node=1, storage="shared",
                      ckpt_dir="/mnt/ck")
    assert check_continue(shared, registry.find(plan.job_id)) is not None


def test_a_running_job_is_not_launched_twice(tmp_path: Path) -> None:
    registry = recorded_failed_job(tmp_path, nodes=2, gpus_per_node=2)
    plan = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=2)
    record = registry.find(plan.job_id)
    assert record is not None
    running = dataclasses.replace(record, state="running", launcher_pid=os.getpid())
    with pytest.raises(LaunchError, match="still running"):
        check_continue(plan, running)


def test_the_dry_run_refuses_a_job_id_that_is_still_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25: the dry run makes the launch's checks, this one included."""
    from clusterkit.cli.main import main
    from clusterkit.inventory import local_inventory
    from clusterkit.plan.build import plan_job
    from clusterkit.render.artifacts import render_all
    from clusterkit.spec.job import JobOptions
    from tests.render_cases import FACTS

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CLUSTERKIT_INVENTORY", raising=False)
    (tmp_path / "train.py").write_text("")
    plan = render_all(plan_job(local_inventory(str(tmp_path / "home" / "local")),
                               JobOptions(job_id="busy", nodes=1, script="train.py"), FACTS))
    record = _record(job_from_plan(plan), plan, 0)
    registry = Registry(tmp_path / "home")
    registry.save(dataclasses.replace(record, state="failed"))
    argv = ["launch", "--dry-run", "--skip-checks", "--nodes", "1", "--job-id", "busy", "train.py"]
    assert main(argv) == 0
    assert "continuing job busy (failed before)" in capsys.readouterr().out
    registry.save(dataclasses.replace(record, state="running", launcher_pid=os.getpid()))
    assert main(argv) == 2
    assert "--job-id: job busy is still running" in capsys.readouterr().err


def test_gate_needs_clusterkit_only_for_the_bundled_workload() -> None:
    """A user's script needs only a Python on the nodes; the bundled workload needs
    clusterkit there too, so the gate says `clusterkit nodes install` before any rank starts."""
    from clusterkit.launch.run import gate_needs
    from tests.render_cases import plan_for

    bundled = plan_for("a800-7x2", "torchrun")
    own = plan_for("a800-7x2", "torchrun", script="train.py")
    assert "clusterkit" in gate_needs(bundled) and "torch" in gate_needs(bundled)
    assert "clusterkit" not in gate_needs(own)


def test_the_resume_note_names_the_node_local_trap_for_a_users_program() -> None:
    assert resume_note(True, "node-local") == "the workload resumes from its newest complete checkpoint"
    assert resume_note(False, "shared") == "your program must resume by itself"
    # A user's DeepSpeed script that loaded `latest` resumed on node 0 only (seen on the
    # test bed as a non-root user, node-local storage, no shared dir).
    note = resume_note(False, "node-local")
    assert "DeepSpeed's `latest` is on rank 0's node only" in note and "explicit tag" in note
