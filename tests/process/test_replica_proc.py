"""The agent's checkpoint copies in a child process of their own (node/replicas/proc.py):
a session of its own at autogroup nice 19, the service's events and log lines forwarded,
finish and abort, and a child that outlives its agent ends by itself."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from clusterkit.node import contract, protocol
from clusterkit.node.replicas import priority
from clusterkit.node.replicas.area import read_manifest
from clusterkit.node.replicas.proc import ReplicaProcess, child_bundle
from tests.replicahelpers import fresh_job_id, ring_pair, zero2_tag

SECRET = "p" * 64
_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")
AUTOGROUP = _ENABLED.exists() and _ENABLED.read_text().strip() == "1"


def _pair(tmp_path: Path, events: list[Any], logs: list[str]) -> tuple[str, list[ReplicaProcess]]:
    job = fresh_job_id("job-replica-proc")
    return job, [ReplicaProcess(cfg, job, f"n{i}", str(tmp_path / f"n{i}.json"), events.append,
                                logs.append)
                 for i, cfg in enumerate(ring_pair(tmp_path, SECRET))]


def _wait(cond: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_two_child_processes_replicate_each_other_and_finish(tmp_path: Path) -> None:
    events: list[Any] = []
    logs: list[str] = []
    _, procs = _pair(tmp_path, events, logs)
    for p in procs:
        p.start()
    try:
        for p in procs:
            assert p.proc is not None
            pid = p.proc.pid
            assert os.getsid(pid) == pid  # a session, hence an autogroup, of its own
            if AUTOGROUP:
                _wait(lambda pid=pid: Path(f"/proc/{pid}/autogroup").read_text().endswith(
                    "nice 19\n"))
        for i in (0, 1):
            ckpt = tmp_path / f"n{i}" / "ckpt"
            zero2_tag(ckpt, "global_step5", [i], size=1000)
            (ckpt / "global_step5" / contract.marker_name(i)).write_text("{}")
        ends = [threading.Thread(target=p.end, args=(True,)) for p in procs]
        for t in ends:
            t.start()
        for t in ends:
            t.join(60)
    finally:
        for p in procs:
            p.abort()
    copies = sorted((e.source, e.target, e.state) for e in events
                    if isinstance(e, protocol.Replica))
    assert copies == [(0, "n1", "complete"), (1, "n0", "complete")], (events, logs)
    assert not [e for e in events if isinstance(e, protocol.Error)], events
    for i in (0, 1):
        held = contract.replica_dir(str(tmp_path / f"n{1 - i}" / "ckpt"), i, "global_step5")
        assert read_manifest(held) is not None
        assert json.loads((tmp_path / f"n{i}.json").read_text()) == \
            {"global_step5": {f"n{1 - i}": "complete"}}
    assert any("session of its own: CPU: autogroup nice 19" in m for m in logs) or not AUTOGROUP, logs
    assert any(m.startswith("replica: finished in") for m in logs), logs
    assert all(p.proc is not None and p.proc.returncode == 0 for p in procs)


def test_abort_returns_at_once_and_the_child_ends(tmp_path: Path) -> None:
    events: list[Any] = []
    logs: list[str] = []
    _, procs = _pair(tmp_path, events, logs)
    p = procs[0]
    p.start()
    assert p.proc is not None
    _wait(lambda: any("serving on port" in m for m in logs))
    t0 = time.monotonic()
    p.abort()
    assert time.monotonic() - t0 < 0.5
    p.end(True)  # after an abort: only the (short) wait
    assert p.proc.returncode is not None
    assert not [e for e in events if isinstance(e, protocol.Error)], events


def test_an_abort_during_the_finish_ends_the_wait_for_a_failed_source(tmp_path: Path) -> None:
    """This node's ranks ended well (finish), its source's node failed (no BYE ever):
    the launcher's stop (abort) ends the finish at once, not after FINISH_SOURCES_S."""
    logs: list[str] = []
    _, procs = _pair(tmp_path, [], logs)
    p = procs[0]  # its source, procs[1], never runs
    p.start()
    assert p.proc is not None
    _wait(lambda: any("serving on port" in m for m in logs))
    ending = threading.Thread(target=p.end, args=(True,), daemon=True)
    ending.start()
    _wait(lambda: any("BYE to" in m for m in logs))  # finishing: waiting for its source
    time.sleep(0.5)
    assert ending.is_alive() and p.proc.poll() is None
    t0 = time.monotonic()
    p.abort()
    ending.join(15)
    assert not ending.is_alive() and p.proc.returncode is not None, logs
    assert time.monotonic() - t0 < 10


def test_a_child_whose_agent_died_ends_by_itself(tmp_path: Path) -> None:
    """The agent killed: the child's stdin ends, which is an abort."""
    logs: list[str] = []
    _, procs = _pair(tmp_path, [], logs)
    p = procs[0]
    p.start()
    assert p.proc is not None and p.proc.stdin is not None
    _wait(lambda: any("serving on port" in m for m in logs))
    p.proc.stdin.close()
    assert p.proc.wait(15) == 0


def test_the_child_gets_the_sources_this_process_runs(tmp_path: Path) -> None:
    head = child_bundle().split(b"\n", 1)[0].decode().split()
    assert head[:2] == [contract.BUNDLE_MAGIC, str(contract.BUNDLE_VERSION)]
    assert [e.split(":")[0] for e in head[2:]][-1] == "replicas.proc"


@pytest.mark.skipif(not AUTOGROUP or os.getsid(0) == os.getpid(),
                    reason="no autogroup, or this process leads its session")
def test_a_process_that_shares_its_session_leaves_the_autogroup_alone() -> None:
    before = Path("/proc/self/autogroup").read_text()
    assert priority.lower_this_session() == ""
    assert Path("/proc/self/autogroup").read_text() == before
