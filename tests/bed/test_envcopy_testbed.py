"""Issue 29 item 2 on the namespace test bed: `clusterkit nodes env` to nodes with an empty prefix.

The environment lives under the test bed's node-local mount point, so every node
starts without it (the host's copy is the launcher's). The default test replicates a
small venv (over this interpreter's packages, tests/venvs.py, + one tiny package; its
base, this machine's Python with torch, is on the shared filesystem: recorded once,
seen equal everywhere, not sent);
a node whose facts say another CPU architecture (``CLUSTERKIT_TEST_ENVFACTS``, read
only by node/facts/envfacts.py) is refused before any byte reaches it. Then a launch runs
on it, doctor says identical, a file changed on one node is named by doctor, a
package added there is refused by the launch gate, and a rerun repairs only that.
The full environment (torch + deepspeed, ~1.9 GB) is the extended variant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from clusterkit.node.contract import ENV_TEST_ENVFACTS
from tests.cli import clusterkit_cli
from tests.paths import REPO
from tests.testbed import Testbed
from tests.venvs import venv_over_this_python

pytestmark = pytest.mark.testbed

PY = f"python{sys.version_info[0]}.{sys.version_info[1]}"
TRAIN = textwrap.dedent("""
    import os
    import ckenvtiny
    print(f"rank {os.environ['RANK']} imports {ckenvtiny.MSG}", flush=True)
