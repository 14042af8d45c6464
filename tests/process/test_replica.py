"""Checkpoint replicas, agent to agent (issue 22): the wire between a server and a client
on loopback, in threads and temp dirs, and the source's completion rule."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterkit.node import contract
from clusterkit.node.hashing import sha256_file
from clusterkit.node.replicas.area import read_manifest, safe_rel
from clusterkit.node.replicas.done import CompletionWatch
from clusterkit.node.replicas.rules import missing_rank_files
from clusterkit.node.replicas.service import ReplicaService
from clusterkit.node.replicas.wire import (
    ReplicaError,
    ReplicaServer,
    push,
    say_bye,
)
from tests.replicahelpers import fresh_job_id, ring_pair, zero2_tag

SECRET = "s" * 64
JOB = "job-replica-test"


@pytest.fixture(autouse=True)
def _fresh_replica_job_id() -> Iterator[None]:
    """A job id (hence replica ports) per test: servers of parallel tests (xdist) or
    lingering sockets of earlier ones never answer for this one."""
    global JOB
    JOB = fresh_job_id("job-replica")
    yield


@pytest.fixture
def server(tmp_path: Path) -> Any:
    holder = tmp_path / "holder" / "ckpt"
    holder.mkdir(parents=True)
    srv = ReplicaServer(JOB, 1, "node2", str(holder), SECRET, address="127.0.0.1", sources=[0])
    srv.start()
    yield srv
    srv.stop()


def _target() -> dict[str, Any]:
    return {"node": "node2", "index": 1, "address": "127.0.0.1"}


def _push(src: Path, tag: str, **kw: Any) -> int:
    args: dict[str, Any] = {"job_id": JOB, "source": 0, "source_host": "node1", "secret": SECRET,
                            "tags": sorted(p.name for p in src.iterdir() if p.is_dir())}
    args.update(kw)
    return push(str(src), tag, _target(), **args)



def test_a_copy_completes_and_verifies(tmp_path: Path, server: ReplicaServer) -> None:
    src = tmp_path / "src" / "ckpt"
    zero2_tag(src, "global_step10", [0, 1])
    (src / "latest").write_text("global_step10")
    (src / "zero_to_fp32.py").write_text("# script")
    old = time.time() - 10  # saved a while ago (a copy newer than its files is "the same")
    for p in src.rglob("*"):
        os.utime(p, (old, old))
    sent = _push(src, "global_step10")
    final = Path(contract.replica_dir(server.ckpt_dir, 0, "global_step10"))
    m = read_manifest(str(final))
    assert m is not None and m["source"] == 0 and m["holder"] == "node2" and m["tag"] == "global_step10"
    assert set(m["files"]) == {"global_step10/mp_rank_00_model_states.pt",
                               "global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                               "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                               "latest", "zero_to_fp32.py"}
    for rel, entry in m["files"].items():
        assert entry["sha256"] == sha256_file(str(src / rel)) == sha256_file(str(final / rel))
    assert sent == sum(e["size"] for e in m["files"].values())
    # Pushed again unchanged: the holder has it, nothing is sent.
    assert _push(src, "global_step10") == 0


def test_a_wrong_secret_is_refused(tmp_path: Path, server: ReplicaServer) -> None:
    src = tmp_path / "src" / "ckpt"
    zero2_tag(src, "global_step10", [0])
    with pytest.raises(ReplicaError, match="authentication"):
        _push(src, "global_step10", secret="t" * 64)
    with pytest.raises(ReplicaError, match="authentication"):
        say_bye(_target(), JOB, 0, "t" * 64)
    assert not os.path.exists(contract.replica_dir(server.ckpt_dir, 0, "global_step10"))
    assert not server.byes


def test_another_jobs_server_is_not_spoken_to(tmp_path: Path, server: ReplicaServer) -> None:
    src = tmp_path / "src" / "ckpt"
    zero2_tag(src, "global_step10", [0])
    with pytest.raises(ReplicaError, match="no replica server"):
        _push(src, "global_step10", job_id="another-job")


def test_a_byte_flipped_on_the_wire_is_detected_and_nothing_renamed(
        tmp_path: Path, server: ReplicaServer) -> None:
    src = tmp_path / "src" / "ckpt"
    zero2_tag(src, "global_step10", [0])
    flipped = []

    def flip(block: bytes) -> bytes:
        if flipped:
            return block
        flipped.append(1)
        return bytes([block[0] ^ 1]) + block[1:]

    with pytest.raises(ReplicaError, match="sha256 mismatch"):
        _push(src, "global_step10", tamper=flip)
    area = Path(contract.replica_source_dir(server.ckpt_dir, 0))
    assert list(area.iterdir()) == []  # no copy, no partial dir


def test_pruning_follows_the_source(tmp_path: Path, server: ReplicaServer) -> None:
    src = tmp_path / "src" / "ckpt"
    for tag in ("global_step10", "global_step20"):
        zero2_tag(src, tag, [0], size=1000)
        _push(src, tag)
    area = Path(contract.replica_source_dir(server.ckpt_dir, 0))
    assert sorted(p.name for p in area.iterdir()) == ["global_step10", "global_step20"]
    # The source's keep policy removed step 10: the next push prunes its copy.
    shutil.rmtree(src / "global_step10")
    zero2_tag(src, "global_step30", [0], size=1000)
    _push(src, "global_step30")
    assert sorted(p.name for p in area.iterdir()) == ["global_step20", "global_step30"]


def test_bye_is_authenticated_and_ends_the_wait(server: ReplicaServer) -> None:
    assert not server.wait_sources(0.1)
    say_bye(_target(), JOB, 0, SECRET)
    assert server.wait_sources(1.0)


KILLED_CLIENT = f"""
import sys, time
from clusterkit.node.replicas.wire import push
sys.argv.pop(0)
src, job = sys.argv[0], sys.argv[1]
def slow(block):
    time.sleep(0.05)
    return block
