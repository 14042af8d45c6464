"""clusterkit sync's pipelined chain on the test bed (issue 29): real sshd nodes, node-private
disks, TCP between the nodes' namespaces.

One sequence on 4 nodes (sharing the set-up keeps it to seconds): the chain delivers
byte-identical copies; a second run sends nothing; one changed file alone travels; with
every node's down link shaped to 100 Mbit/s, node2's node program is killed mid-transfer:
the others complete and verify, the end names node2 and what it lacks, and a rerun sends
only node2's missing part; a byte flipped in node3's copy: ``doctor --sync`` names node3
and the file, a rerun repairs only that file and every copy is byte-identical again
(issue 37 item 6: checked on the bytes; a second 4-node ``doctor --sync`` probe cost ~12 s,
and doctor's passing parity report is tests/bed/test_sync_links_testbed.py's).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.cli import CLI
from tests.synchelpers import done_event, run_cli
from tests.testbed import Testbed

pytestmark = pytest.mark.testbed

def _kill_node_program(tb: Testbed, node: str) -> None:
    """SIGKILL the dist node program inside ``node`` (found by its bootstrap in ps)."""
    ps = tb.exec(node, ["ps", "-eo", "pid,args"], timeout=30).stdout
    pids = [ln.split()[0] for ln in ps.splitlines() if "import linecache" in ln]
    assert pids, ps
    tb.exec(node, ["kill", "-9", *pids], timeout=30)


def _shape(tb: Testbed, nodes: list[Any], mbit: int | None) -> None:
    for n in nodes:
        argv = (["tc", "qdisc", "replace", "dev", n.veth, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", "256kb", "latency", "100ms"] if mbit else
                ["tc", "qdisc", "del", "dev", n.veth, "root"])
        subprocess.run(argv, capture_output=True, check=mbit is not None, timeout=30)


@pytest.mark.slow  # ~30 s
def test_chain_delta_lost_node_and_flipped_byte(testbed: Testbed, tmp_path: Path) -> None:
    nodes = testbed.ensure(4)[:4]
    work = testbed.local_mountpoint / f"sd-{tmp_path.name}"
    inv = testbed.write_inventory(tmp_path / "inv.yaml", [n.name for n in nodes],
                                  workdir=str(work))
    proj = tmp_path / "proj"
    src = proj / "data"
    (src / "shards").mkdir(parents=True)
    for i in range(6):  # six 10 MB files: a rerun after a loss sends only the missing ones
        (src / f"model-{i}.bin").write_bytes(os.urandom(10_000_000))
    for i in range(20):
        (src / "shards" / f"s{i:02d}.bin").write_bytes(os.urandom(10_000))
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))

    def copy(node: Any) -> Path:
        return testbed.node_local_path(node, f"{work.name}/data")

    def tree(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and ".clusterkit-sync" not in p.parts}

    first = run_cli(["sync", "data", "-i", str(inv), "--json"], proj, env)
    assert first.returncode == 0, first.stderr[-2000:]
    res = done_event(first.stdout)
    assert res["ok"] and res["chains"] == [[n.name for n in nodes]]
    assert res["sent_from_here"] == 60_200_000  # one copy from here, whatever the node count
    want = tree(src)
    for n in nodes:
        assert tree(copy(n)) == want, n.name

    again = run_cli(["sync", "data", "-i", str(inv), "--json"], proj, env)
    assert again.returncode == 0 and done_event(again.stdout)["sent_from_here"] == 0

    (src / "shards" / "s07.bin").write_bytes(b"changed")
    one = run_cli(["sync", "data", "-i", str(inv)], proj, env)
    assert one.returncode == 0, one.stderr[-2000:]
    assert one.stdout == "  node[1-4]: 1 file(s) sent (7 bytes, verified), 25 unchanged\n"

    # A node lost mid-transfer: the others complete; a rerun completes only it.
    for i in range(6):
        (src / f"model-{i}.bin").write_bytes(os.urandom(10_000_000))
    _shape(testbed, nodes, 100)
    try:
        proc = subprocess.Popen([*CLI, "sync", "data", "-i", str(inv), "--json"], cwd=proj,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for raw in proc.stdout:
            ev = json.loads(raw)
            # Progress counts bytes written; past 20.5 MB node2 has two whole files
            # (verified, in place) that the rerun must not send again.
            if ev["event"] == "progress" and ev["nodes"]["node2"][0] > 20_500_000:
                _kill_node_program(testbed, "node2")
                break
        out, err = proc.communicate(timeout=120)
    finally:
        _shape(testbed, nodes, None)
    assert proc.returncode == 2, err[-2000:]
    res = done_event(out)
    lost = res["nodes"]["node2"]
    assert lost["state"] == "lost" and 0 < lost["got_bytes"] < 60_000_000, lost
    assert [n for n, r in res["nodes"].items() if r["state"] == "done"] == ["node1", "node3", "node4"]
    for n in (nodes[0], nodes[2], nodes[3]):
        assert tree(copy(n)) == tree(src), n.name
    assert "sync incomplete on 1 of 4 node(s): node2" in err
    rerun = run_cli(["sync", "data", "-i", str(inv), "--json"], proj, env)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    res = done_event(rerun.stdout)
    assert 0 < res["nodes"]["node2"]["got_bytes"] <= 40_200_000  # its two whole files stay
    assert {n: r["got_bytes"] for n, r in res["nodes"].items() if n != "node2"} == \
        {"node1": 0, "node3": 0, "node4": 0}
    assert tree(copy(nodes[1])) == tree(src)

    # A byte flipped on node3: doctor names the node and the file; a rerun repairs it alone.
    flipped = copy(nodes[2]) / "shards" / "s03.bin"
    data = bytearray(flipped.read_bytes())
    data[100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    doc = run_cli(["doctor", "-i", str(inv), "--sync", "data"], proj, env)
    line = next((x for x in doc.stdout.splitlines() if "sync.parity" in x), "")
    assert "FAIL" in line and "node3" in line and \
        "data: 1 file(s) differ from what sync put there: shards/s03.bin" in line, doc.stdout[-3000:]
    fixed = run_cli(["sync", "data", "-i", str(inv)], proj, env)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert "node3: 1 file(s) sent (10,000 bytes, verified), 25 unchanged" in fixed.stdout
    assert "node[1-2,4]: 0 file(s) sent" in fixed.stdout
    # Repaired: every copy is the source again, byte for byte. (A second `doctor --sync -v`
    # said so, ~12 s of a 4-node probe; its passing report is checked by
    # tests/bed/test_sync_links_testbed.py, and parity is these bytes against the same record.)
    for n in nodes:
        assert tree(copy(n)) == tree(src), n.name


def test_nodes_that_cannot_reach_each_other_are_fed_from_here(testbed: Testbed,
                                                             tmp_path: Path) -> None:
    """node1 has no route to node2 (a blackhole route in node1's namespace: this kernel
    has no packet filter): node2 heads a chain of its own, fed from here, and the end
    says what that costs; every node still gets every byte."""
    nodes = testbed.ensure(3)[:3]
    work = testbed.local_mountpoint / f"sd-{tmp_path.name}"
    inv = testbed.write_inventory(tmp_path / "inv.yaml", [n.name for n in nodes],
                                  workdir=str(work))
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "w.bin").write_bytes(os.urandom(2_000_000))
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    route = ["ip", "route", "add", "blackhole", f"{nodes[1].address}/32"]
    testbed.exec(nodes[0], route, timeout=30, check=True)
    try:
        res = run_cli(["sync", "data", "-i", str(inv)], proj, env)
        doc = run_cli(["doctor", "-i", str(inv), "--sync", "data", "--json"], proj, env)
    finally:
        testbed.exec(nodes[0], ["ip", "route", "del", "blackhole", f"{nodes[1].address}/32"],
                     timeout=30)
    assert res.returncode == 0, res.stderr[-2000:]
    # said once, on stderr, as it happened (not again at the end)
    assert "  note: node-to-node blocked on port 29640 (node1 -> node2: " in res.stderr
    assert "sending 2 copies from here, ~2x size/rate" in res.stderr
    assert "note:" not in res.stdout
    assert "node[1-3]: 1 file(s) sent (2,000,000 bytes, verified), 0 unchanged" in res.stdout
    assert "4.0 MB sent from here" in res.stderr
    ports = [f for f in json.loads(doc.stdout)["findings"] if f["check"] == "sync.ports"]
    assert [(f["status"], f["host"]) for f in ports] == [("WARN", "node1")], ports
    assert ports[0]["detail"].startswith("node1 -> node2 blocked (port 29640: ")


def test_a_node_whose_port_this_machine_cannot_reach_is_fed_over_ssh(testbed: Testbed,
                                                                     tmp_path: Path) -> None:
    """Only SSH gets from here to node1 (a policy route in node1's namespace drops its
    answers from the dist ports to this machine: this kernel has no packet filter): node1
    is fed over its SSH session, node1 -> node2 -> node3 stay TCP, the console says so
    once with the cost, every copy is byte-identical, and a rerun sends nothing."""
    nodes = testbed.ensure(3)[:3]
    work = testbed.local_mountpoint / f"sd-{tmp_path.name}"
    inv = testbed.write_inventory(tmp_path / "inv.yaml", [n.name for n in nodes],
                                  workdir=str(work))
    proj = tmp_path / "proj"
    (proj / "data" / "sub").mkdir(parents=True)
    (proj / "data" / "w.bin").write_bytes(os.urandom(3_000_000))
    for i in range(10):
        (proj / "data" / "sub" / f"f{i}.txt").write_text(f"{i}\n" * 1000)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    rule = ["to", f"{testbed.bridge_address}/32", "ipproto", "tcp", "sport", "29640-29655",
            "lookup", "29640", "priority", "100"]
    testbed.exec(nodes[0], ["ip", "route", "add", "blackhole", f"{testbed.bridge_address}/32",
                            "table", "29640"], timeout=30, check=True)
    testbed.exec(nodes[0], ["ip", "rule", "add", *rule], timeout=30, check=True)
    try:
        res = run_cli(["sync", "data", "-i", str(inv), "--json"], proj, env)
        again = run_cli(["sync", "data", "-i", str(inv), "--json"], proj, env)
    finally:
        testbed.exec(nodes[0], ["ip", "rule", "del", *rule], timeout=30)
        testbed.exec(nodes[0], ["ip", "route", "flush", "table", "29640"], timeout=30)
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    done = done_event(res.stdout)
    assert done["ok"] and done["chains"] == [["node1", "node2", "node3"]], done
    assert len(done["notes"]) == 1, done["notes"]
    assert done["notes"][0].startswith("node1: port 2964") and \
        done["notes"][0].endswith("feeding it over SSH (slower: SSH's cipher on this machine's CPU)")
    src = proj / "data"
    want = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    for n in nodes:
        copy = testbed.node_local_path(n, f"{work.name}/data")
        got = {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*")
               if p.is_file() and ".clusterkit-sync" not in p.parts}
        assert got == want, n.name
    assert again.returncode == 0 and done_event(again.stdout)["sent_from_here"] == 0


@pytest.mark.extended
def test_a_spare_that_takes_a_lost_nodes_place_gets_the_synced_dir(testbed_required: None,
                                                                   tmp_path: Path) -> None:
    """launch --sync data --max-restarts 1 --drop-failed-nodes, 3 nodes + `spares: [node4]`,
    node-private workdirs: node3 destroyed once the step-4 save is replicated; before the
    restart's ranks start, data goes to node4 (which never had it) and node1-2 are sent
    nothing; the restarted job ends, and node4's copy is byte-identical."""
    from clusterkit.node.contract import REPLICA_MANIFEST
    from tests.helpers import Console, lose_node_mid_run, train_env
    from tests.testbed import temporary

    data = tmp_path / "data"
    data.mkdir()
    (data / "tokens.bin").write_bytes(os.urandom(1_000_000))
    (data / "meta.json").write_text('{"v": 1}\n')
    with temporary(4) as tb:
        work = tb.local_mountpoint / "w"
        inv = tb.write_inventory(tmp_path / "inv.yaml", slots=1, workdir=str(work))
        inv.write_text(inv.read_text() + "spares: [node4]\n")
        argv = [*CLI, "launch", "-i", str(inv), "--job-id", "sp", "--nodes", "3",
                "--storage", "node-local", "--steps", "120", "--save-every", "4",
                "--replicas", "1", "--grace", "2", "--skip-checks", "--sync", "data",
                "--max-restarts", "1", "--drop-failed-nodes"]
        run = Console(argv, train_env(tmp_path), tmp_path)
        replica = tb.node_local_path(
            "node1", f"ckpt/sp.replicas/node2/global_step4/{REPLICA_MANIFEST}")
        code = lose_node_mid_run(tb, run, "node3", [(replica.exists, 600,
                                                     "node3's step-4 replica on node1")], 600)
        text = run.text
        assert code == 0, text[-4000:]
        restart = text[text.index("restarting (attempt 2 of 2)"):]
        assert "node4: 2 file(s) sent (1,000,009 bytes, verified), 0 unchanged" in restart, \
            restart[:3000]
        assert "node[1-2]: 0 file(s) sent (0 bytes, verified), 2 unchanged" in restart
        copy = tb.node_local_path("node4", "w/data")
        assert (copy / "tokens.bin").read_bytes() == (data / "tokens.bin").read_bytes()
        print("\n".join(ln for ln in text.splitlines() if "[clusterkit]" in ln
                        or "sent" in ln)[-3000:])


