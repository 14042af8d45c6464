"""clusterkit sync carries symbolic links, on the test bed (issue 29 leftover): 3 real sshd
nodes with node-private disks get a Hugging Face hub cache's shape (snapshots -> blobs
links, a directory link, an absolute link into it, a link out of it to a file and to a
directory, a dangling link). Each node holds the links as links and the outside targets
as files; a second run sends nothing; ``doctor --sync`` passes; a link repointed on one
node is named by doctor and put back by a rerun, which sends no byte. Small files: seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.synchelpers import SHA_CFG, SHA_W, done_event, hf_tree, run_cli
from tests.testbed import Testbed

pytestmark = pytest.mark.testbed


def test_a_hub_cache_with_its_links_on_three_nodes(testbed: Testbed, tmp_path: Path) -> None:
    nodes = testbed.ensure(3)[:3]
    work = testbed.local_mountpoint / f"sl-{tmp_path.name}"
    inv = testbed.write_inventory(tmp_path / "inv.yaml", [n.name for n in nodes],
                                  workdir=str(work))
    proj = tmp_path / "proj"
    hub = hf_tree(proj, tmp_path / "outside")
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    snap = "models--org--tiny/snapshots/rev1"

    first = run_cli(["sync", "hub", "-i", str(inv), "--json"], proj, env)
    assert first.returncode == 0, first.stderr[-2000:]
    res = done_event(first.stdout)
    assert res["ok"] and res["links"] == ["dangling"], res
    assert {n: r["links_made"] for n, r in res["nodes"].items()} == \
        {"node1": 4, "node2": 4, "node3": 4}
    assert any("2 link(s) lead outside hub" in x for x in res["notes"]), res["notes"]
    for n in nodes:
        copy = testbed.node_local_path(n, f"{work.name}/hub")
        assert os.readlink(copy / snap / "config.json") == f"../../blobs/{SHA_CFG}"
        assert os.readlink(copy / snap / "abs.json") == f"../../blobs/{SHA_CFG}"
        assert os.readlink(copy / "models--org--tiny" / "snapshots" / "latest") == "rev1"
        assert (copy / snap / "model.safetensors").read_bytes() == \
            (hub / "models--org--tiny" / "blobs" / SHA_W).read_bytes()
        assert not (copy / "tokenizer.json").is_symlink()
        assert (copy / "tokenizer.json").read_text() == "{}\n"
        assert (copy / "extra" / "a.txt").read_text() == "a\n"
        assert not os.path.lexists(copy / "dangling")

    again = run_cli(["sync", "hub", "-i", str(inv), "--json"], proj, env)
    assert again.returncode == 0, again.stderr[-2000:]
    res = done_event(again.stdout)
    assert res["sent_from_here"] == 0 and all(r["links_made"] == 0 and r["got_bytes"] == 0
                                              for r in res["nodes"].values()), res
    doc = run_cli(["doctor", "-i", str(inv), "--sync", "hub", "-v"], proj, env)
    assert "node[1-3]  hub: 5 file(s), 4 link(s), digest" in doc.stdout, doc.stdout[-3000:]

    # node2's config.json repointed: doctor names node2 and the link; a rerun puts it back.
    moved = testbed.node_local_path(nodes[1], f"{work.name}/hub") / snap / "config.json"
    moved.unlink()
    moved.symlink_to(f"../../blobs/{SHA_W}")
    doc = run_cli(["doctor", "-i", str(inv), "--sync", "hub"], proj, env)
    line = next((x for x in doc.stdout.splitlines() if "sync.parity" in x), "")
    assert "FAIL" in line and "node2" in line and "hub: 1 link(s) differ" in line, doc.stdout
    assert f"{snap}/config.json" in doc.stdout  # (the table may wrap the name)
    fixed = run_cli(["sync", "hub", "-i", str(inv)], proj, env)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert "node2: 0 file(s) sent (0 bytes, verified), 5 unchanged, 1 link(s) made" in fixed.stdout
    assert "node[1,3]: 0 file(s) sent (0 bytes, verified), 5 unchanged" in fixed.stdout
    assert os.readlink(moved) == f"../../blobs/{SHA_CFG}"
