"""The rendezvous port, derived from the job id (no probing, no collisions between jobs).

A numeric id (a Slurm job id) uses plain arithmetic so the batch script computes the
same port in bash: ``$(( 20000 + SLURM_JOB_ID % 40001 ))``; consecutive jobs get
consecutive ports. Any other id uses submitit's ``Random(job_id).randint(20000, 60000)``.
"""

from __future__ import annotations

import random
import re

PORT_BASE = 20000
PORT_SPAN = 40001  # ports 20000..60000 inclusive
_NUMERIC = re.compile(r"[0-9]+")


def master_port(job_id: str) -> int:
    if _NUMERIC.fullmatch(job_id):
        return PORT_BASE + int(job_id) % PORT_SPAN
    return random.Random(job_id).randint(PORT_BASE, PORT_BASE + PORT_SPAN - 1)
