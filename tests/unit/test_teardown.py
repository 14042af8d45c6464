"""The launcher's teardown state machine (clusterkit.launch.teardown), tested as the
table in its docstring and in docs/architecture.md: no processes, no clock."""

from __future__ import annotations

import pytest

from clusterkit.launch.teardown import (
    Begin,
    CloseChannels,
    Event,
    GiveUp,
    Kill,
    Send,
    Stage,
    Teardown,
    Tick,
)
from clusterkit.node.protocol import Control

G = 3.0  # grace_s
TERM, KILL = Send(Control.TERM), Send(Control.KILL)

# (stage before, began_at, event, now) -> (stage after, actions)
TABLE: list[tuple[Stage, float | None, Event, float, Stage, list[object]]] = [
    (Stage.RUNNING, None, Begin(), 10.0, Stage.TERM_SENT, [TERM]),
    (Stage.RUNNING, None, Kill(), 10.0, Stage.KILL_SENT, [TERM, KILL]),
    (Stage.RUNNING, None, Tick(), 99.0, Stage.RUNNING, []),
    (Stage.TERM_SENT, 0.0, Begin(), 1.0, Stage.TERM_SENT, []),
    (Stage.TERM_SENT, 0.0, Tick(), G + 2.0, Stage.TERM_SENT, []),  # not yet: strictly after
    (Stage.TERM_SENT, 0.0, Tick(), G + 2.1, Stage.KILL_SENT, [KILL]),
    (Stage.TERM_SENT, 0.0, Kill(), 1.0, Stage.KILL_SENT, [KILL]),
    (Stage.KILL_SENT, 0.0, Kill(), 1.0, Stage.KILL_SENT, [KILL]),
    (Stage.CLOSED, 0.0, Kill(), G + 5.0, Stage.CLOSED, [KILL]),
    (Stage.KILL_SENT, 0.0, Tick(), G + 4.0, Stage.KILL_SENT, []),
    (Stage.KILL_SENT, 0.0, Tick(), G + 4.1, Stage.CLOSED, [CloseChannels()]),
    (Stage.CLOSED, 0.0, Tick(), G + 15.0, Stage.CLOSED, []),
    (Stage.CLOSED, 0.0, Tick(), G + 15.1, Stage.ABANDONED, [GiveUp()]),
    (Stage.ABANDONED, 0.0, Tick(), G + 99.0, Stage.ABANDONED, []),
    # one late tick passes several rows
    (Stage.TERM_SENT, 0.0, Tick(), G + 16.0, Stage.ABANDONED, [KILL, CloseChannels(), GiveUp()]),
    (Stage.TERM_SENT, 0.0, Tick(), G + 5.0, Stage.CLOSED, [KILL, CloseChannels()]),
]


@pytest.mark.parametrize(("before", "began", "event", "now", "after", "actions"), TABLE)
def test_transition(before: Stage, began: float | None, event: Event, now: float, after: Stage,
                    actions: list[object]) -> None:
    td = Teardown(G, before, began)
    assert td.on(event, now) == actions
    assert td.stage is after


def test_a_whole_teardown_in_order() -> None:
    td = Teardown(G)
    log = []
    for now, event in [(0.0, Tick()), (5.0, Begin()), (6.0, Begin()), (10.1, Tick()),
                       (10.2, Tick()), (12.1, Tick()), (23.1, Tick()), (30.0, Tick())]:
        log.append((now, td.on(event, now)))
    assert [(t, a) for t, a in log if a] == [
        (5.0, [TERM]), (10.1, [KILL]), (12.1, [CloseChannels()]), (23.1, [GiveUp()])]
    assert td.began_at == 5.0 and td.begun


def test_a_second_signal_means_no_timed_kill() -> None:
    td = Teardown(G)
    assert td.on(Begin(), 0.0) == [TERM]
    assert td.on(Kill(), 1.0) == [KILL]
    assert td.on(Tick(), G + 2.5) == []  # KILL went out already
    assert td.on(Tick(), G + 4.5) == [CloseChannels()]
