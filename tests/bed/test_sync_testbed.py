"""Issue 12 end to end on the namespace test bed: nodes with only a Python, no shared dir.

The nodes' interpreter cannot import clusterkit (``Testbed.python_without_clusterkit``)
and their workdir is node-private (the test bed's scratch mount). `clusterkit sync`
puts the code there, `clusterkit launch` runs a script from it on 7 nodes (the
agent is shipped over SSH), and a second sync with one file changed moves only it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cli import clusterkit_cli
from tests.testbed import Testbed

pytestmark = pytest.mark.testbed

TRAIN = textwrap.dedent("""
    import os
    import helper
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} says {helper.MSG}", flush=True)
""")



def test_sync_then_launch_on_nodes_without_clusterkit_or_shared_dir(
        testbed: Testbed, tmp_path: Path) -> None:
    nodes = testbed.ensure(7)
    python = testbed.python_without_clusterkit()
    probe = testbed.exec(nodes[0].name, [python, "-c", "import clusterkit"], timeout=60)
    assert probe.returncode != 0 and "No module named 'clusterkit'" in probe.stderr
    work = testbed.local_mountpoint / f"sync-{tmp_path.name}"  # node-private: one copy per node
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes, slots=1, python=python,
                                  workdir=str(work))
    proj = tmp_path / "proj"
    (proj / "code").mkdir(parents=True)
    (proj / "code" / "train.py").write_text(TRAIN)
    (proj / "code" / "helper.py").write_text("MSG = 'hello'\n")
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))

    # Not synced yet: the gate names the missing script and the way out; nothing starts.
    early = clusterkit_cli("launch", "-i", str(inv), "--job-id", "sync-nocode", "--nodes", "7",
                 "--gpus-per-node", "1", "code/train.py", cwd=proj, env=env)
    assert early.returncode == 2, (early.stdout + early.stderr)[-3000:]
    assert (f"node[1-7]: {work}/code/train.py is not on this node (--sync DIR copies DIR to "
            "the same path under the workdir") in early.stdout + early.stderr, early.stderr[-3000:]
    assert "can't open file" not in early.stdout + early.stderr

    first = clusterkit_cli("sync", "code", "-i", str(inv), cwd=proj, env=env)
    assert first.returncode == 0, first.stderr
    assert "node[1-7]: 2 file(s) sent" in first.stdout, first.stdout

    run = clusterkit_cli("launch", "-i", str(inv), "--job-id", "sync-e2e", "--nodes", "7",
               "--gpus-per-node", "1", "code/train.py", cwd=proj, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    for rank in range(7):
        assert f"rank {rank} of 7 says hello" in run.stdout, run.stdout[-3000:]

    (proj / "code" / "helper.py").write_text("MSG = 'changed'\n")
    second = clusterkit_cli("sync", "code", "-i", str(inv), cwd=proj, env=env)
    assert second.returncode == 0, second.stderr
    # The nodes' own __pycache__ (from the run) is ignored, not "extra".
    assert second.stdout == "  node[1-7]: 1 file(s) sent (16 bytes, verified), 1 unchanged\n"
    got = testbed.exec(nodes[6].name, ["cat", str(work / "code" / "helper.py")], timeout=30)
    assert got.stdout == "MSG = 'changed'\n"


def test_doctor_and_collect_on_nodes_without_clusterkit(testbed: Testbed, tmp_path: Path) -> None:
    import json

    from tests import synthetic_ckpt as synthetic

    nodes = testbed.ensure(7)
    python = testbed.python_without_clusterkit()
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes, slots=2, python=python)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    doctor = clusterkit_cli("doctor", "-i", str(inv), "--json", "--connect-timeout", "5", cwd=tmp_path,
                  env=env)
    report = json.loads(doctor.stdout)
    assert not report["unreachable"], doctor.stderr[-2000:]
    names = {n.name for n in nodes}
    by_check: dict[str, set[str]] = {}
    for f in report["findings"]:
        by_check.setdefault(f"{f['check']} {f['status']}", set()).add(f["host"])
    assert by_check["ssh PASS"] == names
    assert by_check["version.clusterkit WARN"] == names  # not installed: only a hint

    inside = f"{testbed.local_mountpoint}/nock-{tmp_path.name}"
    synthetic.write_node_local([str(testbed.node_local_path(n, inside)) for n in nodes],
                               zero_stage=2, shard_bytes=1 << 12, model_bytes=1024,
                               hosts=[n.name for n in nodes])
    collect = clusterkit_cli("collect-ckpt", "-i", str(inv), "--dir", inside, "--to",
                   str(tmp_path / "dest"), cwd=tmp_path, env=env)
    assert collect.returncode == 0, collect.stderr[-2000:]
    assert len(list((tmp_path / "dest").glob("*/*_optim_states.pt"))) == 14


@pytest.mark.slow  # a venv with pip (~5 s), a wheel build and pip on one node (~10 s)
def test_nodes_install_over_ssh_then_the_nodes_import_this_clusterkit(
        testbed: Testbed, tmp_path: Path) -> None:
    nodes = testbed.ensure(3)
    venv = testbed.root / f"venv-install-{tmp_path.name}"  # every node sees this one path
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=180)
    python = str(venv / "bin" / "python")
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes[:3], slots=1, python=python)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    from clusterkit.provision.install import build_wheel

    # One wheel for both runs: the shared tree may change between two builds here.
    (tmp_path / "wheel").mkdir()
    wheel = str(build_wheel(str(tmp_path / "wheel")))
    first = clusterkit_cli("nodes", "install", "-i", str(inv), "--wheel", wheel, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    # One node per interpreter path installs; the others share its filesystem.
    assert "node1: installed (clusterkit" in first.stdout, first.stdout
    assert "node[2-3]: already installed" in first.stdout, first.stdout
    again = clusterkit_cli("nodes", "install", "-i", str(inv), "--wheel", wheel, cwd=tmp_path, env=env)
    assert "node[1-3]: already installed" in again.stdout, again.stdout
    got = testbed.exec(nodes[2].name, [python, "-c", "import clusterkit; print(clusterkit.__file__)"],
                       timeout=60)
    assert got.stdout.startswith(str(venv)), got.stderr
    doctor = clusterkit_cli("doctor", "-i", str(inv), "--json", "--connect-timeout", "5", cwd=tmp_path,
                  env=env)
    assert '"version.clusterkit"' in doctor.stdout
    import json

    parity = {f["host"]: f["status"] for f in json.loads(doctor.stdout)["findings"]
              if f["check"] == "version.clusterkit"}
    from clusterkit.provision.install import local_digest, wheel_digest

    # PASS unless another engineer changed the shared tree since the wheel was built.
    same = wheel_digest(Path(wheel), str(tmp_path / "unpack")) == local_digest()
    assert parity == dict.fromkeys((n.name for n in nodes[:3]), "PASS" if same else "WARN")