""")



def _env_inventory(testbed: Testbed, path: Path, nodes: list[str], python: str, work: Path,
               env: dict[str, dict[str, str]] | None = None) -> Path:
    data: dict[str, Any] = testbed.inventory_dict(nodes, slots=1, python=python,
                                                  workdir=str(work))
    for name, values in (env or {}).items():
        data["hosts"][name]["env"] = values
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _env_findings(run: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    report = json.loads(run.stdout)
    return {f["host"]: f for f in report["findings"] if f["check"] == "env.parity"}


@pytest.mark.slow  # ~30 s: a whole environment copied, then a launch
def test_env_to_empty_prefixes_then_launch_doctor_gate_and_repair(
        testbed: Testbed, tmp_path: Path) -> None:
    nodes = [n.name for n in testbed.ensure(3)]
    prefix = testbed.local_mountpoint / f"env-{tmp_path.name}"  # node-private on the nodes
    # Over the base's packages (torch: the launch needs it), the base on the shared disk.
    venv_over_this_python(prefix)
    tiny = prefix / "lib" / PY / "site-packages" / "ckenvtiny" / "__init__.py"
    tiny.parent.mkdir(parents=True)
    tiny.write_text("MSG = 'the launcher env'\n")
    python = str(prefix / "bin" / "python")
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(TRAIN)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))
    fake = {nodes[2]: {ENV_TEST_ENVFACTS: "machine=aarch64"}}
    inv3 = _env_inventory(testbed, tmp_path / "inv3.yaml", nodes, python, work, fake)
    inv = _env_inventory(testbed, tmp_path / "inv.yaml", nodes[:2], python, work)
    for n in nodes:
        assert testbed.exec(n, ["test", "-e", str(prefix)], timeout=30).returncode != 0

    # Every regular file of the venv, counted before the copy writes its records (6 over
    # a plain interpreter; over a venv also the .pth files that point at its packages,
    # tests/venvs.py); its links are made on the node.
    files = sum(1 for p in prefix.rglob("*") if p.is_file() and not p.is_symlink()
                and "__pycache__" not in p.parts)  # byte code is not sent
    first = clusterkit_cli("nodes", "env", "-i", str(inv3), "--python", python, cwd=work, env=env)
    assert first.returncode == 2, first.stdout + first.stderr
    assert f"node[1-2]: {files} file(s) sent" in first.stdout, first.stdout
    assert (f"{nodes[2]}: refused: CPU architecture aarch64 here, x86_64 on the launcher"
            in first.stderr), first.stderr
    assert testbed.exec(nodes[2], ["test", "-e", str(prefix)], timeout=30).returncode != 0
    got = testbed.exec(nodes[1], [python, "-c", "import ckenvtiny; print(ckenvtiny.MSG)"],
                       timeout=60)
    assert got.stdout == "the launcher env\n", got.stderr

    again = clusterkit_cli("nodes", "env", "-i", str(inv), "--python", python, cwd=work, env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("  node[1-2]: nothing sent; environment "), again.stdout

    run = clusterkit_cli("launch", "-i", str(inv), "--job-id", "envcopy", "--nodes", "2",
               "--gpus-per-node", "1", "train.py", cwd=work, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    for rank in range(2):
        assert f"rank {rank} imports the launcher env" in run.stdout, run.stdout[-3000:]

    doctor = clusterkit_cli("doctor", "-i", str(inv), "--json", cwd=work, env=env)
    found = _env_findings(doctor)
    assert {h: f["status"] for h, f in found.items()} == {nodes[0]: "PASS", nodes[1]: "PASS"}
    assert "identical to the launcher's" in found[nodes[0]]["detail"]

    # Changed on one node: doctor names the node and the file.
    site = prefix / "lib" / PY / "site-packages"
    testbed.exec(nodes[1], ["sh", "-c", f"echo \"MSG = 'edited'\" > {tiny}"], timeout=30)
    found = _env_findings(clusterkit_cli("doctor", "-i", str(inv), "--json", cwd=work, env=env))
    assert found[nodes[1]]["status"] == "FAIL" and found[nodes[0]]["status"] == "PASS"
    assert "site-packages/ckenvtiny/__init__.py" in found[nodes[1]]["detail"]
    # A package installed there: the launch gate refuses that node (its record, no hashing).
    testbed.exec(nodes[1], ["sh", "-c", f"mkdir {site}/extra-1.0.dist-info && "
                            f"touch {site}/extra-1.0.dist-info/METADATA"], timeout=30)
    refused = clusterkit_cli("launch", "-i", str(inv), "--job-id", "envcopy2", "--nodes", "2",
                   "--gpus-per-node", "1", "--dry-run", "train.py", cwd=work, env=env)
    assert refused.returncode == 2
    assert (f"{nodes[1]}: environment {prefix} changed on this node since it was replicated"
            in refused.stdout + refused.stderr), (refused.stdout + refused.stderr)[-2000:]

    repair = clusterkit_cli("nodes", "env", "-i", str(inv), "--python", python, cwd=work, env=env)
    assert repair.returncode == 0, repair.stderr
    assert f"{nodes[0]}: nothing sent" in repair.stdout
    assert f"{nodes[1]}: 1 file(s) sent" in repair.stdout, repair.stdout
    assert testbed.exec(nodes[1], ["test", "-e", f"{site}/extra-1.0.dist-info"],
                        timeout=30).returncode != 0
    dry = clusterkit_cli("launch", "-i", str(inv), "--job-id", "envcopy3", "--nodes", "2",
               "--gpus-per-node", "1", "--dry-run", "train.py", cwd=work, env=env)
    assert dry.returncode == 0, (dry.stdout + dry.stderr)[-2000:]


def _plain_clusterkit(prefix: Path) -> None:
    """The copy's editable clusterkit (a finder pointing at this checkout, which every
    test-bed node shares with the host) becomes an ordinary installed copy: the copy
    must hold everything it needs, as on a cluster."""
    import shutil

    import clusterkit

    site = prefix / "lib" / PY / "site-packages"
    for p in site.glob("__editable__*clusterkit*"):
        p.unlink()
    shutil.copytree(Path(clusterkit.__file__).parent, site / "clusterkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for d in site.glob("clusterkit-*.dist-info"):
        (d / "direct_url.json").unlink(missing_ok=True)


@pytest.mark.extended
@pytest.mark.timeout(1800)  # 1.9 GB copied here, to 2 nodes, hashed 3 times: minutes
def test_the_full_environment_then_the_workload_and_a_users_deepspeed_script(
        testbed: Testbed, tmp_path: Path) -> None:
    """This machine's whole Python (torch + deepspeed, ~1.9 GB) copied under the node-local
    mount point (the launcher's environment, at a path no node has), replicated to two
    nodes, then the bundled workload and docs/examples/train.py run on it."""
    import time

    from tests.helpers import train_argv, train_env

    nodes = [n.name for n in testbed.ensure(2)]
    prefix = testbed.local_mountpoint / f"py-{tmp_path.name}"
    t0 = time.monotonic()
    subprocess.run(["cp", "-a", sys.base_prefix, str(prefix)], check=True)
    if sys.prefix != sys.base_prefix:  # a venv: its packages join the copy's own
        own = next(Path(sys.prefix).glob(f"lib/{PY}/site-packages"))
        subprocess.run(["cp", "-a", f"{own}/.", str(prefix / "lib" / PY / "site-packages")],
                       check=True)
    _plain_clusterkit(prefix)
    print(f"copy here: {time.monotonic() - t0:.1f} s (load {os.getloadavg()[0]:.1f})")
    python = str(prefix / "bin" / PY)
    # JIT builds on each node's own disk: the copy's torch headers live at another path
    # than this machine's, so its ops build anew (in the shared ~/.cache they would
    # replace this machine's own build, which every other test here uses).
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes, slots=1, python=python, env={
        "TORCH_EXTENSIONS_DIR": str(testbed.local_mountpoint / f"ext-{tmp_path.name}")})
    env = train_env(tmp_path)
    for n in nodes:
        assert testbed.exec(n, ["test", "-e", str(prefix)], timeout=30).returncode != 0

    t0 = time.monotonic()
    first = clusterkit_cli("nodes", "env", "-i", str(inv), "--python", python, cwd=tmp_path, env=env,
                 timeout=1800)
    print(f"nodes env, first: {time.monotonic() - t0:.1f} s (load {os.getloadavg()[0]:.1f})"
          f"\n{first.stdout}{first.stderr}")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "node[1-2]: " in first.stdout and "file(s) sent" in first.stdout
    t0 = time.monotonic()
    again = clusterkit_cli("nodes", "env", "-i", str(inv), "--python", python, cwd=tmp_path, env=env)
    print(f"nodes env, again: {time.monotonic() - t0:.1f} s (load {os.getloadavg()[0]:.1f})")
    assert again.returncode == 0 and "node[1-2]: nothing sent" in again.stdout, again.stdout

    # DeepSpeed's ops built once per node before any rank: the launches below build nothing.
    t0 = time.monotonic()
    ops = clusterkit_cli("nodes", "build-ops", "-i", str(inv), cwd=tmp_path, env=env, timeout=1200)
    print(f"nodes build-ops: {time.monotonic() - t0:.1f} s (load {os.getloadavg()[0]:.1f})"
          f"\n{ops.stdout}{ops.stderr}")
    assert ops.returncode == 0 and "node[1-2]: cpu: ShareMemCommBuilder built" in ops.stdout

    work = testbed.root / "work"
    workload = subprocess.run(train_argv(inv, "envfull-workload", "native", 2, 1, "shared", 4, []),
                              capture_output=True, text=True, env=env, cwd=work, timeout=600)
    assert workload.returncode == 0, (workload.stdout + workload.stderr)[-4000:]
    script = REPO / "docs" / "examples" / "train.py"
    own = subprocess.run(train_argv(inv, "envfull-own", "native", 2, 1, "node-local", 4, [
        str(script), "--", "--steps", "4", "--save-every", "100"]),
        capture_output=True, text=True, env=env, cwd=work, timeout=600)
    assert own.returncode == 0, (own.stdout + own.stderr)[-4000:]
    found = _env_findings(clusterkit_cli("doctor", "-i", str(inv), "--json", cwd=work, env=env))
    assert {h: f["status"] for h, f in found.items()} == {nodes[0]: "PASS", nodes[1]: "PASS"}
