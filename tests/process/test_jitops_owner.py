"""Issue 37 items 3-4: who holds a JIT build lock, judged from our build step's owner
record (node/provision/buildowner.py), and what each start does with it (node/provision/jitops.py): a lock a
record proves dead is removed by itself, a live one (here or on a node sharing the
directory) is never removed and is waited for, one nothing proves either way is refused
with the fix. Pure decisions first, then the files as the build step leaves them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Status
from clusterkit.checks.rules_base import DoctorContext
from clusterkit.checks.rules_env import check_jit_locks
from clusterkit.node.provision import buildowner, jitbatch, jitops

ME = {"host": "node1", "boot": "b1", "pidns": "pid:[1]"}


def _owner(host: str = "node1", pid: int = 42, start: str = "1000", boot: str = "b1",
           pidns: str = "pid:[1]") -> dict[str, Any]:
    return {"host": host, "pid": pid, "start": start, "boot": boot, "pidns": pidns}


@pytest.mark.parametrize(("holders", "owner", "age", "alive", "state", "why"), [
    ([7], None, 0.0, "", "held", "held by pid 7"),
    ([], None, 0.0, "", "unknown", "no builder recorded it"),
    # the builder's own host, boot and PID namespace: the pid and its start decide
    ([], _owner(), 500.0, "1000", "building", "building on node1 (pid 42)"),
    ([], _owner(), 1.0, "", "dead", "its builder, pid 42 on node1, is gone"),
    ([], _owner(), 1.0, "2000", "dead", "is gone"),  # pid reused by another process
    # another node (or another PID namespace, or a reboot since): the record's age decides
    ([], _owner(host="node3"), 3.0, "", "building", "building on node3 (pid 42; record 3 s old)"),
    ([], _owner(pidns="pid:[9]"), 3.0, "", "building", "building on node1"),
    ([], _owner(boot="b0"), buildowner.OWNER_TTL_S + 1, "1000", "dead",
     "stopped refreshing its record"),
    ([], _owner(host="node3"), buildowner.OWNER_TTL_S + 30, "", "dead",
     "its builder on node3 (pid 42) stopped refreshing its record 90 s ago"),
])
def test_judge(holders: list[int], owner: dict[str, Any] | None, age: float, alive: str,
               state: str, why: str) -> None:
    got = buildowner.judge(holders, owner, age, ME, start_of=lambda pid: alive)
    assert got["state"] == state and why in got["why"], got


def test_owner_line_round_trips_and_a_torn_one_is_no_record() -> None:
    line = buildowner.owner_line(os.getpid())
    rec = buildowner.parse_owner(line)
    assert rec is not None and rec["pid"] == os.getpid()
    assert rec["start"] == buildowner.start_time(os.getpid()) != ""
    assert buildowner.judge([], rec, 0.0, buildowner.here())["state"] == "building"
    assert buildowner.parse_owner("node1 12") is None


HOLDER = ("import os, sys, time\n"
          "from clusterkit.node.provision.buildowner import Owner\n"
          "lock = sys.argv[1]\n"
          "with Owner(lock, poll_s=0.05):\n"
          "    fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # as FileBaton does\n"
          "    print('holding', flush=True)\n"
          "    time.sleep(float(sys.argv[2]))\n"
          "    os.close(fd); os.remove(lock)  # FileBaton.release\n")


def _holder(lock: Path, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    deadline = time.monotonic() + 10
    while not Path(f"{lock}.owner").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_a_build_records_itself_while_it_holds_the_lock_and_a_killed_one_is_proven_dead(
        tmp_path: Path) -> None:
    lock = tmp_path / "ext" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    done = _holder(lock, 0.5)
    assert buildowner.parse_owner(Path(f"{lock}.owner").read_text())["pid"] == done.pid
    assert done.wait(timeout=10) == 0
    assert not lock.exists() and not Path(f"{lock}.owner").exists()  # released, record gone

    killed = _holder(lock, 60)
    (found,) = jitops.locks([str(tmp_path / "ext")])
    assert found["state"] == "held" and found["holders"] == [killed.pid]
    killed.send_signal(signal.SIGKILL)  # a build killed mid-way: lock and record stay
    killed.wait()
    (found,) = jitops.locks([str(tmp_path / "ext")])
    assert found["state"] == "dead" and f"pid {killed.pid}" in found["why"], found
    assert jitops.stale([found]) == jitops.dead([found]) == [found]
    assert jitops.remove(found) and not lock.exists() and not Path(f"{lock}.owner").exists()


def _record_elsewhere(lock: Path, age_s: float, host: str = "node3") -> None:
    """A lock and the record a build on another node wrote ``age_s`` ago."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_bytes(b"")
    rec = Path(f"{lock}.owner")
    rec.write_text(f"{host} 4242 777 otherboot pid:[4026531836]\n")
    then = time.time() - age_s
    os.utime(rec, (then, then))
    old = time.time() - 600
    os.utime(lock, (old, old))


