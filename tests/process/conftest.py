"""The process tier: tests that start local processes or open local sockets (the CLI as a
subprocess, agents and fork servers on this machine, a local torchrun) but need no
namespace node (docs/testbed.md, "The suite's tiers"). Its one fixture: ``transport``,
the dispatching transport the collect and recover tests reach their local nodes with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from clusterkit.remote.dispatch import DispatchTransport


@pytest.fixture
def transport() -> Iterator[DispatchTransport]:
    with DispatchTransport() as t:
        yield t
