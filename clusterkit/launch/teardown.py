"""The launcher's job-wide teardown as a pure state machine (no I/O, no clock of its own).

The launch runtime (:mod:`clusterkit.launch.runtime`) feeds it events with the time
they happened (``Begin``: the first failure, a refused gate or the first
SIGINT/SIGTERM; ``Kill``: a second signal; ``Tick``: every tick of the orchestrator's
loop) and turns the actions it returns into its own, addressed to the agents still
running (send a control word, close their channels; giving up marks them dropped).
Like :mod:`clusterkit.launch.watchdog`, every transition is a plain function of
state, event and time, so the table below is tested as a table
(tests/unit/test_teardown.py) and written down in docs/architecture.md.

=========  ===========================  ==========  ==========================
stage      event (waited: since Begin)  next stage  actions
=========  ===========================  ==========  ==========================
running    Begin                        term-sent   send TERM
running    Kill                         kill-sent   send TERM, send KILL
running    Tick                         running     (none)
term-sent  Begin                        term-sent   (none: one teardown a job)
term-sent  Tick, waited > grace + 2 s   kill-sent   send KILL
any later  Kill                         kill-sent+  send KILL (every time)
kill-sent  Tick, waited > grace + 4 s   closed      close channels (agents see EOF)
closed     Tick, waited > grace + 15 s  abandoned   give up (unfinished: dropped)
=========  ===========================  ==========  ==========================

A second signal skips the timed KILL (it was sent already); one Tick may pass
several rows (a loop that stalled for grace + 15 s sends KILL, closes and gives up).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from clusterkit.node.protocol import DEFAULT_GRACE_S, Control

# After TERM, the agents' own sweep has grace_s to end the ranks; these margins are
# the launcher's patience beyond it (the agent's SIGKILL, its exit event, the SSH hop).
KILL_AFTER_S = 2.0  # then KILL to every agent still running
CLOSE_AFTER_S = 4.0  # then close their channels: an agent treats EOF as a teardown
GIVE_UP_AFTER_S = 15.0  # then stop waiting: the nodes left count as dropped


class Stage(IntEnum):
    """Ordered: a stage never goes back."""

    RUNNING = 0
    TERM_SENT = 1
    KILL_SENT = 2
    CLOSED = 3
    ABANDONED = 4


@dataclass(frozen=True)
class Begin:
    """Stop the job: the first failure, a refused gate, the first SIGINT/SIGTERM."""


@dataclass(frozen=True)
class Kill:
    """Kill at once: a second SIGINT/SIGTERM."""


@dataclass(frozen=True)
class Tick:
    """Time passed (the orchestrator's loop ticks at least every 0.1 s)."""


Event = Begin | Kill | Tick


@dataclass(frozen=True)
class Send:
    """Write this control word to every agent still running."""

    word: Control


@dataclass(frozen=True)
class CloseChannels:
    """Close every running agent's stdin and end its session."""


@dataclass(frozen=True)
class GiveUp:
    """Stop waiting: every agent not finished yet counts as dropped."""


Action = Send | CloseChannels | GiveUp


@dataclass
class Teardown:
    grace_s: float = DEFAULT_GRACE_S
    stage: Stage = Stage.RUNNING
    began_at: float | None = None

    @property
    def begun(self) -> bool:
        return self.stage is not Stage.RUNNING

    def on(self, event: Event, now: float) -> list[Action]:
        """The actions for ``event`` at ``now`` (the launcher's monotonic clock)."""
        if isinstance(event, Begin):
            return self._begin(now)
        if isinstance(event, Kill):
            actions = self._begin(now)
            self.stage = max(self.stage, Stage.KILL_SENT)
            return [*actions, Send(Control.KILL)]
        return self._tick(now)

    def _begin(self, now: float) -> list[Action]:
        if self.begun:
            return []
        self.stage, self.began_at = Stage.TERM_SENT, now
        return [Send(Control.TERM)]

    def _tick(self, now: float) -> list[Action]:
        if self.began_at is None:
            return []
        waited = now - self.began_at
        actions: list[Action] = []
        if self.stage is Stage.TERM_SENT and waited > self.grace_s + KILL_AFTER_S:
            self.stage = Stage.KILL_SENT
            actions.append(Send(Control.KILL))
        if self.stage is Stage.KILL_SENT and waited > self.grace_s + CLOSE_AFTER_S:
            self.stage = Stage.CLOSED
            actions.append(CloseChannels())
        if self.stage is Stage.CLOSED and waited > self.grace_s + GIVE_UP_AFTER_S:
            self.stage = Stage.ABANDONED
            actions.append(GiveUp())
        return actions
