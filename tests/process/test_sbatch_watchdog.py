"""sbatch.sh's progress watchdog, node side (clusterkit/node/watch.py), without Slurm:
finding a job's ranks on a node, their stacks (py-spy or faulthandler), the folded summary.
The whole path (srun --overlap, SIGSTOPped rank, step ended) runs on the Slurm test bed:
tests/bed/slurm/test_sbatch_user_slurm.py::test_a_stopped_rank_is_named_and_ends_the_step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterkit import ship
from clusterkit.node.slurm import watch

CHILD = ("import time\n"
         "def train_step():\n"
         "    time.sleep(600)\n"
         "train_step()\n")


@pytest.fixture(autouse=True)
def _usr1_restored():  # type: ignore[no-untyped-def]
    """watch.watch ignores SIGUSR1 (scancel --signal=USR1 reaches it too): in this
    process that is inherited by every later child, and a batch script run by a later
    test (tests/process/test_sbatch_units.py) could then not trap it and hung."""
    before = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, before)


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
    assert watch.ranks_of(job) == {0: ranks[0].pid, 1: ranks[1].pid}
    os.kill(ranks[1].pid, signal.SIGSTOP)
    time.sleep(0.3)
    dump = tmp_path / "dump"
    assert watch.stacks(job, str(dump)) == 0
    head = (dump / "rank1.txt").read_text().splitlines()[0]
    assert head.startswith("# rank 1 node ") and " state T " in head
    lines, culprit = watch.summary(str(dump))
    assert any(ln.startswith("  rank 1 (") and "stopped" in ln and "odd one out" in ln
               for ln in lines), lines
    assert culprit.startswith("rank 1 on ") and "stopped" in culprit
    if "py-spy" in head:  # py-spy beside this python: the frame of the script is named
        assert "train_step" in (dump / "rank0.txt").read_text()


def test_the_batch_script_starts_it_the_one_way_node_code_runs() -> None:
    """The shipped bundle (bootstrap + sources on stdin) runs stand-alone (python -S)."""
    cmd = ship.node_command(sys.executable, "slurm.watch", [])
    proc = subprocess.run(cmd.argv, input=cmd.stdin, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 2 and b"usage: slurm.watch" in proc.stderr


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
    lines, culprit = watch.summary(str(tmp_path))
    assert lines[0] == "  ranks 0-2 (node1 0-1, node2 2): in all_reduce \u2190 main"
    assert lines[1].startswith("  rank 3 (node2, stopped): in wait") and "odd one out" in lines[1]
    assert culprit == "rank 3 on node2 is stopped (SIGSTOP?)"


def test_watch_ends_a_step_without_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """No write under the job's logs for the start-up allowance (2 x HANG_S): the hang
    file with the reason, SIGTERM to the step (here a sleep), the lines on both streams.
    (srun fails here: no Slurm.)"""
    (tmp_path / "logs").mkdir()
    monkeypatch.setattr(watch, "POLL_S", 0.2)
    monkeypatch.delenv("CLUSTERKIT_HEARTBEAT_DIR", raising=False)
    step = subprocess.Popen(["sleep", "60"])
    try:
        t0 = time.monotonic()
        assert watch.watch("nojob", str(tmp_path), str(tmp_path / "hangs"), 1.0, step.pid,
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
    monkeypatch.setattr(watch, "POLL_S", 0.2)
    step = subprocess.Popen(["sh", "-c", f"for i in 1 2 3 4 5 6 7 8; do echo $i >> {logs}/x; "
                                         "sleep 0.4; done"])
    assert watch.watch("nojob", str(tmp_path), str(tmp_path / "hangs"), 1.5, step.pid,
                            1) == 0
    assert step.wait(timeout=10) == 0 and not (tmp_path / "hang").exists()


# --- issue 37: a build in progress holds the start-up allowance; each rank on its node ---

class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_a_build_in_progress_is_never_ended_by_the_start_up_allowance(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Silent ranks, hang 10 s (allowance 20 s): while a node reports a build the verdict
    waits (said once per build); once the build is over and nothing moves, it fires."""
    clock = _Clock()
    state = watch.Watch(clock.t, 10.0, 20.0)
    asked: list[float] = []

    def building() -> list[str]:
        asked.append(clock.t)
        return (["DeepSpeed/torch op fused_adam is being built by rank 3 on node2 (...)"]
                if clock.t < 1100 else [])

    verdict = watch.run_watch(state, lambda seen: (0.0, False), lambda: True,
                                   clock=clock, sleep=clock.sleep, building=building)
    assert verdict is not None and verdict.hung and clock.t > 1100
    assert asked[0] >= 1020  # asked only when the rule would fire: not every poll
    assert len(asked) < 15
    out = capsys.readouterr().out
    assert out.count("op fused_adam is being built by rank 3 on node2") == 1
    assert "the watchdog waits for the build" in out
    # After training was seen a verdict is a hang, build or not.
    state = watch.Watch(clock.t, 10.0, 20.0)
    verdict = watch.run_watch(state, lambda seen: (clock.t if clock.t < 1200 else 0.0,
                                                        True), lambda: True, clock=clock,
                                   sleep=clock.sleep, building=lambda: ["x"])
    assert verdict is not None and verdict.hung


