"""How one attempt ended: :class:`JobOutcome`, and the failure it names (:class:`RankFailure`).

Built by the launch runtime (:meth:`clusterkit.launch.runtime.Runtime.outcome`) from its
state plus what only the I/O loop knows (the time taken, the out-of-band sweep);
read by ``launch.run`` (the job record, relaunches) and ``cli/cmd_launch.py`` (the
summary lines), each importing it from here.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from clusterkit.launch.gate import GateResult
from clusterkit.launch.replica_events import ReplicaLedger
from clusterkit.launch.stacks import StackSummary


@dataclass
class RankFailure:
    node: str
    rank: int | None
    local_rank: int | None
    code: int
    reason: str  # "exit" | "connection-dropped" | "start-failed" | "hang"
    tail: list[str] = field(default_factory=list)

    def where(self) -> str:
        return self.node if self.rank is None else f"{self.node} rank {self.rank}"


@dataclass
class JobOutcome:
    exit_code: int
    failure: RankFailure | None
    summary: dict[str, Any] | None
    node_codes: dict[str, int]
    interrupted: bool
    elapsed_s: float
    leftovers: dict[str, int] = field(default_factory=dict)  # node -> processes still found
    gate: GateResult | None = None  # set when the folded gate ran; not ok: nothing started
    stacks: StackSummary | None = None  # the watchdog fired: where every rank was
    unconfirmed: list[str] = field(default_factory=list)  # nodes whose teardown we could not check
    hang_idle_s: float | None = None
    # Checkpoint copies the agents reported complete (issue 22): tag -> source -> holders.
    replicas: ReplicaLedger = field(default_factory=ReplicaLedger)


def exit_status(code: int) -> int:
    """A rank killed by signal N reports -N; a shell would say 128+N."""
    return 128 - code if code < 0 else code


def describe_failure(f: RankFailure) -> str:
    """The failure's cause in words, for ``<where> failed (<cause>)``."""
    if f.reason == "connection-dropped":
        return "the SSH connection dropped"
    if f.reason == "start-failed":
        return "the agent could not be started"
    if f.reason == "hang":
        return "no progress: the watchdog's stack summary names it"
    if f.code < 0:
        try:
            return f"killed by {signal.Signals(-f.code).name}"
        except ValueError:
            return f"killed by signal {-f.code}"
    return f"exit code {f.code}"
