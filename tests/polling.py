"""Waiting in tests: one poll loop with a deadline that fails the test naming what it
waited for."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout: float = 15.0, what: str = "condition not reached",
             interval: float = 0.05) -> None:
    """Poll ``cond`` every ``interval`` s until it is true; an AssertionError saying ``what``
    once ``timeout`` s have passed."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(interval)
