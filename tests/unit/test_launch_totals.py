"""Issue 25: the final line's time counts the whole job, every attempt and restart."""

from __future__ import annotations

import contextlib
import io
import time
import types
from pathlib import Path
from typing import Any

import pytest

from clusterkit.launch import run as run_mod
from clusterkit.launch.console import PlainSink
from clusterkit.launch.outcome import JobOutcome
from clusterkit.launch.registry import Registry
from clusterkit.launch.run import LaunchSettings, launch
from clusterkit.spec.job import JobOptions
from tests.render_cases import plan_for


def test_totals_count_every_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 1 fails after 102 s, a restart check takes 7 s, attempt 2 finishes after
    138 s: the job took 247 s, not the last attempt's 138 (what the final line said)."""
    clock = [1000.0]
    attempts = iter([(1, 102.0), (0, 138.0)])

    class FakeOrchestrator:
        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        def run(self) -> JobOutcome:
            code, took = next(attempts)
            clock[0] += took
            return JobOutcome(exit_code=code, failure=None, summary=None, node_codes={},
                              interrupted=False, elapsed_s=took)

    def restart(options: Any, plan: Any, *_a: Any) -> tuple[Any, Any]:
        clock[0] += 7.0  # --drop-failed-nodes' gate round, say
        return plan, options

    monkeypatch.setattr(run_mod, "Orchestrator", FakeOrchestrator)
    monkeypatch.setattr(run_mod, "_prepare_restart", restart)
    monkeypatch.setattr(run_mod, "time", types.SimpleNamespace(
        monotonic=lambda: clock[0], strftime=time.strftime))
    plan = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=2)
    result = launch(JobOptions(job_id=plan.job_id), lambda _o: plan, transport=None,  # type: ignore[arg-type]
                    registry=Registry(tmp_path), settings=LaunchSettings(relaunches=1),
                    sink=PlainSink(io.StringIO()), decisions=plan)
    assert result.exit_code == 0 and len(result.outcomes) == 2
    assert result.elapsed_s == 247.0
    assert result.timing() == "247.0 s in all (attempts 102.0 + 138.0 s)"
    from clusterkit.cli.cmd_launch import _print_summary

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _print_summary(result)
    assert out.getvalue() == (f"[clusterkit] job {plan.job_id} finished after 2 attempts: 2 nodes, "
                              "4 ranks, 247.0 s in all (attempts 102.0 + 138.0 s)\n")
    result.outcomes.pop(0)
    assert result.timing() == "247.0 s"