def _fake_build(calls: list[list[str]]) -> Any:
    def build(ops: list[str], cfg: dict[str, Any] | None) -> dict[str, Any]:
        calls.append(ops)
        return {"v": 1, "accelerator": "cpu", "ops": {op: {"state": "built", "seconds": 1.0}
                                                      for op in ops}}
    return build


def test_a_start_removes_a_dead_lock_by_itself_never_a_live_one_and_refuses_an_unknown_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ext = tmp_path / "ext"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    calls: list[list[str]] = []
    monkeypatch.setattr(jitops, "build", _fake_build(calls))
    live, gone = ext / "fused_adam" / "lock", ext / "cpu_adam" / "lock"
    _record_elsewhere(live, 2.0)
    _record_elsewhere(gone, buildowner.OWNER_TTL_S + 60)
    out = jitops.build_request({"ops": ["FusedAdamBuilder"], "remove_stale": True})
    assert calls == [["FusedAdamBuilder"]]
    assert live.exists(), "a live build's lock is never removed, not even with remove_stale"
    assert not gone.exists() and len(out["removed"]) == 1
    assert "stopped refreshing its record" in out["removed"][0]
    # Without remove_stale, a dead one still goes; one nobody recorded is refused.
    _record_elsewhere(gone, buildowner.OWNER_TTL_S + 60)
    unknown = ext / "cpu_lion" / "lock"
    unknown.parent.mkdir()
    unknown.write_bytes(b"")
    os.utime(unknown, (time.time() - 3600, time.time() - 3600))
    out = jitops.build_request({"ops": []})
    assert [lk["path"] for lk in out["stale"]] == [str(unknown)] and len(calls) == 1
    assert gone.exists()  # a refusal changes nothing


def test_the_gate_sees_a_build_on_another_node_as_live_and_a_dead_one_as_its_to_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ext = tmp_path / "ext"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    _record_elsewhere(ext / "deepspeed_shm_comm" / "lock", 1.0)
    out = jitops.check([jitops.SHM_COMM])
    assert out["ops"] == {jitops.SHM_COMM: "building"} and out["stale"] == []
    assert [lk["why"] for lk in out["live"]] == ["building on node3 (pid 4242; record 1 s old)"]
    _record_elsewhere(ext / "deepspeed_shm_comm" / "lock", buildowner.OWNER_TTL_S + 5)
    out = jitops.check([jitops.SHM_COMM])  # not refused: the build step removes it
    assert out["ops"] == {jitops.SHM_COMM: "building"} and out["stale"] == out["live"] == []


def test_wait_live_waits_for_a_build_elsewhere_then_lets_the_op_load(tmp_path: Path) -> None:
    lock = tmp_path / "ext" / "fused_adam" / "lock"
    _record_elsewhere(lock, 1.0)
    t0 = time.monotonic()
    still = jitops.wait_live(str(lock), 0.5, poll_s=0.1)
    assert still is not None and still["state"] == "building" and time.monotonic() - t0 >= 0.5
    os.unlink(lock)  # the other node's build finished
    assert jitops.wait_live(str(lock), 5.0, poll_s=0.1) is None


