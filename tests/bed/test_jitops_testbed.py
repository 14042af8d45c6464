"""Issue 29 item 3 on the namespace test bed: `clusterkit launch` builds DeepSpeed's JIT ops
on the nodes that miss them before the ranks start, and refuses a node with a stale build
lock, naming the node, the lock and the fix.

Each node's TORCH_EXTENSIONS_DIR is on its private scratch disk. node A holds a built
deepspeed_shm_comm (the op DeepSpeed's CPU accelerator builds at every init); node B holds
its object files but no ``.so``: the launch's check calls that missing exactly as an empty
directory (no ``<name>.so``), and the build there only links (a second, not the ~50 s of a
full compile; the empty-directory build was run by hand: docs/getting-nodes-ready.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit.node.provision import jitops
from tests.cli import clusterkit_cli
from tests.testbed import Testbed

pytestmark = pytest.mark.testbed

SHM = "deepspeed_shm_comm"


def _built_here() -> Path:
    """A build of the op on this machine (torch's default build dir), made if missing."""
    torch_dir = jitops.package_dir("torch")
    assert torch_dir is not None
    src = Path(jitops.build_root(torch_dir)) / SHM
    if not (src / f"{SHM}.so").is_file():
        env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
        subprocess.run([sys.executable, "-c", "import sys; from clusterkit.node.provision import jitops;"
                        f" print(jitops.build([{jitops.SHM_COMM!r}], {{}}))"],
                       env=env, check=True, timeout=600, capture_output=True)
    return src



@pytest.mark.slow  # ~30-70 s: ops built on the nodes, then a launch
def test_launch_builds_missing_ops_first_and_refuses_a_stale_lock(
        testbed: Testbed, tmp_path: Path) -> None:
    a, b = (n.name for n in testbed.ensure(2)[:2])
    src = _built_here()
    ext = testbed.local_mountpoint / f"ext-{tmp_path.name}"  # node-private
    ckpt = testbed.local_mountpoint / f"jck-{tmp_path.name}"
    inv = testbed.write_inventory(tmp_path / "inv.yaml", [a, b], slots=1,
                                  env={"TORCH_EXTENSIONS_DIR": str(ext)})
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    base = ("launch", "-i", str(inv), "--storage", "node-local", "--ckpt-dir", str(ckpt),
            "--steps", "1")
    try:
        for node in (a, b):
            testbed.exec(node, ["sh", "-c", f"mkdir -p {ext} && cp -a {src} {ext}/ && "
                                f"rm -f {ext}/{SHM}/lock"], check=True)
        testbed.exec(b, ["rm", f"{ext}/{SHM}/{SHM}.so"], check=True)

        res = clusterkit_cli(*base, "--job-id", "jit1", cwd=tmp_path, env=env)
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        lines = res.stdout.splitlines()
        built = [i for i, line in enumerate(lines) if "DeepSpeed's JIT ops:" in line]
        assert len(built) == 1, res.stdout[-3000:]
        assert lines[built[0]].startswith(
            f"[clusterkit] DeepSpeed's JIT ops: {SHM} built on {b} ("), lines[built[0]]
        assert lines[built[0]].endswith(f" s); already built on {a}"), lines[built[0]]
        agents = next(i for i, line in enumerate(lines) if "node agents" in line)
        assert built[0] < agents  # before the ranks start
        assert testbed.exec(b, ["test", "-f", f"{ext}/{SHM}/{SHM}.so"]).returncode == 0

        # A build killed half-way on node A: the launch refuses it before any rank starts.
        lock = f"{ext}/{SHM}/lock"
        testbed.exec(a, ["touch", "-d", "1 hour ago", lock], check=True)  # a killed build's
        res = clusterkit_cli(*base, "--job-id", "jit2", cwd=tmp_path, env=env)
        assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
        line = res.stderr.strip().splitlines()[-1]
        assert (f"JIT ops not ready on 1 node(s): {a}: build-ops: stale build lock {lock} (no "
                "live process holds it)") in line, line
        assert f"then rm {lock}" in line, line
        assert "node agents" not in res.stdout
    finally:
        for node in (a, b):
            testbed.exec(node, ["rm", "-rf", str(ext), str(ckpt)])
