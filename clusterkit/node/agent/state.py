"""The node agent's state: holding, running, stopping, exited, and its guarded moves.

Shipped with the agent (``ship.py`` ``PROGRAMS``); standard library only. The
control reader (``TERM``, ``KILL``, ``GO``, EOF), the main loop (a failed rank, the
dead-man switch, the end) and the signal handler all move it, through
:meth:`Lifecycle.move` only: a move that :data:`MOVES` does not list changes nothing.
"""

from __future__ import annotations

import threading
from enum import Enum


class State(Enum):
    HOLDING = "holding"  # the files written, the ranks not started (the gate: until GO)
    RUNNING = "running"  # GO (or no gate): the ranks or the launcher start
    STOPPING = "stopping"  # a stop was asked for: TERM, KILL, EOF, a signal, a failed rank
    EXITED = "exited"  # swept, the exit reported


# A stop wins: once stopping, a late GO starts nothing (issue 30); nothing leaves EXITED.
MOVES = frozenset({
    (State.HOLDING, State.RUNNING), (State.HOLDING, State.STOPPING),
    (State.RUNNING, State.STOPPING), (State.HOLDING, State.EXITED),
    (State.RUNNING, State.EXITED), (State.STOPPING, State.EXITED),
})


class Lifecycle:
    """The state, and two events to wait on: ``moved`` (any move) and ``stopping``."""

    def __init__(self) -> None:
        self.state = State.HOLDING
        # Reentrant: the signal handler may move it while the main thread is moving it.
        self._lock = threading.RLock()
        self.moved = threading.Event()
        self.stopping = threading.Event()

    def move(self, to: State) -> bool:
        """``state -> to`` when MOVES has it; False (nothing changes) otherwise."""
        with self._lock:
            if (self.state, to) not in MOVES:
                return False
            self.state = to
        if to is State.STOPPING:
            self.stopping.set()
        self.moved.set()
        return True
