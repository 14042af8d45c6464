"""pytest fixtures for the Slurm test bed (given to the Slurm tier by
tests/bed/slurm/conftest.py).

``slurm_bed`` is session-wide: the cluster comes up once (about a second on top
of the namespace nodes) over ``SLURM_NODES`` nodes and is torn down at the end of
the session, also when a test fails. Tests use ``slurm_bed.env`` for clients::

    @pytest.mark.slurm
    def test_x(slurm_bed): subprocess.run(["sbatch", ...], env=slurm_bed.env)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurmbed.cluster import SlurmBed, slurm_unavailable_reason
from tests.testbed import Testbed, temporary

SLURM_NODES = 7


@pytest.fixture(scope="session")
def slurm_bed(testbed: Testbed) -> Iterator[SlurmBed]:
    reason = slurm_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the Slurm test bed cannot run: {reason}", pytrace=False)
        pytest.skip(reason)
    bed = SlurmBed.start(testbed, SLURM_NODES)
    try:
        yield bed
    finally:
        bed.stop()


@pytest.fixture
def slurm(slurm_bed: SlurmBed) -> Iterator[SlurmBed]:
    """The session cluster, checked idle before and after the test (no job leaks between tests)."""
    slurm_bed.wait_all_jobs_gone(timeout=30)
    yield slurm_bed
    slurm_bed.client(["scancel", "--full", "--partition=debug"], check=False)
    slurm_bed.wait_all_jobs_gone(timeout=30)
    # A failed test may leave ranks Slurm lost track of: they must not eat the CPUs of
    # the next test (tests assert "nothing left" themselves where it matters).
    slurm_bed.kill_job_leftovers()


@contextlib.contextmanager
def user_slurm_bed(user: str, slots: int, nodes: int = 5) -> Iterator[tuple[SlurmBed, Path]]:
    """A test bed of its own with an unprivileged ``user``, a Slurm over its ``nodes``
    nodes (Slurm runs a job as its submitter: the batch script, its steps and the ranks
    are the user's) and the user's inventory (``gpus: 0``); always torn down."""
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with temporary(nodes, user=user) as tb:
        assert tb.user is not None
        bed = SlurmBed.start(tb, nodes)
        try:
            yield bed, tb.write_inventory(tb.user.home / "inv.yaml", slots=slots, gpus=0,
                                          as_user=True)
        finally:
            bed.stop()
