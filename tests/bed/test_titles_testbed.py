"""Findable processes (issue 25 item 5) on real namespace nodes.

During a job, ``ps -eo args`` on a node shows the user's script for each of that
node's ranks -- forked by the native launcher's fork server (their title names the
rank and the job) or started by torchrun -- and nothing else of the job names it;
``clusterkit status JOB`` lists each node's rank pids (the pids ``ps`` shows there),
the fork server's or the launcher's pid, and the launcher the job was started with.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import read_until, start_launch
from tests.testbed.core import Testbed

pytestmark = pytest.mark.testbed

# Names torch: the native launcher's agents fork its ranks from a fork server (one
# ``import torch`` per node). Under torchrun nothing depends on the ranks' imports (no
# fork server; torchrun's own command line names the script either way), so there the
# script does not import torch: 4 imports of torch fewer (~2.5 s of CPU each; issue 37
# item 6).
TRAIN = textwrap.dedent("""
    import os, time
    import torch
    print(f"ready rank {os.environ['RANK']} pid {os.getpid()}", flush=True)
    time.sleep(300)
""")
TRAIN_NO_TORCH = TRAIN.replace("import torch\n", "")


# torchrun is extended (~8 s of the suite's 2 cores): status finds its ranks by the same
# job tag as the fork server's, and torchrun-launched ranks on the bed run by default in
# tests/bed/test_programs_testbed.py (the launch's default launcher).
@pytest.mark.slow  # ~10-45 s a launcher
@pytest.mark.parametrize("launcher", ["native", pytest.param("torchrun",
                                                             marks=pytest.mark.extended)])
def test_ps_shows_train_py_for_every_rank_and_status_lists_their_pids(
        testbed: Testbed, tmp_path: Path, launcher: str) -> None:
    nodes = [n.name for n in testbed.ensure(2)]
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(TRAIN if launcher == "native" else TRAIN_NO_TORCH)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes=nodes, slots=2)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    env.pop("CLUSTERKIT_ZYGOTE", None)
    env.pop("CLUSTERKIT_ZYGOTE_IMPORTS", None)
    job = f"titles-{launcher}"
    proc = start_launch(inv, job, ["--skip-checks", "--launcher", launcher, "--nodes", "2",
                              str(work / "train.py"), "--lr", "3e-4"], env, tmp_path)
    seen: list[str] = []
    try:
        read_until(proc, 4, "ready rank", 240, seen)
        # rank -> pid as each rank saw itself (in its node's PID namespace)
        pids = {int(m.group(1)): int(m.group(2)) for line in seen
                for m in [re.search(r"ready rank (\d+) pid (\d+)", line)] if m}
        ck = [sys.executable, "-m", "clusterkit"]
        status = subprocess.run([*ck, "status", job], capture_output=True, text=True, env=env,
                                timeout=60)
        as_json = subprocess.run([*ck, "status", job, "--json"], capture_output=True,
                                 text=True, env=env, timeout=60)
        # As a user types it: ps cuts lines at 80 columns here (no terminal), which the
        # fork server's titles fit; torchrun's ranks show their full paths (-ww).
        ps = ["ps", "-eo", "pid=,args="] if launcher == "native" else \
            ["ps", "-ww", "-eo", "pid=,args="]
        shown = {node: testbed.exec(node, ps, timeout=30).stdout for node in nodes}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    text = "".join(seen)
    assert sorted(pids) == [0, 1, 2, 3], text[-3000:]
    launcher_pids: dict[str, int] = {}
    python = os.path.basename(testbed.node_python())
    for i, node in enumerate(nodes):
        mine = {r: pids[r] for r in (2 * i, 2 * i + 1)}
        lines = [ln.strip() for ln in shown[node].splitlines() if "train.py" in ln]
        found = {int(ln.split(None, 1)[0]): ln.split(None, 1)[1] for ln in lines}
        # This node's ranks name the script; so does torchrun's own command line (the
        # script is its argument), not the fork server's.
        extra = {pid: line for pid, line in found.items() if pid not in mine.values()}
        assert set(found) >= set(mine.values()), (node, mine, shown[node])
        if launcher == "native":
            assert not extra, shown[node]
        else:
            assert len(extra) == 1 and "torch.distributed.run" in next(iter(extra.values()))
            launcher_pids[node] = next(iter(extra))
        for rank, pid in mine.items():
            assert "train.py --lr 3e-4" in found[pid], found[pid]
            if launcher == "native":
                assert found[pid] == (f"{python} train.py --lr 3e-4 "
                                      f"[clusterkit rank {rank}/4 job {job}]")
        if launcher == "native":
            assert f"[clusterkit fork server job {job} node {node}]" in shown[node], shown[node]
        assert f"[clusterkit agent job {job} node {node}]" in shown[node], shown[node]
    assert status.returncode == 0, status.stderr
    assert f"launcher {launcher}" in status.stdout.splitlines()[0], status.stdout
    for i, node in enumerate(nodes):
        want = f"ranks {2 * i},{2 * i + 1} (pids {pids[2 * i]},{pids[2 * i + 1]})"
        row = next(ln for ln in status.stdout.splitlines() if ln.strip().startswith(node))
        assert want in row, status.stdout
        assert ("fork server pid" if launcher == "native" else
                f"launcher pid {launcher_pids[node]}") in row, row
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["launcher"] == launcher
    assert {r: p for info in data["nodes"].values() for r, p in info["pids"].items()} == \
        {str(r): p for r, p in pids.items()}
