"""``clusterkit launch`` on real namespace nodes with sshd (tests/testbed).

The failure cases use a tiny sleeping "rank" script under torchrun (no DeepSpeed
start-up cost); the training cases run the bundled ZeRO-2 workload once per
backend at 7 nodes x 2 ranks (CPU/gloo, tiny model, few steps).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import SLEEPER, gone_everywhere, job_pids, kill9_then_wait, read_until, start_launch
from tests.testbed.core import Testbed

pytestmark = pytest.mark.testbed

@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")


@pytest.fixture()
def node_bystanders(testbed: Testbed) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """On node5 and node1: another job's process and a DeepSpeed-pkill-pattern look-alike."""
    testbed.ensure(7)
    procs = []
    for node in ("node5", "node1"):
        procs.append((node, testbed.spawn(node, ["env", "CLUSTERKIT_JOB_ID=unrelated-job",
                                                 "sleep", "300"])))
        procs.append((node, testbed.spawn(node, [sys.executable, "-c", "import time; time.sleep(300)",
                                                 "deepspeed.launcher.launch", "--world_info=e30="])))
    yield procs
    for _, p in procs:
        p.kill()
        p.wait()


def test_kill9_of_one_rank_on_node5_stops_every_rank_and_spares_other_jobs(
        testbed: Testbed, tmp_path: Path, env: dict[str, str],
        node_bystanders: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    nodes = [n.name for n in testbed.ensure(7)]
    work = tmp_path / "work"
    work.mkdir()
    (work / "sleeper.py").write_text(SLEEPER)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes=nodes, slots=2)
    job = "kill9-test"
    proc = start_launch(inv, job, ["--skip-checks", "--nodes", "7", "--gpus-per-node", "2",
                              str(work / "sleeper.py")], env, tmp_path)
    seen: list[str] = []
    try:
        read_until(proc, 14, "ready rank", 120, seen)
        victim = job_pids(testbed, "node5", job, rank=9)
        assert len(victim) == 1
    except BaseException:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
        raise
    # Every rank on every node gone within 10 s of the kill.
    kill9_then_wait(testbed, proc, "node5", victim[0], nodes, job, 10, seen)
    text = "".join(seen)
    assert proc.returncode == 137, text[-3000:]
    assert "node5 rank 9 failed first (killed by SIGKILL)" in text, text[-3000:]
    assert all(p.poll() is None for _, p in node_bystanders), "another job's process was killed"


def test_ctrl_c_on_the_launcher_leaves_no_process_on_any_node(
        testbed: Testbed, tmp_path: Path, env: dict[str, str]) -> None:
    nodes = [n.name for n in testbed.ensure(3)]
    work = tmp_path / "work"
    work.mkdir()
    (work / "sleeper.py").write_text(SLEEPER)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes=nodes, slots=2)
    job = "ctrlc-test"
    proc = start_launch(inv, job, [str(work / "sleeper.py")], env, tmp_path)
    seen: list[str] = []
    read_until(proc, 6, "ready rank", 120, seen)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, "".join(seen) + out
    assert "interrupted: stopped on every node" in out
    assert gone_everywhere(testbed, nodes, job)


def test_status_and_stop_reach_every_node(testbed: Testbed, tmp_path: Path,
                                          env: dict[str, str]) -> None:
    nodes = [n.name for n in testbed.ensure(2)]
    work = tmp_path / "work"
    work.mkdir()
    (work / "sleeper.py").write_text(SLEEPER)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes=nodes, slots=1)
    job = "stop-test"
    proc = start_launch(inv, job, ["--skip-checks", str(work / "sleeper.py")], env, tmp_path)
    seen: list[str] = []
    try:
        read_until(proc, 2, "ready rank", 120, seen)
        ck = [sys.executable, "-m", "clusterkit"]
        status = subprocess.run([*ck, "status", job], capture_output=True, text=True, env=env,
                                timeout=60)
        assert status.returncode == 0, status.stderr
        assert "node1" in status.stdout and "agent up" in status.stdout and "ranks 0" in status.stdout
        stop = subprocess.run([*ck, "stop", job], capture_output=True, text=True, env=env, timeout=60)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "no process left on 2 node(s)" in stop.stdout
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert gone_everywhere(testbed, nodes, job)
    listing = subprocess.run([sys.executable, "-m", "clusterkit", "status"], capture_output=True,
                             text=True, env=env, timeout=30)
    assert job in listing.stdout