push(src, "global_step10", {{"node": "node2", "index": 1, "address": "127.0.0.1"}},
     job_id=job, source=0, source_host="node1", secret={SECRET!r}, tags=["global_step10"], tamper=slow)
"""


def test_a_client_killed_mid_copy_leaves_nothing_counted(tmp_path: Path) -> None:
    holder = tmp_path / "holder" / "ckpt"
    holder.mkdir(parents=True)
    srv = ReplicaServer(JOB, 1, "node2", str(holder), SECRET, address="127.0.0.1")
    srv.start()
    src = tmp_path / "src" / "ckpt"
    zero2_tag(src, "global_step10", [0, 1], size=4 << 20)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, str(src), JOB])
    area = Path(contract.replica_source_dir(str(holder), 0))
    deadline = time.monotonic() + 20
    while not (area.is_dir() and any(area.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # The receiving thread runs at idle priority (node/replicas/priority.py): on a busy machine
    # it notices the closed connection when the CPU has time for it.
    deadline = time.monotonic() + 30
    while any(area.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    srv.stop()
    assert list(area.iterdir()) == []  # the receiver removed its partial dir
    assert not os.path.exists(contract.replica_dir(str(holder), 0, "global_step10"))
    for d, _, names in os.walk(holder.parent):
        assert contract.REPLICA_MANIFEST not in names, d
    # A partial dir a killed *receiver* would leave is swept by the next server start.
    stale = area / f"{contract.REPLICA_PARTIAL_PREFIX}global_step10-dead"
    (stale / "global_step10").mkdir(parents=True)
    srv2 = ReplicaServer(JOB, 1, "node2", str(holder), SECRET, address="127.0.0.1")
    srv2.start()
    srv2.stop()
    assert not stale.exists()


def test_unsafe_paths_are_refused() -> None:
    assert safe_rel("global_step10/a.pt", "global_step10")
    assert safe_rel("latest", "global_step10") and safe_rel("zero_to_fp32.py", "x")
    for bad in ("../x", "/etc/passwd", "global_step10/../../x", "other/a.pt", "evil.py",
                "global_step10/.hidden", contract.REPLICA_MANIFEST):
        assert not safe_rel(bad, "global_step10"), bad


# ----------------------------------------------------------------- completion


def test_missing_rank_files_infers_the_stage() -> None:
    z2 = ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"]
    assert missing_rank_files(z2, [2]) == []
    assert missing_rank_files(z2, [2, 3]) == ["zero_pp_rank_3_mp_rank_00_optim_states.pt"]
    z3 = ["zero_pp_rank_4_mp_rank_00_model_states.pt", "zero_pp_rank_4_mp_rank_00_optim_states.pt"]
    assert missing_rank_files(z3, [4]) == []
    assert missing_rank_files(z3, [4, 5]) == ["zero_pp_rank_5_mp_rank_00_model_states.pt",
                                              "zero_pp_rank_5_mp_rank_00_optim_states.pt"]
    assert missing_rank_files(["notes.txt"], [0]) == ["mp_rank_00_model_states.pt"]
    assert missing_rank_files(["mp_rank_00_model_states.pt"], [0, 1]) == []  # ZeRO-0


def test_completion_with_markers(tmp_path: Path) -> None:
    zero2_tag(tmp_path, "global_step10", [2])
    w = CompletionWatch(str(tmp_path), 1, [2], JOB, markers=True)
    assert not w.complete("global_step10")
    (tmp_path / "global_step10" / contract.marker_name(0)).write_text("{}")
    assert not w.complete("global_step10")  # another node's marker
    (tmp_path / "global_step10" / contract.marker_name(1)).write_text("{}")
    assert w.complete("global_step10")


def test_completion_without_markers(tmp_path: Path) -> None:
    zero2_tag(tmp_path, "mytag", [2, 3])
    w = CompletionWatch(str(tmp_path), 1, [2, 3], JOB, markers=False)
    assert w.why_not("mytag", now=100.0) == "changed since the last poll"
    assert "less than" in (w.why_not("mytag", now=101.0) or "")
    assert w.why_not("mytag", now=102.5) is None
    # A file that changes starts the clock again.
    (tmp_path / "mytag" / "extra.bin").write_bytes(b"1")
    assert w.why_not("mytag", now=103.0) == "changed since the last poll"
    assert w.why_not("mytag", now=105.5) is None
    # A rank's shard missing.
    w2 = CompletionWatch(str(tmp_path), 1, [2, 3, 4], JOB, markers=False)
    assert "zero_pp_rank_4" in (w2.why_not("mytag", now=0.0) or "")


def test_a_tag_converted_inside_itself_owes_its_conversion_not_this_node_s_ranks(
        tmp_path: Path) -> None:
    """accelerate's step_10 after a reshard onto fewer nodes (jobs/reshard.py): the old
    world's tag set aside holds old rank 2's shard, the conversion (a universal marker
    listing its files) is in the place the library loads. New rank 1's node judges it by
    the conversion: finished when every file the marker lists is there at its size (a
    test bed run had it never finished there: 'missing zero_pp_rank_1...')."""
    zero2_tag(tmp_path / "step_10", "pytorch_model.set-aside", [2])
    conv = tmp_path / "step_10" / "pytorch_model"
    (conv / "zero" / "w").mkdir(parents=True)
    (conv / "zero" / "w" / "fp32.pt").write_bytes(b"x" * 10)
    marker = {"files": {"zero/w/fp32.pt": 10}, "source_tag": "step_10/pytorch_model.set-aside"}
    (conv / contract.UNIVERSAL_MARKER).write_text(json.dumps(marker))
    (tmp_path / "step_10" / contract.LATEST_UNIVERSAL_FILE).write_text("pytorch_model\n")
    w = CompletionWatch(str(tmp_path), 1, [1], JOB, markers=False)
    assert w.why_not("step_10", now=0.0) == "changed since the last poll"
    assert w.why_not("step_10", now=5.0) is None
    (conv / "zero" / "w" / "fp32.pt").write_bytes(b"x" * 4)  # a conversion copied short
    assert "has 4 bytes, its universal marker recorded 10" in (w.why_not("step_10", now=6.0) or "")
    # Without the conversion the same dir is judged by this node's ranks, as before.
    shutil.rmtree(conv)
    assert "zero_pp_rank_1" in (w.why_not("step_10", now=7.0) or "")


def test_a_truncated_zip_is_not_complete(tmp_path: Path) -> None:
    zero2_tag(tmp_path, "mytag", [0])
    shard = tmp_path / "mytag" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:-30])  # the end record cut off
    w = CompletionWatch(str(tmp_path), 0, [0], JOB, markers=False)
    w.why_not("mytag", now=0.0)
    assert "not a whole zip" in (w.why_not("mytag", now=5.0) or "")


def test_a_file_open_by_a_job_process_is_not_complete(tmp_path: Path) -> None:
    zero2_tag(tmp_path, "mytag", [0])
    w = CompletionWatch(str(tmp_path), 0, [0], JOB, markers=False)
    w.why_not("mytag", now=0.0)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; f=open(sys.argv[1],'ab'); print(1, flush=True); "
         "time.sleep(60)", str(tmp_path / "mytag" / "mp_rank_00_model_states.pt")],
        env={**os.environ, contract.ENV_JOB_ID: JOB}, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline()
        assert not w.complete("mytag", now=5.0)
    finally:
        holder.kill()
        holder.wait()
    assert w.complete("mytag", now=6.0)
    assert json.dumps(w.tags()) == '["mytag"]'


def test_two_services_replicate_each_other_and_finish(tmp_path: Path) -> None:
    """The agent's service: a marker-complete tag is pushed to the ring successor, the
    event and replicas.json say so, finish() says BYE both ways."""
    events: list[Any] = []
    services = [ReplicaService(cfg, JOB, f"n{i}", str(tmp_path / f"n{i}.json"), events.append,
                               lambda m: None)
                for i, cfg in enumerate(ring_pair(tmp_path, SECRET))]
    for svc in services:
        svc.start()
    for i in (0, 1):
        ckpt = tmp_path / f"n{i}" / "ckpt"
        zero2_tag(ckpt, "global_step5", [i], size=1000)
        (ckpt / "global_step5" / contract.marker_name(i)).write_text("{}")
    ends = [threading.Thread(target=svc.end, args=(True,)) for svc in services]
    for t in ends:
        t.start()
    for t in ends:
        t.join(30)
    assert sorted((e.source, e.target, e.state) for e in events) == [
        (0, "n1", "complete"), (1, "n0", "complete")]
    for i in (0, 1):
        other = 1 - i
        held = contract.replica_dir(str(tmp_path / f"n{other}" / "ckpt"), i, "global_step5")
        assert read_manifest(held) is not None
        state = json.loads((tmp_path / f"n{i}.json").read_text())
        assert state == {"global_step5": {f"n{other}": "complete"}}
        assert services[i].server.byes == {other}


def test_a_node_that_cannot_serve_still_says_bye_and_ends_at_once(tmp_path: Path) -> None:
    """Every replica port taken: an Error event, no copies, and the end does not wait
    (its BYE still reaches its target, which then does not wait for it either)."""
    import socket

    from clusterkit.node import protocol

    job = "job-cannot-serve"  # ports of its own (earlier tests' may linger in TIME_WAIT)
    taken = []
    for port in contract.replica_ports(job, 0):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen(1)
        taken.append(sock)
    holder = tmp_path / "holder" / "ckpt"
    holder.mkdir(parents=True)
    srv = ReplicaServer(job, 1, "n1", str(holder), SECRET, address="127.0.0.1", sources=[0])
    srv.start()
    events: list[Any] = []
    ckpt = tmp_path / "n0" / "ckpt"
    ckpt.mkdir(parents=True)
    cfg = {"index": 0, "address": "127.0.0.1", "ckpt_dir": str(ckpt), "ranks": [0],
           "markers": True, "sources": [1], "secret": SECRET,
           "targets": [{"node": "n1", "index": 1, "address": "127.0.0.1"}]}
    svc = ReplicaService(cfg, job, "n0", str(tmp_path / "n0.json"), events.append, lambda m: None)
    try:
        svc.start()
        assert isinstance(events[0], protocol.Error) and "replication is off" in events[0].message
        t0 = time.monotonic()
        svc.end(True)
        assert time.monotonic() - t0 < 10
        assert srv.wait_sources(1.0)
    finally:
        srv.stop()
        for sock in taken:
            sock.close()


def test_a_retried_failure_is_logged_only_the_last_one_is_an_event(tmp_path: Path) -> None:
    """At a (re)start the peers' servers come up at different moments: a refused try that
    will be retried stays in the node's log; only the try that gives up is an event."""
    from clusterkit.launch.replica_events import replica_line
    from clusterkit.node import protocol
    from clusterkit.node.replicas import service

    events: list[Any] = []
    logged: list[str] = []
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # A target that never answers (nothing listens on its ports).
    cfg = {"index": 0, "address": "127.0.0.1", "ckpt_dir": str(ckpt), "ranks": [0],
           "markers": True, "sources": [], "secret": SECRET,
           "targets": [{"node": "n1", "index": 1, "address": "127.0.0.1"}]}
    svc = ReplicaService(cfg, "job-nobody-listens", "n0", str(tmp_path / "n0.json"),
                         events.append, logged.append)
    for tries in range(1, service.MAX_TRIES + 1):
        svc._tries.pop(("global_step5", "n1"), None)
        if tries > 1:
            svc._tries[("global_step5", "n1")] = (tries - 1, 0.0)
        svc._copy("global_step5", "n1")
    assert len(logged) == service.MAX_TRIES
    assert len(events) == 1 and events[0].state == "failed" and "giving up" in events[0].detail
    assert "failed" in replica_line(events[0])
    have = protocol.Replica("n0", tag="global_step5", source=0, target="n1", state="complete",
                            detail=protocol.REPLICA_ALREADY_THERE)
    assert "already there" in replica_line(have) and "copied" not in replica_line(have)


def test_the_watch_lists_tags_oldest_first_by_the_step_they_name(tmp_path: Path) -> None:
    """global_step100 after global_step20, mystep12 after mystep4 (a sort by name puts
    them first, and the pusher, oldest first, then copied the newest save first)."""
    for tag in ("global_step100", "global_step20", "mystep12", "mystep4", ".hidden"):
        (tmp_path / tag).mkdir()
    watch = CompletionWatch(str(tmp_path), 0, [0], JOB, True)
    assert watch.tags() == ["mystep4", "mystep12", "global_step20", "global_step100"]
    assert [contract.tag_step(t) for t in watch.tags()] == [4, 12, 20, 100]
