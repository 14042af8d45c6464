"""Real SSH "nodes" on this host (network + mount + UTS + PID namespaces, one sshd each).

Used by the test suite (fixtures in tests/testbed/fixtures.py, given to tests/bed by its
conftest.py) and by benchmarks; humans use
``python -m tests.testbed``. See docs/testbed.md.
"""

from tests.testbed.core import (
    Testbed,
    TestNode,
    down_all,
    down_prefix,
    temporary,
    unavailable_reason,
)
from tests.testbed.sysutil import TestbedError

__all__ = [
    "TestNode",
    "Testbed",
    "TestbedError",
    "down_all",
    "down_prefix",
    "temporary",
    "unavailable_reason",
]
