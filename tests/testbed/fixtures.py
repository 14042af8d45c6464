"""pytest fixtures for the namespace test bed (exposed to the bed tier by tests/bed/conftest.py).

One session-wide set of namespace nodes per xdist worker, created lazily by the first
test that asks for it and grown on demand::

    @pytest.mark.testbed(nodes=7)
    def test_x(testbed_nodes): ...          # the first 7 nodes, already up

    @pytest.mark.testbed
    def test_y(testbed): testbed.ensure(3)   # the Testbed object itself

Without root / sshd / ip the test bed tests are skipped with the reason, except
when the environment variable CI is set: then they fail loudly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.testbed import Testbed, TestNode, unavailable_reason

DEFAULT_TESTBED_NODES = 2


def _require_testbed() -> None:
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the test bed cannot run: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def testbed_required() -> None:
    """For tests that build their own test bed: skip (or fail under CI) like `testbed`."""
    _require_testbed()


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    _require_testbed()
    tb = Testbed.create()  # also registers atexit + SIGTERM/SIGHUP teardown
    try:
        yield tb
    finally:
        tb.down()


@pytest.fixture
def testbed_nodes(request: pytest.FixtureRequest, testbed: Testbed) -> list[TestNode]:
    """The first n nodes of the session test bed, n from @pytest.mark.testbed(nodes=n)."""
    marker = request.node.get_closest_marker("testbed")
    n = int(marker.kwargs.get("nodes", DEFAULT_TESTBED_NODES)) if marker else DEFAULT_TESTBED_NODES
    return testbed.ensure(n)
