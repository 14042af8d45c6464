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
    assert lines[0] == "  ranks 0-2 (node1 0-1, node2 2): in all_reduce \u2190 main"
    assert lines[1].startswith("  rank 3 (node2, stopped): in wait") and "odd one out" in lines[1]
    assert culprit == "rank 3 on node2 is stopped (SIGSTOP?)"


def test_watch_ends_a_step_without_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """No write under the job's logs for the start-up allowance (2 x HANG_S): the hang
    file with the reason, SIGTERM to the step (here a sleep), the lines on both streams.
    (srun fails here: no Slurm.)"""
    (tmp_path / "logs").mkdir()
    monkeypatch.setattr(slurmwatch, "POLL_S", 0.2)
    monkeypatch.delenv("CLUSTERKIT_HEARTBEAT_DIR", raising=False)
    step = subprocess.Popen(["sleep", "60"])
    try:
        t0 = time.monotonic()
        assert slurmwatch.watch("nojob", str(tmp_path), str(tmp_path / "hangs"), 1.0, step.pid,
                                1) == 0
        assert step.wait(timeout=10) == -signal.SIGTERM
        assert time.monotonic() - t0 < 30
    finally:
        step.kill()
    # silent from the start: the start-up allowance (2 x 1 s) is the limit that applied
    reason = (tmp_path / "hang").read_text()
    assert reason.startswith("no sign of training within the start-up allowance of 2 s "
                             "(2 \u00d7 --hang-timeout 1)"), reason
    out, err = capsys.readouterr()
    for text in (out, err):
        assert "clusterkit: no sign of training within the start-up allowance" in text
        assert "collecting every rank's stack into" in text
        assert "clusterkit: ending the step: no sign of training" in text


def test_watch_leaves_a_step_that_progresses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setattr(slurmwatch, "POLL_S", 0.2)
    step = subprocess.Popen(["sh", "-c", f"for i in 1 2 3 4 5 6 7 8; do echo $i >> {logs}/x; "
                                         "sleep 0.4; done"])
    assert slurmwatch.watch("nojob", str(tmp_path), str(tmp_path / "hangs"), 1.5, step.pid,
                            1) == 0
    assert step.wait(timeout=10) == 0 and not (tmp_path / "hang").exists()
