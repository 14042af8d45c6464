"""The progress watchdog: when did any rank of the job last make progress? (no I/O)

Each node agent reports ``progress`` events every few seconds: ``idle_s``, the
seconds since the newest progress of any of its ranks (an output line, or a touch
of ``CLUSTERKIT_HEARTBEAT``; the workload writes its step there every step), and
the newest ``step``. Ages, not clock times, so the nodes' clocks need not agree.

The job is *stalled* when no rank on any node made progress for ``hang_timeout_s``:
a rank stuck in a collective blocks the others, so they all go quiet together;
a rank that merely prints less than the others (user scripts often print on rank 0
only) does not count as hung while any other rank still progresses.

Start-up counts double: until some rank reports a step (its first heartbeat; the
workload writes one after each step) the limit is ``STARTUP_FACTOR * hang_timeout_s``.
Imports, DeepSpeed's op builds and a checkpoint load print nothing for long
stretches (measured: 30 s of silence on a loaded test bed), and a hang there is
still caught, only later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_KEEPALIVE_S = 60.0
DUMP_COLLECT_S = 30.0
STARTUP_FACTOR = 2.0  # how long the launcher waits for every node's stacks


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
    started_at: float
    nodes: dict[str, NodeProgress] = field(default_factory=dict)
    fired_at: float | None = None

    def report(self, node: str, ev: dict[str, Any], now: float) -> None:
        idle = ev.get("idle_s")
        step = ev.get("step")
        if isinstance(idle, (int, float)):
            self.nodes[node] = NodeProgress(float(idle), now,
                                            step if isinstance(step, int) else None)

    def idle(self, now: float) -> float:
        """Seconds since any rank of the job made progress (since start before any report)."""
        if not self.nodes:
            return now - self.started_at
        return min(p.idle_now(now) for p in self.nodes.values())

    def limit(self) -> float:
        """The silence allowed now: doubled until the first step is reported."""
        factor = 1.0 if self.last_step() is not None else STARTUP_FACTOR
        return self.hang_timeout_s * factor

    def stalled(self, now: float) -> bool:
        return (self.hang_timeout_s > 0 and self.fired_at is None
                and self.idle(now) > self.limit())

    def last_step(self) -> int | None:
        steps = [p.step for p in self.nodes.values() if p.step is not None]
        return max(steps) if steps else None
