"""launch's runtime flags come from spec.job.RunOptions, one default each (issue 23)."""

from __future__ import annotations

import argparse

import pytest

from clusterkit.cli.jobflags import flag_name, run_fields, run_options
from clusterkit.cli.main import build_parser
from clusterkit.launch.fromplan import job_from_plan
from clusterkit.launch.jobspec import JobSpec
from clusterkit.launch.run import LaunchSettings
from clusterkit.node.protocol import DEFAULT_GRACE_S, AgentSpec
from clusterkit.spec.job import DEFAULT_HANG_TIMEOUT_S, DEFAULT_KEEPALIVE_S, RunOptions
from clusterkit.units import duration_type

RUN_FLAGS = [flag_name(f) for f in run_fields()]


def _launch_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["launch"]


def test_the_runtime_flags_are_the_records_fields() -> None:
    assert RUN_FLAGS == ["--skip-checks", "--no-build-ops", "--grace", "--keepalive-timeout",
                         "--drop-failed-nodes"]


@pytest.mark.parametrize("f", run_fields(), ids=lambda f: f.name)
def test_each_flag_is_made_from_its_field(f: object) -> None:
    import dataclasses

    assert isinstance(f, dataclasses.Field)
    (action,) = [a for a in _launch_parser()._actions if flag_name(f) in a.option_strings]
    assert action.dest == f.name and action.default == f.default
    assert action.help is not None and action.help.startswith(f.metadata["help"])
    if f.name.endswith("_s"):  # durations take the one duration rule (docs/units.md)
        assert action.type is duration_type(flag_name(f))
        assert f"(default {f.default:g})" in action.help


def test_defaults_come_from_the_record() -> None:
    run = run_options(_launch_parser().parse_args([]))
    assert run == RunOptions()
    assert (run.grace_s, run.keepalive_s) == (DEFAULT_GRACE_S, DEFAULT_KEEPALIVE_S) == (3.0, 60.0)
    assert LaunchSettings().run == RunOptions()
    # the job flag's command-line default, and the agents' own default grace
    assert _launch_parser().parse_args([]).hang_timeout_s == DEFAULT_HANG_TIMEOUT_S
    assert JobSpec(job_id="j", tasks=()).grace_s == AgentSpec("j", "n", "/d").grace_s \
        == DEFAULT_GRACE_S


def test_flags_fill_the_record() -> None:
    ns = _launch_parser().parse_args(["--grace", "1m", "--keepalive-timeout", "90s", "--skip-checks",
                               "--drop-failed-nodes"])
    assert run_options(ns) == RunOptions(skip_checks=True, grace_s=60.0, keepalive_s=90.0,
                                         drop_failed_nodes=True)


def test_the_job_spec_is_built_once_from_the_record() -> None:
    from tests.render_cases import plan_for

    run = RunOptions(grace_s=7.0, keepalive_s=11.0)
    job = job_from_plan(plan_for("a800-7x2", "torchrun"), attempt=2, run=run,
                        gate_need=("torch",), hang_timeout_s=30.0)
    assert (job.attempt, job.grace_s, job.keepalive_s, job.gate_need, job.hang_timeout_s) == \
        (2, 7.0, 11.0, ("torch",), 30.0)
    spec = job.agent_spec(job.tasks[0])
    assert (spec.grace_s, spec.keepalive_s, spec.hold) == (7.0, 11.0, True)
