"""The progress watchdog's one rule (clusterkit/node/hangrule.py; issue 31 item 5), as a
table, and the batch script's watchdog (node/slurm/watch.py) applying it with a fake clock:
launch's watchdog applies the same rule (tests/process/test_watchdog.py's table)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterkit.node import hangrule
from clusterkit.node.hangrule import HANG_TIMEOUT, OFF, STARTUP, judge
from clusterkit.node.slurm import watch

T = 20.0  # --hang-timeout 20: the start-up allowance is 40 s
ALLOW = hangrule.allowance(T)
SILENT = ("no sign of training within the start-up allowance of 40 s (2 \u00d7 --hang-timeout 20): "
          "no output or heartbeat from any rank since they started")

# (name, now, last_progress, training, hung, limit, reason contains); the ranks start at 100.
RULE_TABLE: list[tuple[str, float, float | None, bool, bool, str, str]] = [
    ("start-up, silent 30 s (fused_adam building): within the allowance", 130.0, None, False,
     False, STARTUP, ""),
    ("start-up, printed, then silent past --hang-timeout: still the allowance", 139.9, 105.0,
     False, False, STARTUP, ""),
    ("start-up silent until exactly the allowance's end: over it", 140.0, None, False, True,
     STARTUP, SILENT + " 40 s ago"),
    ("printed during start-up, no step: the allowance passed, named", 140.0, 110.0, False, True,
     STARTUP, "no progress on any rank for 30 s (--hang-timeout 20; the start-up allowance of "
              "40 s (2 \u00d7 --hang-timeout 20) passed with no step line or heartbeat)"),
    ("no step ever, output kept coming: its lines are its progress", 200.0, 185.0, False, False,
     HANG_TIMEOUT, ""),
    ("after the first step: exactly at --hang-timeout is not over it", 130.0, 110.0, True, False,
     HANG_TIMEOUT, ""),
    ("after the first step: past --hang-timeout", 130.5, 110.0, True, True, HANG_TIMEOUT,
     "no progress on any rank for 20 s (--hang-timeout 20)"),
    ("a first step early ends the allowance at once", 125.0, 104.0, True, True, HANG_TIMEOUT,
     "for 21 s (--hang-timeout 20)"),
    ("progress older than the start counts from the start", 130.0, 50.0, True, True,
     HANG_TIMEOUT, "for 30 s"),
]


@pytest.mark.parametrize("row", RULE_TABLE, ids=[r[0] for r in RULE_TABLE])
def test_rule_table(row: tuple[str, float, float | None, bool, bool, str, str]) -> None:
    _name, now, last, training, hung, limit, reason = row
    v = judge(now, 100.0, last, training, T, ALLOW)
    assert (v.hung, v.limit) == (hung, limit), v
    assert v.limit_s == (ALLOW if limit == STARTUP else T)
    assert (reason in v.reason) if hung else v.reason == "", v


def test_rule_off_and_idle() -> None:
    v = judge(1e9, 0.0, None, False, 0.0, 0.0)
    assert (v.hung, v.limit) == (False, OFF)
    assert judge(130.0, 100.0, 120.0, True, T, ALLOW).idle_s == 10.0
    assert hangrule.step_of("[rank0]: step 10/30 | loss 4.8") == 10
    assert hangrule.step_of("steps=5 loaded") is None


class FakeNode:
    """A clock that each sleep advances, a step that runs until ``ends_at``, and what
    the files show at each poll: ``events`` maps a time to (newest write, training)."""

    def __init__(self, ends_at: float, events: dict[float, tuple[float, bool]]) -> None:
        self.now, self.ends_at, self.events = 1000.0, ends_at, events
        self.newest, self.trained = 0.0, False

    def sleep(self, s: float) -> None:
        self.now += s

    def alive(self) -> bool:
        return self.now < self.ends_at

    def scan(self, _training_seen: bool) -> tuple[float, bool]:
        for at, (newest, trained) in self.events.items():
            if at <= self.now:
                self.newest, self.trained = max(self.newest, newest), self.trained or trained
        return self.newest, self.trained


def _run_watch(node: FakeNode, hang: float = T) -> hangrule.Verdict | None:
    state = watch.Watch(node.now, hang, hangrule.allowance(hang))
    return watch.run_watch(state, node.scan, node.alive, clock=lambda: node.now,
                                sleep=node.sleep)


def test_slurmwatch_gives_a_slow_start_its_allowance() -> None:
    """The issue's job: --hang-timeout 20, the ranks build fused_adam for 30 s without a
    line, then train. The batch watchdog used to end it after 21 s; now it does not fire."""
    node = FakeNode(ends_at=1000.0 + 90, events={
        1030.0: (1030.0, True), **{1030.0 + s: (1030.0 + s, False) for s in range(2, 60, 2)}})
    assert _run_watch(node) is None


def test_slurmwatch_fires_at_the_allowance_and_after_it_at_the_limit() -> None:
    silent = FakeNode(ends_at=1000.0 + 600, events={})
    v = _run_watch(silent)
    assert v is not None and v.limit == STARTUP and silent.now == 1040.0
    assert v.reason.startswith(SILENT)
    stalled = FakeNode(ends_at=1000.0 + 600, events={1010.0: (1010.0, True)})
    v = _run_watch(stalled)  # a step at 10 s, then nothing: the plain limit, as launch's
    assert v is not None and v.limit == HANG_TIMEOUT and stalled.now == 1032.0
    assert v.reason == "no progress on any rank for 22 s (--hang-timeout 20)"


def test_scan_reads_step_lines_and_heartbeats_of_this_run_only(tmp_path: Path) -> None:
    logs, beats = tmp_path / "logs", tmp_path / "progress"
    logs.mkdir()
    beats.mkdir()
    (logs / "slurm-1.out").write_text("step 5 loss 1.0 (the run before the requeue)\n")
    scan = watch.Scan(str(logs), str(beats), since=0.0)
    assert scan(False)[1] is False  # the earlier run's lines are not this run's
    with open(logs / "slurm-1.out", "a") as fh:
        fh.write("[rank0]: building fused_adam ...\n[rank0]: step")
    assert scan(False)[1] is False  # a line still being written is not read yet
    with open(logs / "slurm-1.out", "a") as fh:
        fh.write(" 1/30 | loss 4.8\n")
    newest, training = scan(False)
    assert training and newest > 0
    beat_scan = watch.Scan(str(logs), str(beats), since=0.0)
    assert beat_scan(False)[1] is False
    (beats / "rank3.heartbeat").write_text("7")
    assert beat_scan(False)[1] is True
