"""Issue 32 item 3 on the test bed: a "node-local" checkpoint dir that two nodes share.

node1 and node2 get one directory of the test bed's shared disk as their
``checkpoint.local_dir`` (a home directory on NFS, in effect); node3 keeps its private
``/scratch``. Over SSH: doctor warns with one line naming node[1-2] and the fix (FAIL
with ``--storage node-local``), the launch gate refuses the dry run and the launch
itself (the agents' folded gate) with one line, collect-ckpt says "shared" in one line,
and no token is left behind anywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from clusterkit.hostrange import fold
from tests import synthetic_ckpt as synthetic
from tests.cli import clusterkit_cli
from tests.testbed import Testbed

pytestmark = pytest.mark.testbed



def _node_tokens(testbed: Testbed, node: str, path: str) -> str:
    """The token files under ``path`` as ``node`` sees it (its own /scratch)."""
    res = testbed.exec(node, ["sh", "-c", f"find {path} -name '.clusterkit-token*' 2>/dev/null"])
    return res.stdout.strip()


@pytest.mark.slow  # ~20-40 s
def test_a_shared_local_dir_is_named_by_doctor_the_gate_and_collect(
        testbed: Testbed, tmp_path: Path) -> None:
    nodes = [n.name for n in testbed.ensure(3)]
    common = testbed.shared_dir / f"home-{tmp_path.name}" / "ckpt"
    common.mkdir(parents=True)
    inv_data = testbed.inventory_dict(nodes, slots=1)
    for name in nodes[:2]:
        inv_data["hosts"][name]["checkpoint"] = {"local_dir": str(common)}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(inv_data, sort_keys=False))
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    shared = fold(nodes[:2])  # node[1-2]
    scratch = str(testbed.local_mountpoint / "ckpt")

    # doctor: WARN by default, FAIL for --storage node-local; node3's own dir passes
    res = clusterkit_cli("doctor", "-i", str(inv), "--master-port", "0", "--json", cwd=tmp_path, env=env)
    found = [g for g in json.loads(res.stdout)["groups"] if g["check"] == "storage.node-local"]
    assert [(g["status"], g["hosts"]) for g in found] == [
        ("WARN", nodes[:2]), ("PASS", nodes[2:])], found
    assert found[0]["detail"] == (
        f"checkpoint dir {common} is one directory shared by {shared} (a file written on one "
        "is seen on the others): node-local checkpoints and replicas would collide there")
    assert found[0]["fix"] == ("use --storage shared, or a checkpoint.local_dir (--ckpt-dir) "
                               "on each node's own disk")
    res = clusterkit_cli("doctor", "-i", str(inv), "--master-port", "0", "--storage", "node-local",
               cwd=tmp_path, env=env)
    assert res.returncode == 2
    lines = [ln for ln in res.stdout.splitlines() if "storage.node-local" in ln]
    assert lines[0].startswith("FAIL  storage.node-local") and shared in lines[0], res.stdout

    # the gate: the dry run (run_gate) and the launch (the agents' folded gate)
    script = testbed.root / "work" / f"shared-{tmp_path.name}.py"
    script.write_text("print('rank ran')\n")
    base = ("launch", "-i", str(inv), "--job-id", "shck", "--storage", "node-local",
            "--replicas", "1", script.name)
    want = (f"pre-launch check failed on 2 node(s): {shared}: checkpoint dir {common}/shck is "
            f"one directory shared by {shared}")
    for extra in (("--dry-run",), ()):
        res = clusterkit_cli(*base[:-1], *extra, base[-1], cwd=testbed.root / "work", env=env)
        assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
        line = res.stderr.strip().splitlines()[-1]
        assert want in line and "use --storage shared" in line, line
        assert "rank ran" not in res.stdout
        assert not list(common.rglob(".clusterkit-token*"))
        assert _node_tokens(testbed, nodes[2], scratch) == ""

    # collect-ckpt: both nodes wrote their part into the one directory
    synthetic.write_node_local([str(common)] * 2, zero_stage=2, shard_bytes=1024,
                               model_bytes=256)
    res = clusterkit_cli("collect-ckpt", "-i", str(inv), "--nodes", "2", "--to", str(tmp_path / "dest"),
               cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines() == [
        "clusterkit: error: checkpoint global_step1 cannot be collected, nothing was copied: "
        f"global_step1 is the same files on {shared}: its checkpoint dir {common} is one "
        f"directory shared by {shared} (a file written on one is seen on the others): "
        "node-local checkpoints and replicas would collide there — it is in one place already: "
        f"read it there, or collect it from one node (--include {nodes[0]}); for the next job "
        "use --storage shared, or a checkpoint.local_dir (--ckpt-dir) on each node's own disk"]
    one = clusterkit_cli("collect-ckpt", "-i", str(inv), "--include", nodes[0], "--to",
               str(tmp_path / "dest"), cwd=tmp_path, env=env)
    assert one.returncode == 0, one.stdout + one.stderr
