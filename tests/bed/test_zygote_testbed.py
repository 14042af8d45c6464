"""The native launch's fork server (clusterkit/node/agent/zygote.py) on real namespace nodes.

The ranks it forks must see what ranks started with ``python -u script.py`` see
(environment, argv, ``__file__``, ``sys.path[0]``, cwd, torch's thread count), and
a teardown -- a rank killed, an agent killed -- must leave no process of the job.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import job_pids, kill9_then_wait, read_until, start_launch
from tests.testbed.core import Testbed

pytestmark = pytest.mark.testbed

# Names torch (the agent only starts a fork server for programs that do).
PROBE = textwrap.dedent("""
    import json, os, sys
    import torch
    def parent_cmd():
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace")
    info = {"argv": sys.argv, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
            "name": __name__, "env": dict(os.environ), "spec": repr(__spec__),
            "globals": sorted(k for k in globals() if not k.startswith("__")),
            "threads": torch.get_num_threads(), "forked": "clusterkit fork server" in parent_cmd(),
            "stdout": [sys.stdout.line_buffering, sys.stdout.write_through]}
    out = os.path.join(os.path.dirname(__file__), "out", sys.argv[1], f"rank{os.environ['RANK']}.json")
    with open(out, "w") as fh:
        json.dump(info, fh)
    print(f"probe done rank {os.environ['RANK']}", flush=True)
""")

SLEEPER = textwrap.dedent("""
    import os, time
    import torch
    print(f"ready rank {os.environ['RANK']} pid {os.getpid()}", flush=True)
    time.sleep(300)
""")


def _probe(tb: Testbed, tmp_path: Path, work: Path, env: dict[str, str], tag: str,
           job: str) -> dict[int, dict[str, Any]]:
    nodes = [n.name for n in tb.ensure(2)]
    inv = tb.write_inventory(tmp_path / "inv.yaml", nodes=nodes, slots=2)
    (work / "out" / tag).mkdir(parents=True)
    proc = start_launch(inv, job, ["--skip-checks", "--nodes", "2", "--gpus-per-node", "2",
                              str(work / "probe.py"), tag], env, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    found = {}
    for rank in range(4):
        data = json.loads((work / "out" / tag / f"rank{rank}.json").read_text())
        # Values that name the job (its id, its dirs, its port, its SSH session) differ
        # by design between two jobs.
        data["env"] = {k: v.replace(job, "JOB") for k, v in data["env"].items()
                       if k not in ("CLUSTERKIT_ZYGOTE", "MASTER_PORT", "SSH_CLIENT",
                                    "SSH_CONNECTION")}
        data["argv"] = [a.replace(tag, "TAG") for a in data["argv"]]
        found[rank] = data
    return found


def test_forked_ranks_see_what_exec_ranks_see(testbed: Testbed, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "probe.py").write_text(PROBE)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    env.pop("CLUSTERKIT_ZYGOTE", None)
    forked = _probe(testbed, tmp_path, work, env, "tagzf", "zy-forked")
    execd = _probe(testbed, tmp_path, work, dict(env, CLUSTERKIT_ZYGOTE="0"), "tagze", "zy-exec")
    for rank in range(4):
        f, e = forked[rank], execd[rank]
        assert f.pop("forked") and not e.pop("forked"), (rank, f, e)
        fe, ee = f.pop("env"), e.pop("env")
        assert fe == ee, (rank, {k: (fe.get(k), ee.get(k)) for k in {*fe, *ee}
                                 if fe.get(k) != ee.get(k)})
        assert f == e, (rank, {k: (f[k], e.get(k)) for k in f if f[k] != e.get(k)})
        f["env"] = fe
        assert f["argv"] == [str(work / "probe.py"), "TAG"] and f["file"] == f["argv"][0]
        assert f["env"]["RANK"] == str(rank) and f["path0"] == str(work)
        assert f["threads"] == int(f["env"]["OMP_NUM_THREADS"])


def test_teardown_leaves_no_process_of_a_forked_job(testbed: Testbed, tmp_path: Path) -> None:
    """A rank killed with SIGKILL: the job ends 137 and its ranks and zygotes are gone;
    then an agent killed with SIGKILL: its zygote takes its ranks with it."""
    nodes = [n.name for n in testbed.ensure(2)]
    work = tmp_path / "work"
    work.mkdir()
    (work / "sleeper.py").write_text(SLEEPER)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes=nodes, slots=2)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    env.pop("CLUSTERKIT_ZYGOTE", None)
    for how in ("rank", "agent"):
        job = f"zy-kill-{how}"
        proc = start_launch(inv, job, ["--skip-checks", "--nodes", "2", "--gpus-per-node", "2",
                                  str(work / "sleeper.py")], env, tmp_path)
        seen: list[str] = []
        try:
            read_until(proc, 4, "ready rank", 240, seen)
            text = "".join(seen)
            pids = job_pids(testbed, "node2", job)
            # 2 ranks + the zygote, all tagged with the job.
            assert len(pids) >= 3, (pids, text[-2000:])
            if how == "rank":
                victim = int(next(ln for ln in seen if "ready rank 3 " in ln).split()[-1])
            else:
                victim = _agent_pid(testbed, "node2", job)
        except BaseException:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
            raise
        kill9_then_wait(testbed, proc, "node2", victim, nodes, job, 15, seen)
        text = "".join(seen)
        assert proc.returncode != 0, text[-3000:]
        if how == "rank":
            assert proc.returncode == 137, text[-3000:]
            assert "node2 rank 3 failed first (killed by SIGKILL)" in text, text[-3000:]


def _agent_pid(tb: Testbed, node: str, job: str) -> int:
    """The agent of ``job`` on ``node``: the parent of the job's zygote."""
    for pid in job_pids(tb, node, job):
        res = tb.exec(node, ["cat", f"/proc/{pid}/cmdline", f"/proc/{pid}/stat"], timeout=30)
        if "clusterkit fork server" in res.stdout:
            return int(res.stdout.rsplit(")", 1)[1].split()[1])
    raise AssertionError(f"no zygote of {job} on {node}")


def test_an_unimportable_preload_falls_back_to_exec_with_a_note(
        testbed: Testbed, tmp_path: Path) -> None:
    nodes = [n.name for n in testbed.ensure(1)]
    work = tmp_path / "work"
    work.mkdir()
    (work / "probe.py").write_text(PROBE)
    (work / "out" / "fallback").mkdir(parents=True)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes=nodes, slots=2)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1",
               CLUSTERKIT_ZYGOTE_IMPORTS="torch,no_such_module_here")
    # One rank: the fallback is the node's (one note, one exec'd rank), and each exec'd
    # rank imports torch itself (~2.5 s of CPU; issue 37 item 6: 2 ranks before).
    proc = start_launch(inv, "zy-fallback", ["--skip-checks", "--nodes", "1", "--gpus-per-node", "1",
                                        str(work / "probe.py"), "fallback"], env, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert out.count("no fork server (import failed: ModuleNotFoundError") == 1, out[-3000:]
    data = json.loads((work / "out" / "fallback" / "rank0.json").read_text())
    assert not data["forked"]