def test_nodes_whose_workdir_is_one_directory_each_place_their_copy(testbed: Testbed,
                                                                     tmp_path: Path) -> None:
    """Seen as a user: a workdir that every node sees (the bed's shared dir, as an NFS
    home on a real cluster) but the inventory does not call shared. Every node received
    each file into the same partial/<sha>, the first rename took it and the others
    failed ("No such file or directory": `sync incomplete on 1 of 3 node(s)`). Now each
    host's partial is its own and every node places the file (the same bytes)."""
    nodes = testbed.ensure(3)[:3]
    work = testbed.shared_dir / f"sw-{tmp_path.name}"
    inv = testbed.write_inventory(tmp_path / "inv.yaml", [n.name for n in nodes],
                                  workdir=str(work))
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    for i in range(8):
        (proj / "data" / f"f{i}.bin").write_bytes(os.urandom(2_000_000))
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    for _ in range(2):  # the race is the rename's: twice over fresh files
        res = run_cli(["sync", "data", "-i", str(inv), "--json"], proj, env)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        assert done_event(res.stdout)["ok"]
        for f in (proj / "data").iterdir():
            assert (work / "data" / f.name).read_bytes() == f.read_bytes()
        for i in range(8):
            (proj / "data" / f"f{i}.bin").write_bytes(os.urandom(2_000_000))
    assert os.listdir(work / "data" / ".clusterkit-sync" / "partial") == []
