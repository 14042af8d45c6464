"""Issue 25 on the namespace test bed: `launch --dry-run` runs the gate on every node over
SSH and refuses what the launch refuses; the launch refuses an unwritable checkpoint dir.

The workdir and the checkpoint dir are node-private (the test bed's scratch mount), so
one node can lack what the other has: each refusal names the node it is true of.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.cli import clusterkit_cli
from tests.testbed import Testbed

pytestmark = pytest.mark.testbed



def _error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    return res.stderr.strip().splitlines()[-1]


@pytest.mark.slow  # ~20-35 s
def test_dry_run_checks_every_node_and_the_launch_refuses_the_same(
        testbed: Testbed, tmp_path: Path) -> None:
    nodes = [n.name for n in testbed.ensure(2)]
    work = testbed.local_mountpoint / f"pre-{tmp_path.name}"  # node-private
    ckpt = testbed.local_mountpoint / f"preck-{tmp_path.name}"
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes, slots=1, workdir=str(work))
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    for node in nodes:
        testbed.exec(node, ["mkdir", "-p", str(work)], check=True)
    # The script is on the first node only.
    testbed.exec(nodes[0], ["sh", "-c", f"echo 'print(1)' > {work}/train.py"], check=True)
    base = ("launch", "-i", str(inv), "--job-id", "pre", "--storage", "node-local",
            "--ckpt-dir", str(ckpt))

    dry = clusterkit_cli(*base, "--dry-run", "train.py", cwd=tmp_path, env=env)
    assert dry.stdout.startswith("job pre on "), dry.stdout  # the plan, then the refusal
    line = _error_line(dry)
    assert f"pre-launch check failed on 1 node(s): {nodes[1]}: {work}/train.py is not on " \
           "this node" in line, line

    # Now the script is everywhere, but on the second node a file sits where the
    # checkpoint dir would be created: the dry run and the launch both name it.
    testbed.exec(nodes[1], ["sh", "-c", f"echo 'print(1)' > {work}/train.py; : > {ckpt}"],
                 check=True)
    want = (f"pre-launch check failed on 1 node(s): {nodes[1]}: checkpoint dir {ckpt}/pre "
            f"cannot be created: {ckpt} is not a directory")
    dry = clusterkit_cli(*base, "--dry-run", "train.py", cwd=tmp_path, env=env)
    assert want in _error_line(dry), dry.stderr
    real = clusterkit_cli(*base, "train.py", cwd=tmp_path, env=env)
    assert want in _error_line(real), real.stderr
    assert "\n1\n" not in real.stdout  # no rank ran

    # Fixed: the dry run says what it checked, and the launch runs.
    testbed.exec(nodes[1], ["rm", "-f", str(ckpt)], check=True)
    dry = clusterkit_cli(*base, "--dry-run", "train.py", cwd=tmp_path, env=env)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "pre-launch checks passed on 2 nodes: same Python and packages, train.py, " \
           "job and checkpoint dirs writable" in dry.stdout, dry.stdout
    for node in nodes:  # the probe left nothing behind
        assert testbed.exec(node, ["ls", "-A", str(ckpt)]).returncode != 0
    real = clusterkit_cli(*base, "train.py", cwd=tmp_path, env=env)
    assert real.returncode == 0, (real.stdout + real.stderr)[-3000:]
