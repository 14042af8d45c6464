"""The native launch's fork server with local virtual nodes (no test bed, no torch).

The zygote preloads ``json`` here (``CLUSTERKIT_ZYGOTE_IMPORTS``) so the tests run
in seconds; the scripts name torch in a comment, which is what makes the agent use
the fork server. tests/bed/test_zygote_testbed.py does the same with torch on real nodes.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from clusterkit.launch.console import PlainSink
from clusterkit.launch.jobspec import JobSpec, NodeTask, zygote_imports
from clusterkit.launch.orchestrator import Orchestrator
from clusterkit.node.agent import zygote
from clusterkit.node.agent.procs import job_processes
from clusterkit.remote.base import SSHTarget
from clusterkit.remote.local import LocalTransport
from tests.testbed.sysutil import pids_mentioning

PROBE = textwrap.dedent("""
    # (uses torch: the agent's fork server applies)
    import gc, json, os, sys
    out = os.path.join(os.path.dirname(__file__), "out", os.environ["TAG"], os.environ["RANK"])
    with open(out, "w") as fh:
        json.dump({"argv": sys.argv, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
                   "env": dict(os.environ), "spec": repr(__spec__),
                   "globals": sorted(k for k in globals() if not k.startswith("__")),
                   "forked": "clusterkit fork server" in open(f"/proc/{os.getppid()}/cmdline").read(),
                   "parent": open(f"/proc/{os.getppid()}/cmdline").read(),
                   "cmdline": open("/proc/self/cmdline").read(),
                   "comm": open("/proc/self/comm").read().strip(),
                   "gc_frozen": gc.get_freeze_count() > 0,
                   # what a scan of /proc sees (agent_procs.rank_pids_of, a user's tools)
                   "proc_env": [e.split("=")[0] for e in
                                open("/proc/self/environ").read().split(chr(0))
                                if e.startswith(("RANK=", "LOCAL_RANK="))],
                   "parent_env": [e.split("=")[0] for e in
                                  open(f"/proc/{os.getppid()}/environ").read().split(chr(0))
                                  if e.startswith(("RANK=", "LOCAL_RANK="))]},
                  fh)
    if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
        def deep():
            raise ValueError("boom")
        deep()
    sys.exit(int(os.environ.get("EXIT", "0")))
