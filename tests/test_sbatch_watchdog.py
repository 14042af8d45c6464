"""sbatch.sh's progress watchdog, node side (clusterkit/node/slurmwatch.py), without Slurm:
finding a job's ranks on a node, their stacks (py-spy or faulthandler), the folded summary.
The whole path (srun --overlap, SIGSTOPped rank, step ended) runs on the Slurm test bed:
tests/test_sbatch_user_slurm.py::test_a_stopped_rank_is_named_and_ends_the_step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterkit.node import ship, slurmwatch

CHILD = ("import time\n"
         "def train_step():\n"
         "    time.sleep(600)\n"
         "train_step()\n")


@pytest.fixture
def ranks(tmp_path: Path):  # type: ignore[no-untyped-def]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "CLUSTERKIT_JOB_ID": f"wd-{os.getpid()}", "RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD], env=env))
    time.sleep(1.0)
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_stacks_of_every_rank_and_the_stopped_one_named(ranks: list[subprocess.Popen[bytes]],
                                                        tmp_path: Path) -> None:
    job = f"wd-{os.getpid()}"
    assert slurmwatch.ranks_of(job) == {0: ranks[0].pid, 1: ranks[1].pid}
    os.kill(ranks[1].pid, signal.SIGSTOP)
    time.sleep(0.3)
    dump = tmp_path / "dump"
    assert slurmwatch.stacks(job, str(dump)) == 0
    head = (dump / "rank1.txt").read_text().splitlines()[0]
    assert head.startswith("# rank 1 node ") and " state T " in head
    lines, culprit = slurmwatch.summary(str(dump))
    assert any(ln.startswith("  rank 1 (") and "stopped" in ln and "odd one out" in ln
               for ln in lines), lines
    assert culprit.startswith("rank 1 on ") and "stopped" in culprit
    if "py-spy" in head:  # py-spy beside this python: the frame of the script is named
        assert "train_step" in (dump / "rank0.txt").read_text()


def test_the_batch_script_starts_it_the_one_way_node_code_runs() -> None:
    """The shipped bundle (bootstrap + sources on stdin) runs stand-alone (python -S)."""
    cmd = ship.node_command(sys.executable, "slurmwatch", [])
    proc = subprocess.run(cmd.argv, input=cmd.stdin, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 2 and b"usage: slurmwatch" in proc.stderr


def test_summary_folds_alike_ranks(tmp_path: Path) -> None:
    for rank in range(4):
        stopped = rank == 3
        body = ("Thread 0x1 (most recent call first):\n"
                + ('  File "/x/t.py", line 9 in wait\n' if stopped else
                   '  File "/t/dist.py", line 5 in all_reduce\n')
                + '  File "/x/t.py", line 20 in main\n  File "/x/t.py", line 30 in <module>\n')
        (tmp_path / f"rank{rank}.txt").write_text(
            f"# rank {rank} node node{1 + rank // 2} state {'T' if stopped else 'S'} "
            f"tool faulthandler pid 1\n{body}")
    lines, culprit = slurmwatch.summary(str(tmp_path))
    assert lines[0] == "  ranks 0-2 (node1,node2): in all_reduce \u2190 main"
    assert lines[1].startswith("  rank 3 (node2, stopped): in wait") and "odd one out" in lines[1]
    assert culprit == "rank 3 on node2 is stopped (SIGSTOP?)"
