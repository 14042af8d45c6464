"""The progress watchdog: when did any rank of the job last make progress? (no I/O)

Each node agent reports ``progress`` events every few seconds: ``idle_s``, the
seconds since the newest progress of any of its ranks (an output line, or a touch
of ``CLUSTERKIT_HEARTBEAT``; the workload writes its step there every step), and
the newest ``step``. Ages, not clock times, so the nodes' clocks need not agree.

The job is *stalled* when no rank on any node made progress for ``hang_timeout_s``:
a rank stuck in a collective blocks the others, so they all go quiet together;
a rank that merely prints less than the others (user scripts often print on rank 0
only) does not count as hung while any other rank still progresses.

**The start-up allowance** (the watchdog's word, issue 25): the clock starts when
the ranks are started (:meth:`Watchdog.begin`: the gate's GO, or the agents'
start without a gate), and for the first ``hangrule.STARTUP_FACTOR * hang_timeout_s`` the
watchdog does not fire: imports, DeepSpeed's op builds and a checkpoint load print
nothing for long stretches (measured: 30 s of silence on a loaded test bed). The
allowance ends early at the first sign of training: a heartbeat with a step
number, or a rank's output line that reads as a step (:func:`hangrule.step_of`: ``step 10``,
``step=10``, ``Step: 10/30``). After it, the limit is ``hang_timeout_s`` of
silence, and the message says which limit fired (:meth:`Watchdog.check`). A
script that prints but never reports a step is held to the plain limit once the
allowance has passed: its output lines are its progress.

The rule itself (allowance, limits, messages) is :func:`clusterkit.node.hangrule.judge`,
the one the batch script's watchdog (node/slurm/watch.py) applies too; this class
keeps what launch knows: the agents' reports and the lines the launcher sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clusterkit.node import hangrule
from clusterkit.node.protocol import Progress

__all__ = ["DUMP_COLLECT_S", "NodeProgress", "Watchdog", "ping_interval"]

DUMP_COLLECT_S = 30.0  # how long the launcher waits for every node's stacks
# An agent's idle before its ranks printed counts from the agent's own start, so it
# can come out up to this much below the time since GO: still "silent since the start".
SINCE_START_SLACK_S = 1.0


def ping_interval(keepalive_s: float) -> float:
    """PINGs often enough that two may be lost before an agent gives up."""
    return max(0.5, min(5.0, keepalive_s / 4))


@dataclass
class NodeProgress:
    idle_s: float  # as reported
    seen_at: float  # launcher's monotonic clock when the report came
    step: int | None = None

    def idle_now(self, now: float) -> float:
        return self.idle_s + (now - self.seen_at)


@dataclass
class Watchdog:
    hang_timeout_s: float
    started_at: float  # until begin(): the launcher's start (no firing before begin)
    nodes: dict[str, NodeProgress] = field(default_factory=dict)
    fired_at: float | None = None
    begun: bool = False  # the ranks were started: the start-up allowance runs
    training_at: float | None = None  # first sign of training (step line or heartbeat step)

    def begin(self, now: float) -> None:
        """The ranks are being started now: the start-up allowance counts from here."""
        if not self.begun:
            self.begun, self.started_at = True, now

    def report(self, ev: Progress, now: float) -> bool:
        """A node's progress report; True when its step is the first sign of training."""
        prev = self.nodes.get(ev.node)
        # Both are upper bounds of the true silence: a line the launcher saw after
        # the agent measured must not be forgotten by the older report.
        idle = min(float(ev.idle_s), prev.idle_now(now)) if prev else float(ev.idle_s)
        step = ev.step if ev.step is not None else (prev.step if prev else None)
        self.nodes[ev.node] = NodeProgress(idle, now, step)
        return ev.step is not None and self.saw_training(now)

    def output(self, node: str, now: float) -> None:
        """A rank of ``node`` printed a line now (the launcher sees every line at once;
        the agents' reports come every few seconds)."""
        prev = self.nodes.get(node)
        self.nodes[node] = NodeProgress(0.0, now, prev.step if prev else None)

    def saw_training(self, now: float) -> bool:
        """A sign of training (a step line, a heartbeat step); True the first time."""
        if self.training_at is None:
            self.training_at = now
            return True
        return False

    def idle(self, now: float) -> float:
        """Seconds since any rank of the job made progress, at most since begin().

        An agent's idle time before its ranks printed counts from the agent's own
        start (before the gate); the ranks cannot be silent for longer than they ran.
        """
        since_start = now - self.started_at
        if not self.nodes:
            return since_start
        return min(since_start, *(p.idle_now(now) for p in self.nodes.values()))

    @property
    def allowance_s(self) -> float:
        return hangrule.allowance(self.hang_timeout_s)

    def verdict(self, now: float) -> hangrule.Verdict:
        """The rule's answer at ``now`` (node/hangrule.py): the limit that applies and
        whether it is passed; ask after :meth:`begin`."""
        idle = self.idle(now)
        silent = idle >= now - self.started_at - SINCE_START_SLACK_S  # since the ranks started
        return hangrule.judge(now, self.started_at, None if silent else now - idle,
                              self.training_at is not None, self.hang_timeout_s,
                              self.allowance_s)

    def trip(self, now: float) -> str | None:
        """:meth:`check`, and when it fires, the watchdog has fired (once: at ``now``)."""
        why = self.check(now)
        if why is not None:
            self.fired_at = now
        return why

    def hang_idle_s(self) -> float | None:
        """How long every rank had been silent when it fired (None: it did not)."""
        return None if self.fired_at is None else self.idle(self.fired_at)

    def stalled(self, now: float) -> bool:
        return self.check(now) is not None

    def check(self, now: float) -> str | None:
        """The watchdog's verdict at ``now``: None, or why it fires (the limit applied)."""
        if self.fired_at is not None or not self.begun:
            return None
        verdict = self.verdict(now)
        return verdict.reason if verdict.hung else None

    def last_step(self) -> int | None:
        steps = [p.step for p in self.nodes.values() if p.step is not None]
        return max(steps) if steps else None
