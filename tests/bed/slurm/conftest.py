"""The Slurm tier: tests on the real Slurm test bed (tests/slurmbed), on top of the namespace
nodes of tests/bed/conftest.py. Its fixtures, here and nowhere else."""

from tests.slurmbed.fixtures import slurm, slurm_bed  # noqa: F401
