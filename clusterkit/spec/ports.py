"""The rendezvous port, derived from the job id (no probing, no collisions between jobs).

One rule for every verb and the batch script: ports 20000-32767, below Linux's
ephemeral range (32768-60999), where any outgoing connection could already hold the
port. A numeric id (a Slurm job id) uses plain arithmetic so the batch script computes
the same port in bash: ``$(( 20000 + SLURM_JOB_ID % 12768 ))``; consecutive jobs get
consecutive ports. Any other id uses submitit's ``Random(job_id).randint`` in that range.
"""

from __future__ import annotations

import random
import re

PORT_BASE = 20000
PORT_SPAN = 12768  # ports 20000..32767 inclusive
_NUMERIC = re.compile(r"[0-9]+")


def master_port(job_id: str) -> int:
    if _NUMERIC.fullmatch(job_id):
        return PORT_BASE + int(job_id) % PORT_SPAN
    return random.Random(job_id).randint(PORT_BASE, PORT_BASE + PORT_SPAN - 1)
