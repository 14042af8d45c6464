"""The launch runtime's records: per node, the folded gate, and the stage names.

Split from :mod:`clusterkit.launch.runtime` (the transitions) so that each file
stays readable; the runtime owns one :class:`NodeState` per node and one
:class:`GateState`, and :class:`Stage` names the state column of its table
(docs/architecture.md, "The launch runtime").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from clusterkit.launch.gate import GATE_TIMEOUT_S, GateResult, judge
from clusterkit.launch.jobspec import NodeTask
from clusterkit.node import protocol

TAIL_LINES = 15  # per node and per rank: what a failure shows of its output


class Stage(Enum):
    """Where the attempt is: the state column of the runtime's table, stored in
    ``Runtime.stage`` and read by every handler before it acts."""

    CONNECTING = "connecting"  # the agents are being started
    GATE = "gate"  # the folded gate waits for every node's facts
    RUNNING = "running"  # the ranks were started (GO, or no gate)
    COLLECTING = "collecting"  # the watchdog fired: DUMP sent, the stacks come in
    STOPPING = "stopping"  # the teardown began (its own stages: launch/teardown.py)
    FINISHED = "finished"  # every agent ended (or was given up on)


@dataclass
class NodeState:
    """One node's agent as the launcher knows it."""

    task: NodeTask
    code: int | None = None  # its session's exit (-1: dropped, never started, given up)
    dropped: bool = False
    failed_rank: protocol.RankFailed | None = None  # the earliest report about this node
    started: bool = False  # its agent reported Started (its ranks run)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    rank_tails: dict[int, deque[str]] = field(default_factory=dict)

    def record(self, rank: int | None, text: str) -> None:
        """Keep the line for the failure's tail (a rank's also in its own tail)."""
        self.tail.append(text if rank is None else f"r{rank}: {text}")
        if rank is not None:
            self.rank_tails.setdefault(rank, deque(maxlen=TAIL_LINES)).append(text)

    def last_words(self) -> str:
        """The last non-blank line it printed (why an agent ended before reporting)."""
        return next((ln for ln in reversed(self.tail) if ln.strip()), "no output").strip()


@dataclass
class GateState:
    """The pre-launch gate folded into the agents (``need`` None: no gate)."""

    need: tuple[str, ...] | None
    last: float  # the start, then the latest node's report: the timeout counts from here
    facts: dict[str, dict[str, object]] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)
    result: GateResult | None = None
    same_python: bool = True  # the backend's: see gate.judge
    script_here: bool = True  # the user's script on the launching host: gate.script_is_here

    @property
    def undecided(self) -> bool:
        return self.need is not None and self.result is None

    @property
    def refused(self) -> bool:
        return self.result is not None and not self.result.ok

    @property
    def passed(self) -> bool:
        """Nothing holds the ranks back: no gate, or it said GO."""
        return self.need is None or (self.result is not None and self.result.ok)

    def start(self, now: float) -> None:
        """The agents are being started: the timeout counts from here."""
        self.last = now

    def report(self, node: str, facts: dict[str, object], now: float) -> None:
        """``node``'s facts came (a report restarts the timeout)."""
        self.facts[node] = dict(facts)
        self.last = now

    def problem(self, node: str, why: str) -> None:
        """``node`` cannot report: its agent did not start, or it ended before reporting."""
        self.problems[node] = why

    def waits_for(self, node: str) -> bool:
        """True while the gate is undecided and ``node`` has not reported yet."""
        return self.undecided and node not in self.facts

    def decide(self, order: list[str]) -> GateResult | None:
        """The verdict, once every node reported its facts or a problem (else None)."""
        if not self.undecided or any(n not in self.facts and n not in self.problems
                                     for n in order):
            return None
        assert self.need is not None
        self.result = judge(self.facts, self.problems, order, self.need,
                            same_python=self.same_python, script_here=self.script_here)
        return self.result

    def timed_out(self, now: float, order: list[str]) -> bool:
        """GATE_TIMEOUT_S of silence: every node not reported yet gets that problem."""
        # Silence, not slowness, is the failure: while nodes keep reporting (32 agents
        # starting at once on a loaded machine took > 20 s in all) the wait goes on;
        # GATE_TIMEOUT_S after the start or the latest report, the missing ones fail.
        if not self.undecided or now - self.last < GATE_TIMEOUT_S:
            return False
        for n in order:
            if n not in self.facts:
                self.problems.setdefault(
                    n, f"the node agent did not report within {GATE_TIMEOUT_S:.0f} s")
        return True