""")


def _native_probe_job(tmp_path: Path, job_id: str, env: dict[str, str], nproc: int = 2) -> JobSpec:
    tasks = tuple(
        NodeTask(node=f"v{i}", target=SSHTarget(name=f"v{i}", address="127.0.0.1", local=True),
                 python=sys.executable, argv=(sys.executable, "-u", "probe.py", "x"),
                 rank_offset=i * nproc, nprocs=nproc, env=env, prefix="native",
                 job_dir=str(tmp_path / "jobs" / "@JOB@"), cwd=str(tmp_path),
                 native={"nproc": nproc, "first_rank": i * nproc, "world_size": 2 * nproc,
                         "node_rank": i, "nnodes": 2, "master_addr": "127.0.0.1",
                         "master_port": 29999})
        for i in range(2))
    return JobSpec(job_id=job_id, tasks=tasks, grace_s=1.0)


def _run_zygote_job(tmp_path: Path, job_id: str, nproc: int = 2,
         **env: str) -> tuple[Any, str, dict[int, dict[str, Any]]]:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "out" / job_id).mkdir(parents=True)
    out = io.StringIO()
    outcome = Orchestrator(_native_probe_job(tmp_path, job_id, {"TAG": job_id, **env}, nproc),
                           LocalTransport(),
                           PlainSink(out)).run(install_signals=False)
    found = {}
    for f in (tmp_path / "out" / job_id).iterdir():
        try:
            data = json.loads(f.read_text())
        except ValueError:
            continue  # a rank stopped by the teardown while it wrote (the failure tests)
        data["env"] = {k: v.replace(job_id, "JOB") for k, v in data["env"].items()
                       if k != "CLUSTERKIT_ZYGOTE"}
        found[int(f.name)] = data
    return outcome, out.getvalue(), found


# The two jobs' ids, which _run_zygote_job replaces by "JOB" in the ranks' environments
# to compare them: with a "-" they cannot occur inside a random temp name (a venv path
# /tmp/clusterkit-ci.qYJPze/ once held the exec'd job's old id "ze").
FORKED_JOB, EXEC_JOB = "zyg-forked", "zyg-exec"


@pytest.fixture()
def preload_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_ZYGOTE_IMPORTS", "json")
    monkeypatch.delenv("CLUSTERKIT_ZYGOTE", raising=False)


def test_forked_ranks_see_what_exec_ranks_see(tmp_path: Path, preload_json: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    oc_f, text_f, forked = _run_zygote_job(tmp_path, FORKED_JOB)
    monkeypatch.setenv("CLUSTERKIT_ZYGOTE", "0")
    oc_e, text_e, execd = _run_zygote_job(tmp_path, EXEC_JOB)
    assert oc_f.exit_code == 0 and oc_e.exit_code == 0, text_f + text_e
    assert sorted(forked) == sorted(execd) == [0, 1, 2, 3]
    for rank in range(4):
        f, e = forked[rank], execd[rank]
        assert f.pop("forked") and not e.pop("forked")
        # The preloaded objects are frozen before the fork (pre-fork server recipe).
        assert f.pop("gc_frozen") and not e.pop("gc_frozen")
        # Both show RANK + LOCAL_RANK in /proc/<pid>/environ; the fork server does not.
        assert sorted(f.pop("proc_env")) == sorted(e.pop("proc_env")) == ["LOCAL_RANK", "RANK"]
        assert f.pop("parent_env") == e.pop("parent_env") == []
        # ps shows each forked rank as the command an exec'd rank runs, and its rank
        # (issue 25); the zygote's own title names no program, its comm is its own.
        assert e.pop("cmdline") == f"{sys.executable}\0-u\0probe.py\0x\0"
        python = os.path.basename(sys.executable)
        assert f.pop("cmdline") == f"{python} probe.py x [clusterkit rank {rank}/4 job {FORKED_JOB}]\0"
        assert (f.pop("comm"), e.pop("comm")) == ("probe.py", os.path.basename(sys.executable))
        assert f.pop("parent") == f"[clusterkit fork server job {FORKED_JOB} node v{rank // 2}]\0"
        # An exec'd rank's parent is the agent: it shows as one too.
        assert e.pop("parent") == f"[clusterkit agent job {EXEC_JOB} node v{rank // 2}]\0"
        assert f == e, {k: (f[k], e[k]) for k in f if f[k] != e[k]}
        assert f["argv"] == ["probe.py", "x"] and f["path0"] == str(tmp_path)
        assert f["file"] == str(tmp_path / "probe.py") and f["env"]["RANK"] == str(rank)
    assert job_processes(FORKED_JOB) == {}


def test_with_one_rank_per_node_only_the_rank_shows_its_rank_in_proc(
        tmp_path: Path, preload_json: None) -> None:
    """Seen on the test bed (1 rank per node): every rank variable was "common" to the
    node's one rank, so the fork server's own environ showed RANK + LOCAL_RANK, and a
    scan for the rank's pid (agent_procs.rank_pids_of, a test's SIGSTOP) found the fork
    server instead of the rank."""
    outcome, text, found = _run_zygote_job(tmp_path, "zone", nproc=1)
    assert outcome.exit_code == 0 and sorted(found) == [0, 1], text
    for data in found.values():
        assert data["forked"], data
        assert sorted(data["proc_env"]) == ["LOCAL_RANK", "RANK"], data["proc_env"]
        assert data["parent_env"] == [], data["parent_env"]


USR1_PROBE = textwrap.dedent("""
    # (uses torch: the agent's fork server applies)
    import json, os, signal, time
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    parent = open(f"/proc/{os.getppid()}/cmdline").read()
    print("waiting", "forked" if "fork server" in parent else "exec", flush=True)
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    print("got USR1" if got else "no USR1", flush=True)
""")


def test_usr1_reaches_a_forked_rank_alone_on_its_node(tmp_path: Path, preload_json: None) -> None:
    """The agent forwards a preemption's USR1 to the processes that show RANK in
    /proc/<pid>/environ: with one rank per node that was the fork server too, whose
    default action for USR1 is to die (its ranks with it). Now only the rank gets it, and
    the fork server ignores USR1/USR2 whoever sends them (Slurm signals a whole step)."""
    (tmp_path / "probe.py").write_text(USR1_PROBE)
    out = io.StringIO()
    orch = Orchestrator(_native_probe_job(tmp_path, "zusr1", {}, nproc=1), LocalTransport(), PlainSink(out))
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(orch.run(install_signals=False)))
    thread.start()
    deadline = time.monotonic() + 30
    while out.getvalue().count("waiting forked") < 2:
        assert time.monotonic() < deadline and thread.is_alive(), out.getvalue()
        time.sleep(0.05)
    servers = pids_mentioning("[clusterkit fork server job zusr1 ")
    assert len(servers) == 2, servers
    for pid in servers:  # as Slurm's --signal does: every process of the step
        os.kill(pid, signal.SIGUSR1)
    orch._on_signal(signal.SIGUSR1, None)
    thread.join(30)
    text = out.getvalue()
    assert result and result[0].exit_code == 0, text
    assert "[v0 r0] got USR1" in text and "[v1 r1] got USR1" in text, text
    assert job_processes("zusr1") == {}


def test_the_fork_servers_env_leaves_out_what_names_a_rank() -> None:
    """agent_forkserver.server_env keeps out of the fork server's environment exactly
    what rank_env gives each rank on its own, on a one-rank node too."""
    from clusterkit.node.agent.env import rank_env
    from clusterkit.node.agent.forkserver import server_env
    from clusterkit.node.contract import ENV_HEARTBEAT, ENV_STACKS
    from clusterkit.node.protocol import AgentSpec

    for nproc in (1, 2):
        spec = AgentSpec(job_id="j", node="n", job_dir="/j", argv=["python", "x.py"],
                         local_ranks=nproc,
                         native={"nproc": nproc, "first_rank": 4, "world_size": 8,
                                 "node_rank": 2, "nnodes": 4, "master_addr": "a",
                                 "master_port": 1})

        def env(lr: int, spec: AgentSpec = spec) -> dict[str, str]:
            return rank_env(spec, "/j", "/p", lr)

        left_out = set(env(0)) - set(server_env(env, nproc))
        assert left_out == {"RANK", "LOCAL_RANK", "ROLE_RANK", ENV_HEARTBEAT, ENV_STACKS}


def test_a_failing_forked_rank_is_named_with_its_code_and_its_traceback(
        tmp_path: Path, preload_json: None) -> None:
    outcome, text, _ = _run_zygote_job(tmp_path, "zfail", FAIL_RANK="3")
    assert outcome.exit_code == 1, text
    assert (outcome.failure.node, outcome.failure.rank) == ("v1", 3), text
    assert 'probe.py", line' in text and "ValueError: boom" in text, text
    assert "<clusterkit.node.agent.zygote>" not in text, text  # the program's frames only
    assert job_processes("zfail") == {}


def test_exit_codes_per_rank(tmp_path: Path, preload_json: None) -> None:
    outcome, text, found = _run_zygote_job(tmp_path, "zexit", EXIT="3")
    assert outcome.exit_code == 3 and len(found) >= 1, text


def test_unimportable_preload_falls_back_to_exec_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_ZYGOTE_IMPORTS", "json,no_such_module_here")
    outcome, text, found = _run_zygote_job(tmp_path, "zfb")
    assert outcome.exit_code == 0, text
    assert text.count("no fork server (import failed: ModuleNotFoundError") == 2, text  # per node
    assert not any(d["forked"] for d in found.values())


def test_what_the_zygote_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLUSTERKIT_ZYGOTE", raising=False)
    monkeypatch.delenv("CLUSTERKIT_ZYGOTE_IMPORTS", raising=False)
    target = SSHTarget(name="n", address="127.0.0.1", local=True)
    task = NodeTask(node="n", target=target, python="python", rank_offset=0, nprocs=1,
                    argv=("python", "-u", "-m", "clusterkit.workload"), native={"nproc": 1})
    assert zygote_imports(task) == ["torch", "torch.distributed", "torch._dynamo",
                                    "clusterkit.workload.main"]
    assert zygote_imports(task, {"CLUSTERKIT_ZYGOTE": "0"}) == []
    assert zygote_imports(task, {"CLUSTERKIT_ZYGOTE_IMPORTS": "torch, deepspeed"}) == \
        ["torch", "deepspeed"]
    torchrun = NodeTask(node="n", target=target, python="python", argv=("x",), rank_offset=0,
                        nprocs=1)
    assert zygote_imports(torchrun) == []


def test_argv_forms_and_the_script_scan(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import os\n")
    assert zygote.parse_argv(["py", "-u", str(script), "a"]) == ("script", str(script), ["a"])
    assert zygote.parse_argv(["py", "-u", "-m", "pkg.mod", "a"]) == ("module", "pkg.mod", ["a"])
    assert zygote.parse_argv(["py", str(script)]) is None  # not the native plan's form
    assert zygote.parse_argv(["py", "-u", "-c", "pass"]) is None
    assert zygote.parse_argv(["py", "-u", "s.py"], str(tmp_path)) is not None
    assert not zygote.worth_it("script", str(script))
    script.write_text("import torch.distributed as dist\n")
    assert zygote.worth_it("script", str(script)) and zygote.worth_it("module", "x")
    assert os.path.isabs(zygote.path0("module", "x"))


def test_ranks_with_several_cpus_are_still_forked(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # numpy's OpenBLAS (torch imports numpy) started OMP_NUM_THREADS - 1 threads at load:
    # with 2 CPUs per rank every node fell back to exec (bench/launch.py at 32 x 1).
    pytest.importorskip("numpy")
    monkeypatch.setenv("CLUSTERKIT_ZYGOTE_IMPORTS", "numpy")
    monkeypatch.delenv("CLUSTERKIT_ZYGOTE", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    outcome, text, found = _run_zygote_job(tmp_path, "zomp", OMP_NUM_THREADS="2")
    assert outcome.exit_code == 0 and "no fork server" not in text, text
    assert sorted(found) == [0, 1, 2, 3] and all(d["forked"] for d in found.values()), text
    # The loader's setting stays in the zygote: each rank's env is its own.
    assert all("OPENBLAS_NUM_THREADS" not in d["env"] for d in found.values())
    assert all(d["env"]["OMP_NUM_THREADS"] == "2" for d in found.values())


def test_titles_keep_the_rank_visible_and_fit_the_kernel_names() -> None:
    title = zygote.rank_title(["/v/bin/python3", "-u", "/w/train.py", "--lr", "3e-4"], 3, 14, "J")
    assert title == "python3 train.py --lr 3e-4 [clusterkit rank 3/14 job J]"
    assert zygote.rank_title(["py", "-u", "-m", "pkg.mod", "a"], 0, 2, "J") == \
        "py -m pkg.mod a [clusterkit rank 0/2 job J]"
    long = zygote.rank_title(["python3", "-u", "train.py", "x" * 20000], 0, 2, "J")
    assert len(long.encode()) <= zygote.TITLE_MAX and long.endswith("... [clusterkit rank 0/2 job J]")
    assert zygote.server_title("J", "n1") == "[clusterkit fork server job J node n1]"
    assert zygote.comm_name("script", "/w/train.py") == "train.py"
    assert zygote.comm_name("module", "clusterkit.workload") == "workload"
    assert zygote.comm_name("script", "a_very_long_script_name.py") == "a_very_long_scr"


SET_TITLE = textwrap.dedent("""
    import subprocess, sys
    sys.path.insert(0, sys.argv[1])
    from clusterkit.node.agent import zygote
    ok = zygote.set_title(__import__("os").environ["TITLE"], "train.py")
    ps = subprocess.run(["ps", "-o", "comm=,args=", "-p", str(__import__("os").getpid())],
                        capture_output=True, text=True).stdout
    print(repr((ok, open("/proc/self/cmdline", "rb").read(), ps.strip(), sys.argv[1:])))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux /proc only")
