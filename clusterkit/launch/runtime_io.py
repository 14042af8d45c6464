"""The launch runtime's alphabet: the events it is fed and the actions it returns.

Plain frozen values, so a test writes a row of the runtime's table as
``(state, event) -> (state, actions)`` and compares the actions with ``==``
(tests/process/test_runtime.py). Events come from the I/O loop
(:mod:`clusterkit.launch.orchestrator`): an agent's stdout line becomes one
event through :func:`read_line`, the one place the launcher decodes the
``@ck:`` lines (with :func:`clusterkit.node.protocol.decode`). Actions are
performed by the same loop; each says which nodes it addresses, so the loop
needs no state of its own beyond the sessions.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from clusterkit.launch.stacks import RankStack, StackSummary
from clusterkit.node import protocol
from clusterkit.node.protocol import Control

# ---------------------------------------------------------------------- events


@dataclass(frozen=True)
class Starting:
    """The attempt begins: the agents are about to be started."""


@dataclass(frozen=True)
class Spawned:
    """Every agent's start was tried; ``failed``: node -> why its start failed."""

    failed: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Received:
    """One ``@ck:`` message from ``node``'s agent: a :class:`~protocol.Line` or an event."""

    node: str
    msg: protocol.Line | protocol.AnyEvent


@dataclass(frozen=True)
class AgentOutput:
    """A line of the agent's stdout outside the protocol (a traceback of the agent)."""

    node: str
    text: str


@dataclass(frozen=True)
class Unreadable:
    """An ``@ck:E`` line this side cannot decode (another version, a torn line)."""

    node: str
    error: str


@dataclass(frozen=True)
class AgentEnded:
    """``node``'s agent session ended: its exit code; ``dropped``: the connection broke."""

    node: str
    code: int
    dropped: bool = False


@dataclass(frozen=True)
class Signalled:
    """The launcher got a signal (``SIGINT``, ``SIGTERM``, ``SIGUSR1``, ``SIGUSR2``)."""

    sig: signal.Signals


@dataclass(frozen=True)
class Tick:
    """Time passed (the loop turns at least every 0.1 s): timeouts, PING, watchdog."""


@dataclass(frozen=True)
class Drained:
    """Every agent ended and every line left was read: the attempt is over."""


Event = (Starting | Spawned | Received | AgentOutput | Unreadable | AgentEnded | Signalled
         | Tick | Drained)


def read_line(node: str, line: str) -> Event:
    """The event one line of ``node``'s agent stdout is."""
    try:
        msg = protocol.decode(line)
    except protocol.ProtocolError as exc:
        return Unreadable(node, str(exc))
    return AgentOutput(node, line) if msg is None else Received(node, msg)


# ---------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Send:
    """Write ``word`` on the stdin of these nodes' agents (a gone session: skipped)."""

    word: Control
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Close:
    """Close these agents' stdin (they see EOF and sweep); ``terminate``: end the session."""

    nodes: tuple[str, ...]
    terminate: bool


@dataclass(frozen=True)
class Info:
    """A ``[clusterkit]`` line on the console."""

    text: str


@dataclass(frozen=True)
class Show:
    """A rank's or an agent's output line on the console (``[node rR] text``)."""

    node: str
    rank: int | None
    text: str
    agent: bool = False


class ConsolePhase(StrEnum):
    """Where a launch is, in order, for the console's status line (only forward within
    an attempt): the agents' sessions start; they report their facts to the gate; GO,
    the ranks start; every node's ranks run but no step yet (imports,
    init_process_group, model build, checkpoint load); a step line or heartbeat was
    seen; the teardown. The runtime derives it from its stage (``Runtime.on``)."""

    CONNECTING = "connecting"
    GATE = "gate"
    STARTING = "starting ranks"
    INITIALISING = "initialising"
    TRAINING = "training"
    TEARING_DOWN = "tearing down"

    @property
    def order(self) -> int:
        return list(ConsolePhase).index(self)


@dataclass(frozen=True)
class Phase:
    """The console's status line moves to phase ``name``."""

    name: ConsolePhase
    detail: str = ""


@dataclass(frozen=True)
class NodeUp:
    node: str


@dataclass(frozen=True)
class NodeDone:
    node: str
    code: int


@dataclass(frozen=True)
class FailedFirst:
    """The console folds the other ranks' collateral output from here on."""

    rank: int
    where: str
    logs: str


@dataclass(frozen=True)
class ReportStacks:
    """The watchdog's verdict: save every rank's dump, print the summary."""

    stacks: Mapping[int, RankStack]
    summary: StackSummary


@dataclass(frozen=True)
class Finish:
    """The attempt is over; ``sweep``: nodes to clean up out of band (``agent.core --stop``)."""

    sweep: tuple[str, ...] = ()


Action = (Send | Close | Info | Show | Phase | NodeUp | NodeDone | FailedFirst | ReportStacks
          | Finish)


def parse_json(text: str) -> dict[str, Any] | None:
    """A JSON object, or None (a summary line or a sweep's answer that is not one)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
