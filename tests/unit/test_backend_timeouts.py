"""Backend timeouts matched to the hang timeout (issue 14, Deliver 3): pure, no I/O."""

from __future__ import annotations

import pytest

from clusterkit.backend_timeouts import (
    MIN_PG_TIMEOUT_S,
    PG_TIMEOUT_ENV,
    WATCHDOG_MARGIN_S,
    pg_timeout_from_env,
    pg_timeout_s,
    timeout_env,
)


def test_off_when_the_watchdog_is_off() -> None:
    assert pg_timeout_s(0) is None
    assert timeout_env(0, gpu=True, job_dir="/j") == {}


def test_pg_timeout_follows_the_hang_timeout_above_a_floor() -> None:
    assert pg_timeout_s(20) == MIN_PG_TIMEOUT_S  # a first collective behind a JIT build
    assert pg_timeout_s(900) == 900 + WATCHDOG_MARGIN_S  # the watchdog fires first
    assert pg_timeout_s(900.2) == 901 + WATCHDOG_MARGIN_S


def test_cpu_env_has_no_nccl_variables() -> None:
    env = timeout_env(900, gpu=False, job_dir="/w/job")
    assert env == {PG_TIMEOUT_ENV: "1020", "DEEPSPEED_TIMEOUT": "17"}


def test_gpu_env_turns_on_async_error_handling_and_the_flight_recorder() -> None:
    env = timeout_env(900, gpu=True, job_dir="/w/job/")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/w/job/nccl_trace_rank_"
    assert env["DEEPSPEED_TIMEOUT"] == "17"  # minutes, rounded up


@pytest.mark.parametrize(("value", "expected"), [
    ("1020", 1020.0), (" 60 ", 60.0), ("", 300.0), ("abc", 300.0), ("-5", 300.0),
    ("0", 300.0), ("nan", 300.0), ("inf", 300.0)])
def test_workload_reads_the_contract_variable(value: str, expected: float) -> None:
    assert pg_timeout_from_env({PG_TIMEOUT_ENV: value}, 300.0) == expected


def test_workload_default_without_the_variable() -> None:
    assert pg_timeout_from_env({}, 42.0) == 42.0


def test_deepspeed_reads_the_minutes_we_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's own constant: DEEPSPEED_TIMEOUT minutes (read at import)."""
    import importlib

    monkeypatch.setenv("DEEPSPEED_TIMEOUT", timeout_env(900, gpu=False, job_dir="/j")[
        "DEEPSPEED_TIMEOUT"])
    constants = importlib.import_module("deepspeed.constants")
    constants = importlib.reload(constants)
    try:
        assert constants.default_pg_timeout.total_seconds() == 17 * 60
    finally:
        monkeypatch.delenv("DEEPSPEED_TIMEOUT")
        importlib.reload(constants)


def test_plan_renders_them_on_every_node_and_the_inventory_wins() -> None:
    import dataclasses

    from clusterkit.spec.job import JobOptions
    from tests.render_cases import plan_for

    if "hang_timeout_s" not in {f.name for f in dataclasses.fields(JobOptions)}:
        pytest.skip("JobOptions.hang_timeout_s not in this tree yet (job-spec package)")
    plan = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=1, hang_timeout_s=900.0)
    for node in plan.nodes:
        assert node.env[PG_TIMEOUT_ENV] == "1020"
        assert node.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert node.env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{node.job_dir}/nccl_trace_rank_"
    off = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=1)
    assert all(PG_TIMEOUT_ENV not in n.env for n in off.nodes)
    mine = plan_for("a800-7x2", "torchrun", nodes=1, gpus_per_node=1, hang_timeout_s=900.0,
                    set_env=(("DEEPSPEED_TIMEOUT", "99"),))
    assert mine.nodes[0].env["DEEPSPEED_TIMEOUT"] == "99"  # the user's --set-env wins


def test_launch_hang_timeout_reaches_the_plan_env() -> None:
    """`launch --hang-timeout 60`: the planned ranks get the matching backend timeouts."""
    from clusterkit.cli.cmd_launch import launch_job_options
    from clusterkit.cli.main import build_parser
    from clusterkit.jobs.launch import launch_options

    args = build_parser().parse_args(["launch", "--job-id", "ht", "--hang-timeout", "60"])
    options = launch_options(launch_job_options(args), "local", launcher=args.launcher)
    assert options.hang_timeout_s == 60.0
    from clusterkit.plan.build import plan_job
    from clusterkit.render.artifacts import render_all
    from tests.render_cases import FACTS, inventory

    plan = render_all(plan_job(inventory("a800-7x2"), options, FACTS))
    assert {n.env[PG_TIMEOUT_ENV] for n in plan.nodes} == {str(MIN_PG_TIMEOUT_S)}