def test_set_title_rewrites_cmdline_and_comm_and_cuts_what_does_not_fit() -> None:
    import ast
    import subprocess

    root = str(Path(zygote.__file__).parent.parent.parent)
    for title, pad in (("python3 train.py --lr 3e-4 [clusterkit rank 1/2 job J]", "." * 60),
                       ("x" * 5000, "")):
        res = subprocess.run([sys.executable, "-c", SET_TITLE, root, pad], capture_output=True,
                             text=True, timeout=60, check=True, env=dict(os.environ, TITLE=title))
        ok, cmdline, ps, argv = ast.literal_eval(res.stdout.strip())
        assert ok and argv == [root, pad]  # sys.argv is Python's own copy
        if pad:  # the area holds it: one title, one NUL, nothing after it
            assert cmdline == title.encode() + b"\0" and ps == f"train.py        {title}"
        else:  # cut to the area (the script's own argv here), never past it
            assert cmdline.startswith(b"xxx") and cmdline.endswith(b"\0")
            assert len(cmdline) < len(title) and set(cmdline[:-1]) == {ord("x")}


def test_the_fork_servers_fallback_grace_is_the_protocols() -> None:
    """The zygote imports nothing of clusterkit, so it spells the default grace again."""
    from clusterkit.node import protocol
    from clusterkit.node.agent import zygote
    assert zygote.DEFAULT_GRACE_S == protocol.DEFAULT_GRACE_S


def test_a_forked_rank_reads_as_killed_only_after_the_zygotes_last_status() -> None:
    """The zygote reported a rank's exit and ended; until that status line is applied the
    rank is not "killed with the zygote" (a CI-like run at load ~9 saw exit 0 read as
    SIGKILL: the zygote gone, the rank gone, its exit line still in the pipe)."""
    import subprocess
    import threading

    from clusterkit.node.agent.forkserver import ForkedRank

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # reaped: its /proc entry is gone, as a rank's after the zygote reaped it
    server = subprocess.Popen([sys.executable, "-c", "pass"])
    server.wait()
    read = threading.Event()
    rank = ForkedRank(done.pid, server, read)
    assert rank.poll() is None  # its status may still be on the way
    rank.returncode = 0  # the zygote's exit line, applied
    read.set()
    assert rank.poll() == 0
    lost = ForkedRank(done.pid, server, read)
    assert lost.poll() == -signal.SIGKILL  # the pipe ended and nothing said it exited
