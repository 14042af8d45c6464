"""Issue 25: what the orchestrator tells the console (phases, the first failure) on a
real run of node agents over LocalTransport, with fake ranks (no torch)."""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

from clusterkit.fold import LineFolder
from clusterkit.launch.console import PHASES, FoldingSink, PlainSink
from clusterkit.launch.jobspec import JobSpec, NodeTask
from clusterkit.launch.orchestrator import Orchestrator
from clusterkit.remote.base import SSHTarget
from clusterkit.remote.local import LocalTransport

RANK = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
def torn_down(*_):  # the others' collateral: a traceback when the teardown reaches them
    print("Traceback (most recent call last):", flush=True)
    for i in range(30):
        print(f"rank {rank} collateral frame {i}", flush=True)
    sys.exit(1)
signal.signal(signal.SIGTERM, torn_down)
print(f"rank {rank} loading", flush=True)
time.sleep(0.3)
for step in range(1, 4):
    print(f"step {step}/3 | loss 0.5", flush=True)
    time.sleep(0.2)
    if rank == 0 and step == 2 and os.environ.get("DIE"):
        os.kill(os.getpid(), signal.SIGKILL)
if os.environ.get("DIE"):
    time.sleep(30)
"""


class Recorder(PlainSink):
    def __init__(self) -> None:
        super().__init__(io.StringIO())
        self.phases: list[str] = []
        self.failures: list[tuple[int, str, str]] = []

    def phase(self, name: str, detail: str = "") -> None:
        self.phases.append(name)

    def failed_first(self, rank: int, where: str, logs: str) -> None:
        self.failures.append((rank, where, logs))


def _rank_script_job(tmp_path: Path, n: int, **env: str) -> JobSpec:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    tasks = tuple(
        NodeTask(node=f"v{i}", target=SSHTarget(name=f"v{i}", address="127.0.0.1", local=True),
                 python=sys.executable, argv=(sys.executable, str(script)), rank_offset=i,
                 nprocs=1, env={"RANK": str(i), "LOCAL_RANK": "0", "WORLD_SIZE": str(n), **env},
                 prefix="single", job_dir=str(tmp_path / "jobs" / "@JOB@"))
        for i in range(n))
    return JobSpec(job_id="ph", tasks=tasks, grace_s=1.0)


def test_phases_move_forward_through_a_gated_run(tmp_path: Path) -> None:
    sink = Recorder()
    job = dataclasses.replace(_rank_script_job(tmp_path, 2), gate_need=(), hang_timeout_s=60.0)
    out = Orchestrator(job, LocalTransport(), sink).run(install_signals=False)
    assert out.exit_code == 0
    assert sink.phases[0] == "connecting" and "gate" in sink.phases
    order = [PHASES.index(p) for p in sink.phases]
    assert order == sorted(order), sink.phases  # forward only
    assert {"starting ranks", "initialising", "training"} <= set(sink.phases), sink.phases
    assert sink.failures == []


def test_a_killed_rank_folds_the_others_output(tmp_path: Path) -> None:
    buf = io.StringIO()
    sink = FoldingSink(PlainSink(buf), LineFolder(window_s=0.3, world_size=3), tick_s=0.05)
    job = _rank_script_job(tmp_path, 3, DIE="1")
    out = Orchestrator(job, LocalTransport(), sink).run(install_signals=False)
    sink.close()
    lines = buf.getvalue().splitlines()
    assert out.exit_code == 137, lines
    assert not any("collateral frame" in ln for ln in lines), lines
    folded = [ln for ln in lines if "collateral:" in ln]
    assert len(folded) == 1 and "after v0 rank 0 failed" in folded[0], lines
    assert f"{tmp_path}/jobs/ph/nodes/<node>/rank<N>.log" in folded[0]
    # their logs keep everything
    assert "collateral frame 29" in (tmp_path / "jobs" / "ph" / "nodes" / "v1" /
                                     "rank1.log").read_text()
