"""clusterkit sync's engine (issue 29): the pure parts as tables, then the node program and
the whole path on local virtual nodes (real processes and TCP over loopback, no test bed).
The test-bed runs (real sshd nodes, a node killed mid-transfer, a flipped byte) are in
tests/bed/test_sync_engine_testbed.py."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from clusterkit.cli.main import main
from clusterkit.node.sync import store as store
from clusterkit.sync.plan import Chains, NodeView, node_lines, progress_line, records
from tests.synchelpers import local_inventory, sync_verb


# ----------------------------------------------------------------------------- chains
def test_one_chain_in_the_nodes_order() -> None:
    c = Chains.plan([0, 1, 2, 3])
    assert c.heads() == [0] and c.downstream(1) == 2 and c.upstream(0) is None
    assert c.downstream(3) is None and c.upstream(3) == 2


@pytest.mark.parametrize(("lost", "chains", "new_head"), [
    (0, [[1, 2, 3]], 1),          # the head: the launcher feeds the next node
    (2, [[0, 1], [3]], 3),        # in the middle: the rest is fed from here
    (3, [[0, 1, 2]], None),       # the tail: nothing to re-feed
])
def test_a_lost_node_is_cut_out_and_the_rest_re_fed(lost: int, chains: list[list[int]],
                                                     new_head: int | None) -> None:
    c = Chains.plan([0, 1, 2, 3])
    assert c.lose(lost) == new_head
    assert c.chains == chains
    assert c.lose(lost) is None  # twice: nothing more


def test_a_blocked_hop_splits_the_chain_and_losses_compose() -> None:
    c = Chains.plan([0, 1, 2, 3, 4])
    assert c.split_before(2) == 2 and c.chains == [[0, 1], [2, 3, 4]]
    assert c.split_before(2) is None  # already a head
    assert c.members(2) == [2, 3, 4] and c.members(3) == []
    assert c.lose(3) == 4 and c.chains == [[0, 1], [2], [4]]
    assert sorted(c.heads()) == [0, 2, 4]


def test_records_carry_every_chunk_some_node_lacks_with_who_lacks_it() -> None:
    needs = {0: {0: [0, 1], 2: [0]}, 1: {0: [1]}, 2: {}}
    assert records(needs) == [(0, 0, (0,)), (0, 1, (0, 1)), (2, 0, (0,))]
    assert records({0: {}, 1: {}}) == []  # nothing changed: nothing travels


# ----------------------------------------------------------------------------- progress
def test_progress_folds_nodes_in_the_same_state() -> None:
    views = [NodeView(f"node{i}", 9_100_000_000, 14_000_000_000, "sending") for i in range(1, 8)]
    views[6] = NodeView("node7", 3_000_000_000, 14_000_000_000, "lost")
    assert node_lines(views) == ["node[1-6]: 9.1/14.0 GB", "node7: lost at 3.0/14.0 GB"]
    line = progress_line(views, 100.0, 9_100_000_000)
    assert line.startswith("sync 65% 9.1/14.0 GB at 91.0 MB/s, ETA 0m53s: node[1-6]")
    done = [NodeView("a1", 0, 0, "done"), NodeView("a2", 5, 5, "done"),
            NodeView("a3", 0, 0, "sending")]
    assert node_lines(done) == ["a[1,3]: up to date", "a2: done"]


# ----------------------------------------------------------------------------- the store
def test_chunks_and_digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "CHUNK", 4)
    monkeypatch.setattr(store, "READ", 2)
    f = tmp_path / "f"
    f.write_bytes(b"abcdefghij")
    sha, chunks = store.hash_file(str(f))
    assert sha == hashlib.sha256(b"abcdefghij").hexdigest()
    assert chunks == [hashlib.sha256(x).hexdigest() for x in (b"abcd", b"efgh", b"ij")]
    assert store.chunk_count(10) == 3 and store.chunk_len(10, 2) == 2 and store.chunk_count(0) == 1
    (tmp_path / "empty").write_bytes(b"")
    assert store.hash_file(str(tmp_path / "empty"))[1] == [hashlib.sha256(b"").hexdigest()]
    # A partial with chunk 0 right and chunk 1 wrong: only chunk 0 counts.
    part = tmp_path / "part"
    part.write_bytes(b"abcdXXgh")
    assert store.verified_chunks(str(part), ["f", 10, 0, 0o644, sha, chunks]) == {0}
    # The digest: order-free, content-only.
    rows = [("a", 1, "x"), ("b", 2, "y")]
    assert store.tree_digest(rows) == store.tree_digest(reversed(rows))
    assert store.tree_digest(rows) != store.tree_digest([("a", 1, "x"), ("b", 2, "z")])


@pytest.mark.parametrize("rel", ["/etc/passwd", "../x", "a/../../x", "a//b", ".clusterkit-sync/m",
                                 "", "a\\b"])
def test_paths_that_would_escape_the_destination_are_refused(rel: str) -> None:
    assert not store.safe_rel(rel)
    with pytest.raises(ValueError, match="outside the destination"):
        store.inside("/d", rel)


# ----------------------------------------------------------------------------- local nodes
def _sync_from(proj: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """``sync code`` run from ``proj`` (another directory holding ``code``)."""
    inv = str(proj.parent / "inv.yaml")
    cwd = os.getcwd()
    os.chdir(proj)
    try:
        assert main(["sync", "code", "-i", inv]) == 0
    finally:
        os.chdir(cwd)
    cap = capsys.readouterr()
    return cap.out, cap.err


def _project(tmp_path: Path) -> Path:
    src = tmp_path / "proj" / "code"
    (src / "pkg").mkdir(parents=True)
    (src / "model.bin").write_bytes(os.urandom(3_000_000))
    (src / "pkg" / "a.py").write_text("A = 1\n")
    (src / "pkg" / "empty.py").write_text("")
    (src / "pkg" / "empty2.py").write_text("")  # same content twice: one partial each
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    return src


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".clusterkit-sync" not in p.parts}


def test_chain_of_local_nodes_delivers_verifies_and_then_sends_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    src = _project(tmp_path)
    local_inventory(tmp_path)
    out, _ = sync_verb(tmp_path / "proj", "code", tmp_path / "inv.yaml", capsys)
    assert out == "  v[0-2]: 5 file(s) sent (3,000,016 bytes, verified), 0 unchanged\n"
    for i in range(3):
        dest = tmp_path / f"w{i}" / "code"
        assert _tree(dest) == _tree(src)
        assert os.stat(dest / "run.sh").st_mode & 0o777 == 0o755
        assert os.stat(dest / "model.bin").st_mtime_ns == os.stat(src / "model.bin").st_mtime_ns
        assert os.listdir(dest / ".clusterkit-sync" / "partial") == []
    out, _ = sync_verb(tmp_path / "proj", "code", tmp_path / "inv.yaml", capsys, "--json")
    done = json.loads(out.splitlines()[-1])
    assert done["ok"] and done["sent_from_here"] == 0 and done["chains"] == [["v0", "v1", "v2"]]
    assert {n: r["got_bytes"] for n, r in done["nodes"].items()} == {"v0": 0, "v1": 0, "v2": 0}
    # A synced copy can be synced on: its own state directory stays behind.
    out, _ = _sync_from(tmp_path / "w0", capsys)
    assert out == "  v[0-2]: 0 file(s) sent (0 bytes, verified), 5 unchanged\n"
    # One file changed here: only it travels.
    (src / "pkg" / "a.py").write_text("A = 2\n")
    out, _ = sync_verb(tmp_path / "proj", "code", tmp_path / "inv.yaml", capsys)
    assert out == "  v[0-2]: 1 file(s) sent (6 bytes, verified), 4 unchanged\n"


def test_bad_inputs_are_one_line_and_leave_nothing_half_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    src = _project(tmp_path)
    local_inventory(tmp_path)
    # A destination that is a file on one node: that node fails, the others complete.
    (tmp_path / "w1").mkdir()
    (tmp_path / "w1" / "code").write_text("not a dir\n")
    out, err = sync_verb(tmp_path / "proj", "code", tmp_path / "inv.yaml", capsys, code=2)
    assert "  v1: failed: WireError: " in out and "code exists and is not a directory" in out
    assert "  v[0,2]: 5 file(s) sent" in out
    assert "sync incomplete on 1 of 3 node(s): v1" in err
    assert (tmp_path / "w1" / "code").read_text() == "not a dir\n"
    # A destination outside the workdir.
    _, err = sync_verb(tmp_path / "proj", "code", tmp_path / "inv.yaml", capsys, "--dest", "../../etc",
                       code=2)
    assert err.count("\n") == 1 and "../../etc is outside the workdir" in err
    # A symbolic link loop as DIR; a loop inside DIR is not followed and not copied.
    os.symlink("loop2", tmp_path / "proj" / "loop1")
    os.symlink("loop1", tmp_path / "proj" / "loop2")
    assert main(["sync", str(tmp_path / "proj" / "loop1"), "-i", str(tmp_path / "inv.yaml")]) == 2
    assert "symbolic link loop" in capsys.readouterr().err
    os.symlink("self", src / "self")
    (tmp_path / "w1" / "code").unlink()
    out, _ = sync_verb(tmp_path / "proj", "code", tmp_path / "inv.yaml", capsys)
    assert "1 symbolic link(s) not copied: self" in out and "v1: 5 file(s) sent" in out
    # --delete in a directory sync never filled.
    (tmp_path / "w0" / "other").mkdir()
    (tmp_path / "w0" / "other" / "keep.txt").write_text("mine\n")
    cwd = os.getcwd()
    os.chdir(tmp_path / "proj")
    try:
        assert main(["sync", "code", "-i", str(tmp_path / "inv.yaml"), "--dest", "other",
                     "--delete"]) == 2
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "v0: failed: WireError: --delete: " in out and "holds no clusterkit sync manifest" in out
    assert (tmp_path / "w0" / "other" / "keep.txt").read_text() == "mine\n"


def test_a_file_that_changes_while_it_is_sent_is_refused_by_every_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clusterkit.remote.base import SSHTarget
    from clusterkit.remote.local import LocalTransport
    from clusterkit.sync.engine import SyncNode, sync_dir

    src = tmp_path / "src"
    src.mkdir()
    big = src / "big.bin"
    big.write_bytes(os.urandom(40_000_000))
    (src / "ok.txt").write_text("fine\n")
    nodes = [SyncNode(f"v{i}", SSHTarget(f"v{i}", "127.0.0.1", local=True), sys.executable,
                      "127.0.0.1", str(tmp_path / f"d{i}")) for i in range(2)]
    from clusterkit.sync import engine

    plan_records = engine.records

    def change_then_plan(needs: object) -> object:  # after the scan and hashing, before the send
        with open(big, "r+b") as fh:
            fh.seek(10)
            fh.write(b"changed!")
        return plan_records(needs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "records", change_then_plan)
    res = sync_dir(LocalTransport(), nodes, str(src))
    assert res.changed == ["big.bin"] and not res.ok
    for i in range(2):
        d = tmp_path / f"d{i}"
        assert (d / "ok.txt").read_text() == "fine\n"
        assert not (d / "big.bin").exists()  # refused: never renamed into place
        assert res.nodes[f"v{i}"].failed.keys() == {"big.bin"}


def test_launch_sync_refuses_the_nodes_whose_copy_differs_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    proj = tmp_path / "proj"
    (proj / "code").mkdir(parents=True)
    (proj / "code" / "train.py").write_text("print('rank ran', flush=True)\n")
    inv = local_inventory(tmp_path)
    (tmp_path / "w1").mkdir()
    (tmp_path / "w1" / "code").write_text("a file where the directory goes\n")
    monkeypatch.chdir(proj)
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    assert main(["launch", "-i", str(inv), "--sync", "code", "--nodes", "3", "--gpus-per-node",
                 "1", "--job-id", "sync-gate", "code/train.py"]) == 2
    cap = capsys.readouterr()
    assert "  v1: failed: WireError: " in cap.out and "  v[0,2]: 1 file(s) sent" in cap.out
    assert "sync incomplete on 1 of 3 node(s): v1" in cap.err
    assert "rank ran" not in cap.out + cap.err


def test_doctor_sync_rules_name_the_node_the_files_and_the_blocked_hop() -> None:
    from clusterkit.checks.findings import Status
    from clusterkit.checks.rules_sync import check_ports, check_sync

    states = {"n1": {"state": "ok", "digest": "d" * 64, "differ": [], "files": 3},
              "n2": {"state": "differs", "digest": "d" * 64, "differ": ["a", "b", "c", "e"]},
              "n3": {"state": "other", "digest": "e" * 64, "differ": []},
              "n4": {"state": "no-manifest"}, "n5": {"state": "unreachable", "why": "auth"}}
    got = {f.host: (f.status, f.detail) for f in check_sync(states, "models", "d" * 64,
                                                            ["n1", "n2", "n3", "n4", "n5"])}
    assert got["n1"] == (Status.PASS, f"models: 3 file(s), digest {'d' * 12} equal to here")
    assert got["n2"] == (Status.FAIL, "models: 4 file(s) differ from what sync put there: "
                         "a, b, c (+1 more)")
    assert got["n3"][0] == Status.FAIL and "another version" in got["n3"][1]
    assert got["n4"] == (Status.FAIL, "models: not filled by clusterkit sync")
    assert got["n5"][0] == Status.WARN
    ok = check_ports({"here -> n1": "", "n1 -> n2": ""}, 29640)
    assert [f.status for f in ok] == [Status.PASS]
    bad = check_ports({"here -> n1": "", "n1 -> n2": "port 29640: refused"}, 29640)
    assert [(f.status, f.host) for f in bad] == [(Status.WARN, "n1")]
    assert "n1 -> n2 blocked (port 29640: refused)" in bad[0].detail
    assert bad[0].fix is not None and "29640-29655" in bad[0].fix
    ssh = check_ports({"here -> n1": "timed out", "n1 -> n2": ""}, 29640)
    assert [(f.status, f.host) for f in ssh] == [(Status.WARN, "n1")]
    assert ssh[0].detail == ("here -> n1 blocked (timed out): clusterkit sync feeds n1 over its "
                             "SSH session instead (slower: SSH's cipher on this machine's CPU)")


def test_feed_route_falls_back_to_ssh_once_per_node_and_keeps_tcp_otherwise() -> None:
    from clusterkit.sync.plan import FeedRoutes

    routes = FeedRoutes()
    assert routes.decide(0, "node1", 29640, None) == ("tcp", None)
    route, note = routes.decide(0, "node1", 29640, "timed out")
    assert route == "ssh"
    assert note == ("node1: port 29640 unreachable from here (timed out): feeding it over SSH "
                    "(slower: SSH's cipher on this machine's CPU)")
    # its SSH stream broke too: no route left, and no second note
    assert routes.decide(0, "node1", 29640, "refused") == ("failed", None)
    # another head the launcher must feed (a blocked hop split the chain): its own note
    assert routes.decide(2, "node3", 29641, "refused")[0] == "ssh"


def test_a_head_whose_port_is_unreachable_is_fed_over_its_ssh_session(tmp_path: Path) -> None:
    """The launcher cannot reach v0's port (an address that refuses): v0 gets the records on
    its stdin, v1 and v2 still get theirs node to node over TCP; the same verification, a
    rerun sends nothing, a lost file alone travels again."""
    from clusterkit.remote.base import SSHTarget
    from clusterkit.remote.local import LocalTransport
    from clusterkit.sync.engine import SyncNode, sync_dir

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "big.bin").write_bytes(os.urandom(9_000_000))
    for k in range(5):
        (src / "sub" / f"f{k}.txt").write_text(f"file {k}\n" * 100)
    addr = ["192.0.2.1", "127.0.0.1", "127.0.0.1"]  # TEST-NET-1: never this machine's
    nodes = [SyncNode(f"v{i}", SSHTarget(f"v{i}", "127.0.0.1", local=True), sys.executable,
                      addr[i], str(tmp_path / f"d{i}")) for i in range(3)]
    notes: list[str] = []
    from clusterkit.sync.engine import SyncOptions

    res = sync_dir(LocalTransport(), nodes, str(src), options=SyncOptions(on_note=notes.append))
    assert res.ok, res.nodes
    assert [n for n in res.notes if "over SSH" in n] == notes and len(notes) == 1
    assert notes[0].startswith("v0: port ") and "unreachable from here" in notes[0]
    assert res.chains == [["v0", "v1", "v2"]]  # node to node stays one TCP chain
    assert res.sent_bytes == res.total_bytes  # one copy from here, over SSH
    for i in range(3):
        d = tmp_path / f"d{i}"
        assert (d / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
        assert (d / "sub" / "f3.txt").read_text() == (src / "sub" / "f3.txt").read_text()
    again = sync_dir(LocalTransport(), nodes, str(src))
    assert again.ok and again.sent_bytes == 0
    # v0 lost one file: only that travels, over SSH again
    (tmp_path / "d0" / "big.bin").unlink()
    third = sync_dir(LocalTransport(), nodes, str(src))
    assert third.ok and third.nodes["v0"].got_bytes == 9_000_000
    assert third.nodes["v1"].got_bytes == 0 and third.sent_bytes == 9_000_000


def test_launch_sync_puts_dir_on_the_nodes_again_before_a_restart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first attempt's ranks each delete a file of their synced copy and fail; the
    restart syncs DIR again before its ranks start (only that file travels, the digest is
    re-checked), so the second attempt finds the file back."""
    proj = tmp_path / "proj"
    (proj / "code").mkdir(parents=True)
    (proj / "code" / "data.txt").write_text("the data\n")
    (proj / "code" / "train.py").write_text(
        "import os, sys\n"
        "here = os.path.dirname(os.path.abspath(__file__))\n"
        "mark = os.path.join(here, '..', 'attempted')\n"
        "if not os.path.exists(mark):\n"
        "    open(mark, 'w').close()\n"
        "    os.unlink(os.path.join(here, 'data.txt'))\n"
        "    sys.exit(3)\n"
        "print('data back:', open(os.path.join(here, 'data.txt')).read().strip(), flush=True)\n")
    inv = local_inventory(tmp_path, 2)
    monkeypatch.chdir(proj)
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    assert main(["launch", "-i", str(inv), "--sync", "code", "--nodes", "2", "--gpus-per-node",
                 "1", "--job-id", "sync-restart", "--max-restarts", "1", "code/train.py"]) == 0
    cap = capsys.readouterr()
    assert "v[0-1]: 2 file(s) sent" in cap.out  # the first start
    assert "v[0-1]: 1 file(s) sent (9 bytes, verified), 1 unchanged" in cap.out  # the restart
    assert "[r0-1] data back: the data" in cap.out, cap.out[-3000:]
    assert "9 B sent from here" in cap.err  # one copy, node to node after it


def test_a_node_sweeps_only_its_own_stale_partials(tmp_path: Path) -> None:
    """Partial files carry the receiving host: on a DEST that several nodes share, one
    node's sweep leaves the others' partials alone (and still removes its own stale ones
    and those from before names carried the host)."""
    from clusterkit.node.sync.chain import Node

    part = tmp_path / store.PARTIAL_DIR
    part.mkdir(parents=True)
    names = {"mine": store.partial_name("a" * 64), "old": "b" * 64,
             "other": "c" * 64 + ".some-other-host"}
    for name in names.values():
        (part / name).write_bytes(b"x")
    node = Node({"dest": str(tmp_path), "index": 0, "secret": "s", "files": []})
    node._sweep()
    assert os.listdir(part) == [names["other"]]
    assert store.partial_path(str(tmp_path), "a" * 64) == str(part / names["mine"])
