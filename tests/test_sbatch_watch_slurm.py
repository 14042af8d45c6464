"""`clusterkit sbatch --submit --watch` folds rank lines, on the real Slurm test bed."""

from __future__ import annotations

import re

import pytest

from tests.slurmbed import SlurmBed
from tests.test_sbatch_slurm import WORKLOAD, _cli, _inventory

pytestmark = [pytest.mark.slurm, pytest.mark.testbed]
LR = "[WARNING] [lr_schedules.py:894:__init__] total_num_steps 3 is less than warmup_num_steps 10"


def test_watch_shows_folded_lines(slurm: SlurmBed) -> None:
    inv = _inventory(slurm, 2)
    r = _cli(slurm, ["-i", str(inv), "--nodes", "2", "--gpus-per-node", "2", "--steps", "3",
                     "--job-id", "watch-fold", *WORKLOAD, "--submit", "--watch", "--poll", "0.5"],
             timeout=600)  # a loaded shared machine: measured 142 s idle
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    lines = r.stdout.splitlines()
    # all four ranks warn alike: printed with their range, not once per rank (how many
    # join one group depends on their skew, here up to a few seconds); noise once per job
    lr = [ln for ln in lines if ln.endswith(LR)]
    assert 1 <= len(lr) < 4 and re.match(r"\[(node\d )?r\d+[-,]", lr[0]), r.stdout[-3000:]
    assert sum("Setting accelerator to CPU" in ln for ln in lines) == 1
    assert any(ln.startswith("[node1 r0] [clusterkit] step 3/3") for ln in lines)
    assert sum("CLUSTERKIT_SUMMARY " in ln for ln in lines) == 1
    # --ranks: the same finished job again, rank 0 only
    m = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert m, r.stdout
    r = _cli(slurm, ["status", m.group(1), "--watch", "--ranks", "0"])
    assert r.returncode == 0, r.stderr[-2000:]
    rank_lines = [ln for ln in r.stdout.splitlines() if re.match(r"\[(node\d+ )?r\d", ln)]
    assert rank_lines and all(ln.startswith("[node1 r0] ") for ln in rank_lines), rank_lines