def test_the_batch_step_line_stale_refusal_and_built_fast_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ext = tmp_path / "ext"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    lock = ext / jitops.OP_NAMES[jitops.SHM_COMM] / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    assert jitbatch.batch({"ops": [jitops.SHM_COMM]}, "node7") == 2
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"clusterkit: DeepSpeed's JIT ops on node7: stale build lock {lock} "
                           "(no live process there holds it and no builder recorded it)")
    assert f"then `rm {lock}`" in line and "--remove-stale-locks" in line
    lock.unlink()
    torch_dir = jitops.package_dir("torch")
    d = lock.parent
    (d / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    (d / "build.ninja").write_text(f"cflags = -isystem {torch_dir}/include -isystem x\n")
    monkeypatch.setattr(jitops, "build", lambda *a: pytest.fail("built an op already built"))
    assert jitbatch.batch({"ops": [jitops.SHM_COMM]}, "node7") == 0
    assert capsys.readouterr().out == ("clusterkit: DeepSpeed's JIT ops on node7: cpu: "
                                       "deepspeed_shm_comm already built\n")
    # The plan guessed cuda (inventory gpus: 2); this node's torch finds none (fake GPUs):
    # it readies what its own accelerator builds, not a kernel it cannot build.
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(jitbatch, "accelerator_here", lambda torch_dir=None: "cpu")
    assert jitbatch.batch({"ops": ["FusedAdamBuilder"], "accelerator": "cuda"}, "node7") == 0
    assert capsys.readouterr().out == ("clusterkit: DeepSpeed's JIT ops on node7: cpu: "
                                       "deepspeed_shm_comm already built (planned for cuda; "
                                       "this node's accelerator is cpu)\n")


def _lock_facts(locks: list[dict[str, Any]]) -> dict[str, NodeFacts]:
    return {"n2": NodeFacts(host="n2", jit_locks=tuple(locks))}


def test_doctor_says_building_on_the_other_node_rather_than_stale() -> None:
    base = {"path": "/h/.cache/torch_extensions/py311_cpu/fused_adam/lock", "age_s": 90.0,
            "holders": []}
    ctx = DoctorContext(hosts=("n2",))
    (f,) = check_jit_locks(_lock_facts([{**base, "state": "building", "host": "node3",
                                    "why": "building on node3 (pid 4242; record 2 s old)"}]), ctx)
    assert f.status is Status.PASS and "building on node3" in f.detail and "stale" not in f.detail
    (f,) = check_jit_locks(_lock_facts([{**base, "state": "dead",
                                    "why": "its builder, pid 9 on n2, is gone"}]), ctx)
    assert f.status is Status.FAIL and "stale" in f.detail and "pid 9 on n2, is gone" in f.detail
    assert "removes it by itself" in f.fix
    (f,) = check_jit_locks(_lock_facts([{**base, "state": "unknown", "why": "..."}]), ctx)
    assert f.status is Status.FAIL and "no builder recorded it" in f.detail
    assert "--remove-stale-locks" in f.fix


def test_a_lock_another_node_removes_while_it_is_judged_is_not_reported_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes prove one dead lock at once: one removes lock and record between the
    other's listing and its reading of the record. That one must not see a lock without a
    record ('unknown', refused): on the Slurm bed node1's job stopped so once."""
    lock = tmp_path / "ext" / "fused_adam" / "lock"
    _record_elsewhere(lock, buildowner.OWNER_TTL_S + 60)
    real_owner_of = jitops.owner_of

    def removed_meanwhile(path: str, now: float) -> tuple[dict[str, Any] | None, float]:
        os.unlink(path)
        os.unlink(path + buildowner.OWNER_SUFFIX)
        return real_owner_of(path, now)

    monkeypatch.setattr(jitops, "owner_of", removed_meanwhile)
    assert jitops.locks([str(tmp_path / "ext")]) == []


def test_a_zombie_builder_is_gone() -> None:
    """A killed build its parent has not reaped yet still shows /proc/PID/stat (state Z):
    it holds nothing, so its start time is "" and the lock is dead, not 'building'."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert buildowner.start_time(child.pid) != ""
        child.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # killed, not reaped: a zombie
            with open(f"/proc/{child.pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert buildowner.start_time(child.pid) == ""
    finally:
        child.wait()
