"""The console budgets of tests/bed/test_console_budget_testbed.py, from recorded launches.

Both launches of that module (a clean run; a lost node and the launcher's restart onto
the spare) were run once on the test bed with ``CLUSTERKIT_RECORD_AGENTS`` set
(clusterkit/launch/recording.py, docs/launch.md): every agent's stdout line as the
launcher read it, the agents' ends, the start results, and the ``[clusterkit]`` lines the
launch said between attempts (tests/fixtures/console_replay/SOURCES.md). Here each
recording is fed again, at its recorded times, through the same code that made the
console: :class:`~clusterkit.launch.runtime.Runtime` (the failure, the replica lines, the
teardown), :func:`clusterkit.launch.orchestrator.show`, and the folding sink
(:class:`~clusterkit.launch.console.FoldingSink` over a
:class:`~clusterkit.fold.LineFolder`, :class:`~clusterkit.launch.console.PlainSink`),
with a clock that only the recording moves. The same budgets and needed lines as the
test bed's are asserted, in milliseconds instead of a minute or two of 3-4 nodes
training. A change to the runtime, the folding rules or the sink that adds lines fails
here. What the recording cannot replay: the node agents' own code (rank labels, the
launchers' failure reports: node/agent/output.py, run for real by the clean run that
stays on the test bed) and the closing lines ``clusterkit launch`` prints after the last
attempt (``job ... finished``, ``summary:``, the summary's JSON line: ``VERB_LINES``).
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from clusterkit.fold import FOLD_WINDOW_S, LineFolder
from clusterkit.launch import console
from clusterkit.launch.console import FoldingSink, PlainSink
from clusterkit.launch.jobspec import JobSpec, NodeTask
from clusterkit.launch.orchestrator import show
from clusterkit.launch.outcome import JobOutcome
from clusterkit.launch.recording import Record, read_records, recorder, replay
from clusterkit.launch.runtime_io import (
    AgentEnded,
    Drained,
    FailedFirst,
    Info,
    NodeDone,
    NodeUp,
    Phase,
    Show,
    Spawned,
    Starting,
    Tick,
    read_line,
)
from clusterkit.node.contract import ENV_RECORD_AGENTS, JobDir
from clusterkit.remote.base import SSHTarget
from tests.console_budget import (
    CLEAN_BUDGET,
    LOSS_BUDGET,
    NEEDED_AFTER_LOSS,
    SAVE_EVERY,
    counted,
    folded_groups_name_their_logs,
)
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "console_replay"
# What `clusterkit launch` prints after the last attempt, outside the recording: the
# "job ... finished" line, "summary: ..." and the summary's JSON line (cli/cmd_launch.py).
VERB_LINES = 3


class _Clock:
    """The fold's clock during a replay: the recorded time of the step being fed."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def _replayed(records: list[Record], monkeypatch: pytest.MonkeyPatch
              ) -> tuple[list[str], list[JobOutcome]]:
    """The console lines the recorded launch makes again, and each attempt's outcome."""
    clock = _Clock()
    monkeypatch.setattr(console, "time", SimpleNamespace(monotonic=clock.monotonic))
    first = next(r.fields["job"] for r in records if "job" in r.fields)
    out = io.StringIO()
    # As make_sink builds a piped launch's console; the timer thread never wakes (the
    # replay releases the fold's due groups at each tick instead, at the recorded time).
    sink = FoldingSink(PlainSink(out), LineFolder(
        FOLD_WINDOW_S, world_size=sum(t["nprocs"] for t in first["tasks"]),
        nodes=len(first["tasks"])), tick_s=3600.0,
        launcher_logs=JobDir(first["tasks"][0]["job_dir"]).node_log("<node>"))
    outcomes: list[JobOutcome] = []
    for step in replay(records):
        clock.now = step.t
        if step.info is not None:
            sink.info(step.info)
        elif step.end_attempt:
            sink.end_attempt()
            assert step.runtime is not None
            outcomes.append(step.runtime.outcome(step.t, {}, []))
        elif step.runtime is not None and step.event is not None:
            for action in step.runtime.on(step.event, step.t):
                if isinstance(action, Info | Show | Phase | NodeUp | NodeDone | FailedFirst):
                    show(sink, action)
            sink._release(final=False)  # what the timer thread does every 0.2 s
    sink.close()
    return counted(out.getvalue()), outcomes


def test_the_replayed_console_of_a_clean_run_fits_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lines, outcomes = _replayed(read_records(FIXTURES / "clean.jsonl"), monkeypatch)
    print("\n".join(lines))
    assert len(outcomes) == 1 and outcomes[0].exit_code == 0
    assert outcomes[0].summary is not None and outcomes[0].summary["finished"]
    assert any("checkpoints replicated: " in ln for ln in lines)
    folded_groups_name_their_logs(lines)
    assert len(lines) + VERB_LINES <= CLEAN_BUDGET, len(lines)


def test_the_replayed_console_of_a_lost_node_and_its_restart_fits_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lines, outcomes = _replayed(read_records(FIXTURES / "lost.jsonl"), monkeypatch)
    print("\n".join(lines))
    assert [o.exit_code for o in outcomes][-1] == 0 and len(outcomes) == 2
    summary = outcomes[-1].summary
    assert summary is not None and summary["resumed_from"] == f"step{SAVE_EVERY}", summary
    text = "\n".join(lines)
    for needed in NEEDED_AFTER_LOSS:
        assert needed in text, (needed, text)
    folded_groups_name_their_logs(lines)
    assert len(lines) + VERB_LINES <= LOSS_BUDGET, len(lines)


def test_a_recording_replays_the_inputs_it_recorded(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What the I/O loop records is what the replay feeds: each input once, in order, the
    ticks between them made again, the lines said between attempts as they were."""
    path = tmp_path / "rec.jsonl"
    monkeypatch.setenv(ENV_RECORD_AGENTS, str(path))
    rec = recorder()
    assert rec is not None and rec.path == str(path)
    task = NodeTask(node="n1", target=SSHTarget("n1", "n1"), python="python3",
                    argv=("train.py",), rank_offset=0, nprocs=1)
    inputs = [Starting(), Spawned(), read_line("n1", "@ck:L n1 0 step 1 loss 0.5"),
              read_line("n1", "Traceback (most recent call last):"),
              AgentEnded("n1", 0), Drained()]
    rec.info("before the attempt")
    rec.attempt(JobSpec(job_id="j", tasks=(task,)), "")
    for event in [*inputs[:3], Tick(), *inputs[3:]]:
        rec.event(event)
    rec.info("inside: not recorded (the runtime says it again)")
    rec.end_attempt()
    steps = list(replay(read_records(path)))
    assert steps[0].info == "before the attempt" and steps[-1].end_attempt
    assert [s.event for s in steps if s.event is not None and not isinstance(s.event, Tick)
            ] == inputs
    assert not any(s.info and "inside" in s.info for s in steps)
