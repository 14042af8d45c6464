"""The unit tier: tests that run in the pytest process alone (docs/testbed.md, "The suite's
tiers"). What makes them fast and sure is held here, not hoped for: a test of this tier
that starts a process (subprocess, fork, spawn, os.system) or opens a network socket
fails with the tier it belongs to instead (tests/process, or tests/bed for nodes)."""

from __future__ import annotations

import _posixsubprocess
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# What starts a process or reaches the network, each at the name its callers look up
# when they call it (subprocess binds fork_exec at import: its own name too).
_BARRED: tuple[tuple[Any, str], ...] = (
    (subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"),
    (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
    (socket.socket, "connect"), (socket.socket, "connect_ex"), (socket.socket, "bind"),
)


def _barred(name: str) -> Callable[..., Any]:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError(f"a unit-tier test called {name}: it belongs in tests/process "
                             "(local processes) or tests/bed (nodes)")
    return refuse


@pytest.fixture(autouse=True)
def _in_this_process_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for owner, attr in _BARRED:
        if hasattr(owner, attr):
            label = f"{getattr(owner, '__name__', owner)}.{attr}"
            monkeypatch.setattr(owner, attr, _barred(label))
    yield