RANK = ("import os, sys, time\n"
        "lock = os.environ.get('HOLD')\n"
        "fd = os.open(lock, os.O_CREAT | os.O_WRONLY) if lock else None\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n")


def _rank(job: str, rank: int, node: str, **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "CLUSTERKIT_JOB_ID": job, "RANK": str(rank),
                                 "SLURMD_NODENAME": node, **env})
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    return proc


def test_each_rank_is_dumped_by_its_own_node_under_its_node_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two 'nodes' whose /proc both show every rank (one PID namespace): each stacks run
    dumps only the ranks Slurm started on its node, named as Slurm names it."""
    job = f"nodes-{os.getpid()}"
    procs = [_rank(job, r, f"node{1 + r // 2}") for r in range(4)]
    try:
        dump = tmp_path / "dump"
        for node in ("node1", "node2"):
            monkeypatch.setenv("SLURMD_NODENAME", node)
            assert set(watch.ranks_of(job)) == ({0, 1} if node == "node1" else {2, 3})
            assert watch.stacks(job, str(dump)) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    heads = {int(f.stem[4:]): f.read_text().split("\n", 1)[0] for f in dump.glob("rank*.txt")}
    assert {r: h.split()[4] for r, h in heads.items()} == {0: "node1", 1: "node1", 2: "node2",
                                                            3: "node2"}
    lines, _ = watch.summary(str(dump))
    assert lines[0].startswith("  ranks 0-3 (node1 0-1, node2 2-3): "), lines


def test_the_summary_maps_eight_ranks_to_their_four_nodes(tmp_path: Path) -> None:
    """The dump files as four nodes write them (two ranks each; rank 6 elsewhere in its
    stack): every node named with its own ranks, not one node for seven ranks."""
    for rank in range(8):
        frame = "wait" if rank != 6 else "communicate"
        (tmp_path / f"rank{rank}.txt").write_text(
            f"# rank {rank} node node{1 + rank // 2} state S tool py-spy pid {100 + rank}\n"
            f"Thread 1 (idle): \"MainThread\"\n    {frame} (torch/utils/file_baton.py:42)\n"
            "    load (deepspeed/ops/op_builder/builder.py:1)\n    main (train.py:9)\n")
    lines, culprit = watch.summary(str(tmp_path))
    assert lines[0] == ("  ranks 0-5,7 (node1 0-1, node2 2-3, node3 4-5, node4 7): "
                        "in wait \u2190 load")
    assert lines[1].startswith("  rank 6 (node4): in communicate") and "odd one out" in lines[1]
    assert culprit == "rank 6 on node4 differs"


def test_builds_names_the_rank_that_holds_a_build_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    job = f"builds-{os.getpid()}"
    ext = tmp_path / "ext"
    (ext / "fused_adam").mkdir(parents=True)
    lock = ext / "fused_adam" / "lock"
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    elsewhere = ext / "cpu_adam" / "lock"  # a build on node3, sharing the directory
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"")
    (ext / "cpu_adam" / "lock.owner").write_text("node3 77 12345 boot3 pid:[3]\n")
    idle = _rank(job, 2, "node2", TORCH_EXTENSIONS_DIR=str(ext))
    builder = _rank(job, 3, "node2", TORCH_EXTENSIONS_DIR=str(ext), HOLD=str(lock))
    try:
        assert watch.builds(job) == 0
    finally:
        for p in (idle, builder):
            p.kill()
            p.wait()
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{watch.BUILD_TAG}DeepSpeed/torch op cpu_adam is being built on node3 "
                   f"(its owner record, seen from node2; {elsewhere})",
                   f"{watch.BUILD_TAG}DeepSpeed/torch op fused_adam is being built by "
                   f"rank 3 on node2 (pid {builder.pid}; {lock})"], out
    assert watch.builds(job) == 0 and capsys.readouterr().out == ""  # no rank: no dirs


def test_a_nodes_answer_is_read_through_sruns_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch script exports SLURM_LABELIO=1: the builds step's lines come back as
    '0: clusterkit-build ...' (the first Slurm bed run missed every one of them)."""
    seen: list[list[str]] = []

    def fake_run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[bytes]:
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, b"0: clusterkit-build op a on node1\n"
                                                    b"1: something else\n"
                                                    b" 10: clusterkit-build op b on node11\n",
                                           b"")

    monkeypatch.setattr(watch.subprocess, "run", fake_run)
    got = watch._on_every_node(["builds", "j"], 11, watch.BUILD_TAG)
    assert got == ["op a on node1", "op b on node11"]
    assert seen[0][:6] == ["srun", "--overlap", "--nodes=11", "--ntasks=11",
                           "--ntasks-per-node=1", "--input=all"]
    assert seen[0][-2:] == ["builds", "j"]
