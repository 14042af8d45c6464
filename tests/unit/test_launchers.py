"""Adding a launcher is one registry entry (docs/architecture.md, "Adding a launcher").

A throwaway launcher registered in one place, the registry, shows up in every verb's
``--launcher`` choices, in ``render_all``'s commands and files, in commands.sh and
plan.json, and is what ``clusterkit launch`` would run.
"""

from __future__ import annotations

import argparse
import json

import pytest

from clusterkit import launchers
from clusterkit.cli.main import build_parser, main
from clusterkit.launch.fromplan import job_from_plan
from clusterkit.launchers.base import Backend
from clusterkit.plan.build import plan_job
from clusterkit.render.artifacts import render_all
from clusterkit.spec.job import JobOptions, JobPlan, NodeCommand
from tests.render_cases import FACTS, ROOT, inventory, plan_for


def _echo_commands(plan: JobPlan, run_id: str | None) -> tuple[NodeCommand, ...]:
    return tuple(NodeCommand(label=f"echo node {n.node_rank}", host=n.name,
                             node_rank=n.node_rank, argv=(n.python, "-c", "print('echo')",
                                                          f"run={run_id}"),
                             env=n.env, cwd=n.workdir) for n in plan.nodes)


ECHO = Backend("echo", "a throwaway launcher for this test", plan_backend="echo",
               command_sets=("echo",), sbatch_plan="slurm", builders=(("echo", _echo_commands),),
               files=lambda plan: {"echo.txt": f"{plan.world_size} ranks\n"})


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Backend:
    monkeypatch.setitem(launchers.BACKENDS, ECHO.name, ECHO)  # the one place
    return ECHO


def _choices(verb: str) -> tuple[str, ...]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    (action,) = [a for a in sub.choices[verb]._actions if "--launcher" in a.option_strings]
    return tuple(action.choices or ())


def test_every_verb_offers_a_registered_launcher(echo: Backend) -> None:
    for verb in ("launch", "render", "sbatch", "doctor"):
        assert _choices(verb)[-1] == "echo", verb
    assert "echo" in launchers.plan_backends()


def test_render_all_renders_it_and_launch_runs_it(echo: Backend) -> None:
    plan = render_all(plan_job(inventory("a800-7x2"), JobOptions(job_id="e", backend="echo"),
                               FACTS), run_id="r1")
    assert [c.label for c in plan.launch_commands][:2] == ["echo node 0", "echo node 1"]
    assert plan.artifacts["echo.txt"] == "14 ranks\n"
    assert "# == echo (chosen)" in plan.artifacts["commands.sh"]
    assert "run=r1" in plan.artifacts["commands.sh"]
    assert json.loads(plan.artifacts["plan.json"])["commands"]["echo"][0]["argv"][-1] == "run=r1"
    job = job_from_plan(plan)
    assert [t.argv for t in job.tasks] == [c.argv for c in plan.launch_commands]
    # Every other plan lists it too (commands.sh describes every launcher), not chosen.
    other = render_all(plan_job(inventory("a800-7x2"), JobOptions(job_id="t"), FACTS))
    assert "# == echo\n" in other.artifacts["commands.sh"]


def test_render_verb_takes_it(echo: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["render", "-i", str(ROOT / "hostfiles" / "a800-7x2.yaml"), "--storage", "shared",
               "--ckpt-dir", "/ckpt", "--launcher", "echo", "--job-id", "e", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "backend echo" in out and "# == echo (chosen)" in out and "===== echo.txt" in out


def test_the_registry_is_consistent() -> None:
    """Each command set is built by one entry; every needed set and plan has a builder."""
    built = [name for b in launchers.BACKENDS.values() for name, _ in b.builders]
    assert len(built) == len(set(built))
    plans = set(launchers.plan_backends())
    for b in launchers.BACKENDS.values():
        assert set(b.command_sets) <= set(built), b.name
        assert b.plan_backend in launchers.BACKENDS and b.sbatch_plan in plans, b.name
        if b.name in plans:
            assert b.sbatch_line is not None, b.name  # sbatch.sh renders for every plan


@pytest.mark.parametrize("backend", ["torchrun", "accelerate", "slurm"])
def test_every_torchrun_gets_a_log_dir_so_nothing_is_left_in_tmp(backend: str) -> None:
    """torchrun without --log-dir makes /tmp/torchelastic_* on every node and never removes
    it (1357 of them on this machine after a day of test runs); every line that starts
    torchrun, directly or through ``accelerate launch`` or srun, names one in the job dir."""
    launch = plan_for("a800-7x2", backend)
    lines = [c.shell_line() for cmds in launch.commands.values() for c in cmds]
    lines += [line for line in launch.artifacts["sbatch.sh"].splitlines() if line.startswith("srun ")]
    starts = [line for line in lines
              if "torch.distributed.run" in line or "accelerate.commands.launch" in line]
    assert starts, backend
    for line in starts:
        assert "--log-dir=/" in line or '--log_dir=' in line, line
