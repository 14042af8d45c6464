"""A real Slurm cluster (slurmctld + one slurmd per node + munge) on the namespace test bed.

See tests/slurmbed/cluster.py and docs/sbatch.md ("Testing on a real Slurm").
"""

from tests.slurmbed.cluster import SlurmBed, SlurmBedError, slurm_unavailable_reason

__all__ = ["SlurmBed", "SlurmBedError", "slurm_unavailable_reason"]
