"""Slurm: submit a rendered batch script, ask for its state, cancel it, follow it.

Every Slurm call is an argv list with a timeout (:mod:`clusterkit.slurm.client`);
parsing ``sbatch --parsable`` and ``scontrol show job -o`` output is pure
(:mod:`clusterkit.slurm.jobinfo`); :mod:`clusterkit.slurm.watch` follows a job's
output file until the job ends. No sacct: it needs slurmdbd, which many clusters
(and our test bed) do not run.
"""
