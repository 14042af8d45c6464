"""The test bed tier: tests on namespace nodes with real sshd (tests/testbed, docs/testbed.md,
"The suite's tiers"). Their fixtures, here and nowhere else."""

from tests.testbed.fixtures import testbed, testbed_nodes, testbed_required  # noqa: F401
