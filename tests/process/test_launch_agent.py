"""The node agent and the orchestrator against LocalTransport with fake "rank" scripts.

No torch: each fake rank is a plain Python process that prints progress lines,
and can kill itself, ignore SIGTERM, or leave a worker in another session —
enough to prove the teardown, the failure report and the signal forwarding.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterkit.launch.console import PlainSink, Progress
from clusterkit.launch.jobspec import JobSpec, NodeTask
from clusterkit.launch.orchestrator import Orchestrator
from clusterkit.launch.outcome import exit_status
from clusterkit.node import protocol
from clusterkit.node.agent import core as agent_mod
from clusterkit.node.agent.env import omp_threads
from clusterkit.node.agent.output import RankLogTail
from clusterkit.node.agent.procs import job_processes, job_status, rank_pids_of, sweep
from clusterkit.node.agent.state import State
from clusterkit.node.protocol import AgentSpec
from clusterkit.remote.base import SSHTarget
from clusterkit.remote.local import LocalTransport
from clusterkit.ship import agent_command
from tests.polling import wait_for

FAKE_RANK = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    rank = int(os.environ["RANK"])
    mode = os.environ.get("FAKE_MODE", "ok")
    steps = int(os.environ.get("FAKE_STEPS", "4"))
    def on_usr1(*_):
        print(f"rank {rank} got USR1", flush=True)
    signal.signal(signal.SIGUSR1, on_usr1)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "orphan":
        # a worker in its own session: only the environ tag finds it
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         start_new_session=True)
    print(f"ready {os.getpid()}", flush=True)
    for step in range(steps):
        print(f"step {step + 1}/{steps} | loss {1.0 / (step + 1):.4f} | 1,000 tok/s", flush=True)
        time.sleep(0.1)
        if mode == "die" and rank == int(os.environ.get("FAKE_DIE_RANK", "1")) and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        print('CLUSTERKIT_SUMMARY {"final_loss": 0.25, "steps": 4}', flush=True)
""")


@pytest.fixture()
def fake(tmp_path: Path) -> Path:
    path = tmp_path / "fake_rank.py"
    path.write_text(FAKE_RANK)
    return path


def _fake_rank_job(tmp_path: Path, fake: Path, n: int, job_id: str, **env: str) -> JobSpec:
    tasks = tuple(
        NodeTask(
            node=f"v{i}", target=SSHTarget(name=f"v{i}", address="127.0.0.1", local=True),
            python=sys.executable, argv=(sys.executable, str(fake)), rank_offset=i, nprocs=1,
            env={"RANK": str(i), "LOCAL_RANK": "0", "WORLD_SIZE": str(n), **env},
            files={"hostfile": "v0 slots=1\n"}, prefix="single",
            job_dir=str(tmp_path / "jobs" / "@JOB@"),
        )
        for i in range(n)
    )
    return JobSpec(job_id=job_id, tasks=tasks, grace_s=1.0)


def _orchestrate(job: JobSpec) -> tuple[object, str]:
    out = io.StringIO()
    outcome = Orchestrator(job, LocalTransport(), PlainSink(out)).run(install_signals=False)
    return outcome, out.getvalue()


@pytest.fixture()
def local_bystanders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Another job's process, and one whose command line matches DeepSpeed's pkill pattern."""
    other = dict(os.environ, CLUSTERKIT_JOB_ID="someone-elses-job")
    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=other),
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                          "deepspeed.launcher.launch", "--world_info=e30="]),
    ]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_job_runs_to_completion_with_prefixed_lines_logs_and_files(tmp_path: Path, fake: Path) -> None:
    outcome, text = _orchestrate(_fake_rank_job(tmp_path, fake, 3, "ok-job"))
    assert outcome.exit_code == 0, text  # type: ignore[attr-defined]
    assert outcome.summary == {"final_loss": 0.25, "steps": 4}  # type: ignore[attr-defined]
    assert "[v2 r2] step 4/4 | loss 0.2500 | 1,000 tok/s" in text
    job_dir = tmp_path / "jobs" / "ok-job"
    assert (job_dir / "hostfile").read_text() == "v0 slots=1\n"
    assert "step 4/4" in (job_dir / "nodes" / "v1" / "rank1.log").read_text()
    state = json.loads((job_dir / "nodes" / "v1" / "agent.json").read_text())
    assert state["state"] == "exited" and state["exit_code"] == 0


def test_killed_rank_tears_down_every_node_but_not_other_jobs(
        tmp_path: Path, fake: Path, local_bystanders: list[subprocess.Popen[bytes]]) -> None:
    job = _fake_rank_job(tmp_path, fake, 3, "die-job", FAKE_MODE="die", FAKE_STEPS="600", FAKE_DIE_RANK="1")
    started = time.monotonic()
    outcome, text = _orchestrate(job)
    assert time.monotonic() - started < 10
    assert outcome.exit_code == 137, text  # type: ignore[attr-defined]
    failure = outcome.failure  # type: ignore[attr-defined]
    assert failure is not None and failure.node == "v1" and failure.rank == 1
    assert "v1 rank 1 failed (exit code 137)" in text
    assert any("step 2/600" in line for line in failure.tail)
    assert job_processes("die-job") == {}
    assert all(p.poll() is None for p in local_bystanders)


def test_stubborn_rank_is_killed_after_the_grace_period(tmp_path: Path, fake: Path) -> None:
    job = _fake_rank_job(tmp_path, fake, 2, "stubborn-job", FAKE_MODE="stubborn", FAKE_STEPS="600")
    holder: dict[str, object] = {}
    orch = Orchestrator(job, LocalTransport(), PlainSink(io.StringIO()))
    thread = threading.Thread(target=lambda: holder.update(out=orch.run(install_signals=False)))
    thread.start()
    wait_for(lambda: len(job_processes("stubborn-job")) == 2)
    orch._on_signal(signal.SIGINT, None)  # what Ctrl-C does
    thread.join(15)
    assert not thread.is_alive()
    assert holder["out"].exit_code == 130  # type: ignore[attr-defined]
    assert job_processes("stubborn-job") == {}


def test_usr1_reaches_every_rank(tmp_path: Path, fake: Path) -> None:
    # 60 s of steps: room for the signal to reach both ranks on a loaded machine; the job
    # is stopped as soon as both said so (it used to run its 10 s of steps out).
    job = _fake_rank_job(tmp_path, fake, 2, "usr1-job", FAKE_STEPS="600")
    out = io.StringIO()
    orch = Orchestrator(job, LocalTransport(), PlainSink(out))
    thread = threading.Thread(target=orch.run, kwargs={"install_signals": False})
    thread.start()
    try:
        # Every rank past step 3 (so each has installed its handler), not just the first one.
        wait_for(lambda: all(f"[v{r} r{r}] step 3/600" in out.getvalue() for r in (0, 1)))
        orch._on_signal(signal.SIGUSR1, None)
        wait_for(lambda: all(f"[v{r} r{r}] rank {r} got USR1" in out.getvalue() for r in (0, 1)),
                 timeout=40)
    finally:
        orch._on_signal(signal.SIGINT, None)  # what Ctrl-C does: the job's teardown
        thread.join(40)
    assert not thread.is_alive()
    assert "[v0 r0] rank 0 got USR1" in out.getvalue()
    assert "[v1 r1] rank 1 got USR1" in out.getvalue()


def test_agent_tears_down_on_stdin_eof_including_workers_in_other_sessions(
        tmp_path: Path, fake: Path) -> None:
    spec = AgentSpec(job_id="eof-job", node="n1", job_dir=str(tmp_path / "j"),
                     argv=[sys.executable, str(fake)], prefix="single", grace_s=1.0,
                     env={"RANK": "0", "FAKE_MODE": "orphan", "FAKE_STEPS": "600"})
    cmd = agent_command(sys.executable, spec=spec)  # shipped as on a node: sources on stdin
    proc = subprocess.Popen(cmd.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.buffer.write(cmd.stdin)
    proc.stdin.flush()
    for line in proc.stdout:
        if "step 1/600" in line:
            break
    assert len(job_processes("eof-job")) == 2  # the rank and its orphan worker
    proc.stdin.close()  # what a dropped SSH connection looks like to the agent
    rest = proc.stdout.read()
    assert proc.wait(10) == 143  # the fake rank died of SIGTERM
    assert '"reason": "stdin-eof"' in rest
    assert job_processes("eof-job") == {}


def test_stop_mode_kills_only_the_named_job(local_bystanders: list[subprocess.Popen[bytes]]) -> None:
    env = dict(os.environ, CLUSTERKIT_JOB_ID="stop-me")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                              start_new_session=True)
    wait_for(lambda: victim.pid in job_processes("stop-me"))
    cmd = agent_command(sys.executable, ["--stop", "stop-me", "--grace", "1"])
    res = subprocess.run(cmd.argv, input=cmd.stdin, capture_output=True, timeout=20)
    assert json.loads(res.stdout) == {"signalled": 1, "killed": 0, "left": 0}
    assert victim.wait(5) == -signal.SIGTERM
    assert all(p.poll() is None for p in local_bystanders)


def _lines_out(spec: AgentSpec, tmp_path: Path, *lines: str) -> tuple[agent_mod.Agent, list[object]]:
    """The messages an agent sends for its launcher's output ``lines``."""
    out = io.StringIO()
    a = agent_mod.Agent(dataclasses.replace(spec, job_dir=str(tmp_path)), out)
    a.prepare()
    for text in lines:
        a.output.handle_line(text)
    return a, [protocol.decode(ln) for ln in out.getvalue().splitlines()]


def test_agent_classifies_torchrun_and_pdsh_lines(tmp_path: Path) -> None:
    spec = AgentSpec(job_id="j", node="node1", job_dir="", rank_offsets={"node1": 0, "node5": 8})
    # torchrun printed a half-written line in two parts, the header twice (a summary: cut JSON)
    _, msgs = _lines_out(spec, tmp_path, "[default1]:step 3", '[default0]:{"a": 1, [default0]:"b": 2}',
                         "plain launcher line")
    assert msgs == [protocol.Line("node1", 1, "step 3"), protocol.Line("node1", 0, '{"a": 1, "b": 2}'),
                    protocol.Line("node1", None, "plain launcher line")]
    pdsh = dataclasses.replace(spec, prefix="pdsh")
    _, msgs = _lines_out(pdsh, tmp_path, "node5: hello", "node5: [default1]:x", "unknown: x")
    assert msgs == [protocol.Line("node5", None, "hello"), protocol.Line("node5", 1, "x"),
                    protocol.Line("node1", None, "unknown: x")]


def test_agent_names_the_failed_rank_from_launcher_reports(tmp_path: Path) -> None:
    spec = AgentSpec(job_id="j", node="node1", job_dir="", rank_offsets={"node1": 0, "node5": 8})
    _, msgs = _lines_out(spec, tmp_path, "E1121 api.py:1002] failed (exitcode: -9) local_rank: 1 "
                                         "(pid: 20825) of binary")
    failed = [m for m in msgs if isinstance(m, protocol.RankFailed)]
    assert [(f.rank, f.code) for f in failed] == [(1, -9)]
    _, msgs = _lines_out(dataclasses.replace(spec, prefix="pdsh"), tmp_path,
                         "node5: ['/usr/bin/python', '-u', 'x.py', '--local_rank=1'] "
                         "exits with return code = -9")
    failed = [m for m in msgs if isinstance(m, protocol.RankFailed)]
    assert [(f.failed_node, f.rank, f.code) for f in failed] == [("node5", 9, -9)]
    c, msgs = _lines_out(spec, tmp_path, "pdsh@node1: node5: ssh exited with exit code 1")
    assert c.stop_reason == "pdsh-node-failed" and c.state is State.STOPPING
    assert [m.failed_node for m in msgs if isinstance(m, protocol.RankFailed)] == ["node5"]


def test_a_go_after_a_stop_starts_nothing(tmp_path: Path) -> None:
    """Issue 30: TERM while the agent holds, then a late GO: the stop wins."""
    spec = AgentSpec(job_id="go-after-stop", node="node1", job_dir=str(tmp_path), hold=True)
    a = agent_mod.Agent(spec, io.StringIO())
    a.read_control(io.StringIO("TERM\nGO\n"))
    assert a.hold_for_go() is False and a.state is State.STOPPING and a.stop_reason == "term"
    out = io.StringIO()
    b = agent_mod.Agent(spec, out)  # the whole run: held, stopped, nothing started
    threading.Thread(target=b.read_control, args=(io.StringIO("TERM\nGO\n"),)).start()
    assert b.run() == 0 and b.state is State.EXITED and b.child is None and not b.ranks
    exit_msg = protocol.decode(out.getvalue().splitlines()[-1])
    assert isinstance(exit_msg, protocol.Exit) and exit_msg.held
    b.request_stop("late")  # after the exit: nothing moves
    assert b.state is State.EXITED and b.stop_reason == "term"


def test_the_agents_moves(tmp_path: Path) -> None:
    """GO moves a holding agent to running; a stop moves it to stopping, keeps the first
    reason, and nothing moves it back."""
    a = agent_mod.Agent(AgentSpec(job_id="moves-job", node="n", job_dir=str(tmp_path),
                                  hold=True), io.StringIO())
    assert a.state is State.HOLDING
    a.read_control(io.StringIO("GO\nTERM\nGO\n"))  # EOF last: one more stop request
    assert a.state is State.STOPPING and a.stop_reason == "term"


def test_progress_parses_the_workload_line() -> None:
    p = Progress()
    assert p.update("[clusterkit] step 10/50 | loss 5.1234 | lr 1.000e-03 | 12,345 tok/s | 3.0 samples/s")
    assert (p.step, p.loss, p.toks) == ("10/50", "5.1234", "12,345")


def test_exit_status_maps_signals_like_a_shell() -> None:
    assert exit_status(-9) == 137 and exit_status(3) == 3 and exit_status(0) == 0


def test_watch_only_agents_exit_when_every_launcher_is_done(tmp_path: Path, fake: Path) -> None:
    base = _fake_rank_job(tmp_path, fake, 2, "watch-job")
    watcher = dataclasses.replace(base.tasks[1], argv=(), env={})
    job = dataclasses.replace(base, tasks=(base.tasks[0], watcher))
    outcome, text = _orchestrate(job)
    assert outcome.exit_code == 0, text  # type: ignore[attr-defined]
    assert outcome.node_codes == {"v0": 0, "v1": 0}  # type: ignore[attr-defined]


def _native_job(tmp_path: Path, fake: Path, nodes: int, nproc: int, job_id: str,
                **env: str) -> JobSpec:
    world = nodes * nproc
    tasks = tuple(
        NodeTask(
            node=f"v{i}", target=SSHTarget(name=f"v{i}", address="127.0.0.1", local=True),
            python=sys.executable, argv=(sys.executable, str(fake)), rank_offset=i * nproc,
            nprocs=nproc, env=env, prefix="native", job_dir=str(tmp_path / "jobs" / "@JOB@"),
            native={"nproc": nproc, "first_rank": i * nproc, "world_size": world, "node_rank": i,
                    "nnodes": nodes, "master_addr": "127.0.0.1", "master_port": 29999},
        )
        for i in range(nodes)
    )
    return JobSpec(job_id=job_id, tasks=tasks, grace_s=1.0)


def test_native_mode_starts_each_rank_with_torchruns_environment(tmp_path: Path) -> None:
    script = tmp_path / "env_rank.py"
    script.write_text(
        "import os\nkeys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK',"
        " 'MASTER_ADDR', 'MASTER_PORT', 'OMP_NUM_THREADS')\n"
        "print(' '.join(f'{k}={os.environ.get(k)}' for k in keys))\n"
        "print('elastic', any(k.startswith('TORCHELASTIC') for k in os.environ))\n")
    outcome, text = _orchestrate(_native_job(tmp_path, script, 2, 2, "native-env"))
    assert outcome.exit_code == 0, text  # type: ignore[attr-defined]
    assert ("[v1 r3] RANK=3 LOCAL_RANK=1 WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 "
            "MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 "
            f"OMP_NUM_THREADS={omp_threads(2)}") in text  # CPUs / 2 ranks
    assert "[v0 r0] elastic False" in text


def test_per_node_launcher_gets_the_thread_rule_unless_the_inventory_sets_it(
        tmp_path: Path) -> None:
    """torchrun/accelerate keep an OMP_NUM_THREADS they find (their default is a fixed 1):
    the agent gives their child the node's CPUs / its ranks, an env value still wins."""
    script = tmp_path / "omp.py"
    script.write_text("import os\nprint('omp', os.environ.get('OMP_NUM_THREADS'))\n")
    job = _fake_rank_job(tmp_path, script, 2, "omp-rule")
    job = dataclasses.replace(job, tasks=(
        dataclasses.replace(job.tasks[0], nprocs=2),
        dataclasses.replace(job.tasks[1], nprocs=2, env={**job.tasks[1].env, "OMP_NUM_THREADS": "7"}),
    ))
    outcome, text = _orchestrate(job)
    assert outcome.exit_code == 0, text  # type: ignore[attr-defined]
    assert f"omp {omp_threads(2)}" in text and "omp 7" in text, text


def test_native_mode_killed_rank_stops_the_job_and_is_named(
        tmp_path: Path, fake: Path, local_bystanders: list[subprocess.Popen[bytes]]) -> None:
    job = _native_job(tmp_path, fake, 2, 2, "native-die", FAKE_MODE="die", FAKE_STEPS="600",
                      FAKE_DIE_RANK="3")
    started = time.monotonic()
    outcome, text = _orchestrate(job)
    assert time.monotonic() - started < 10
    assert outcome.exit_code == 137, text  # type: ignore[attr-defined]
    failure = outcome.failure  # type: ignore[attr-defined]
    assert (failure.node, failure.rank, failure.local_rank) == ("v1", 3, 1), text
    assert job_processes("native-die") == {}
    assert all(p.poll() is None for p in local_bystanders)


def test_native_mode_forwards_usr1_to_the_ranks(tmp_path: Path, fake: Path) -> None:
    job = _native_job(tmp_path, fake, 1, 2, "native-usr1", FAKE_STEPS="30")
    out = io.StringIO()
    orch = Orchestrator(job, LocalTransport(), PlainSink(out))
    thread = threading.Thread(target=orch.run, kwargs={"install_signals": False})
    thread.start()
    wait_for(lambda: "[v0 r1] step 3/30" in out.getvalue())
    orch._on_signal(signal.SIGUSR1, None)
    thread.join(20)
    assert "[v0 r0] rank 0 got USR1" in out.getvalue() and "[v0 r1] rank 1 got USR1" in out.getvalue()


def test_rank_log_tail_reads_deepspeeds_per_rank_files_as_lines(tmp_path: Path) -> None:
    tail = RankLogTail(str(tmp_path))
    assert tail.poll() == []
    f = tmp_path / "20261121120000_rank5.log"
    f.write_text("one\ntw")
    (tmp_path / "other.txt").write_text("ignored\n")
    assert tail.poll() == [(5, "one")]
    with f.open("a") as fh:
        fh.write("o\nthree")
    assert tail.poll() == [(5, "two")]
    assert tail.poll(final=True) == [(5, "three")]
    tail.close()


def test_agent_labels_deepspeed_rank_files_of_its_own_node_only(tmp_path: Path) -> None:
    out = io.StringIO()
    spec = AgentSpec(job_id="j", node="node2", job_dir=str(tmp_path),
                     rank_offsets={"node1": 0, "node2": 2, "node3": 4},
                     rank_log_dir=str(tmp_path / "logs"))
    (tmp_path / "logs").mkdir()
    for r in range(6):  # a shared job dir: every node's files in one directory
        (tmp_path / "logs" / f"1_rank{r}.log").write_text(f"hello from {r}\n")
    a = agent_mod.Agent(spec, out)
    a.prepare()
    a.output.tail_done.set()  # the ranks are gone: read what is there, then stop
    a.tail_rank_logs()
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("@ck:L ")]
    assert lines == ["@ck:L node2 0 hello from 2", "@ck:L node2 1 hello from 3"]


def test_deepspeed_and_accelerate_argv_get_rank_labels() -> None:
    from clusterkit.launch.fromplan import job_from_plan
    from clusterkit.render.artifacts import render_all
    from tests.render_cases import plan_for

    # The run id is a render input: the rendered argv is what runs, nothing rewrites it.
    plan = render_all(plan_for("a800-7x2", "deepspeed"), run_id="r1")
    ds = job_from_plan(plan)
    head = ds.tasks[0]
    assert head.argv == plan.launch_commands[0].argv
    assert f"--enable_each_rank_log={head.job_dir}/ranklogs/r1" in head.argv
    assert all(t.rank_log_dir == f"{head.job_dir}/ranklogs/r1" for t in ds.tasks)
    assert "ranklogs/r1" in plan.artifacts["commands.sh"]
    # rendered for a person (render, sbatch): DeepSpeed's logs in <job dir>/logs
    assert plan_for("a800-7x2", "deepspeed").rank_log_dir == f"{head.job_dir}/logs"
    acc = job_from_plan(plan_for("a800-7x2", "accelerate")).tasks[3].argv
    at = acc.index("accelerate.commands.launch")
    assert acc[at + 1:at + 3] == ("--tee", "3")
    native = job_from_plan(plan_for("a800-7x2", "torchrun"), native=True).tasks[1]
    assert native.native is not None and native.native["first_rank"] == 2
    assert native.argv[1:4] == ("-u", "-m", "clusterkit.workload")


def test_folded_gate_holds_every_agent_until_all_nodes_agree(tmp_path: Path, fake: Path) -> None:
    job = dataclasses.replace(_fake_rank_job(tmp_path, fake, 2, "gate-ok"), gate_need=())
    outcome, text = _orchestrate(job)
    assert outcome.exit_code == 0, text  # type: ignore[attr-defined]
    gate = outcome.gate  # type: ignore[attr-defined]
    assert gate is not None and gate.ok and gate.facts["v1"]["python"] == sys.executable


def test_folded_gate_failure_starts_nothing_anywhere(tmp_path: Path, fake: Path) -> None:
    base = _fake_rank_job(tmp_path, fake, 2, "gate-bad", FAKE_STEPS="600")
    broken = dataclasses.replace(base.tasks[1], python=str(tmp_path / "no-such-python"))
    job = dataclasses.replace(base, tasks=(base.tasks[0], broken), gate_need=())
    started = time.monotonic()
    outcome, text = _orchestrate(job)
    assert time.monotonic() - started < 15
    assert outcome.exit_code == 2, text  # type: ignore[attr-defined]
    gate = outcome.gate  # type: ignore[attr-defined]
    assert gate is not None and list(gate.problems) == ["v1"], gate
    assert "ready" not in text and "step 1/600" not in text  # v0 never started its rank
    assert job_processes("gate-bad") == {}


def test_folded_gate_names_a_script_missing_on_a_node(tmp_path: Path, fake: Path) -> None:
    """Seen as a user: a script only on the launching host (no --sync, no shared dir) let
    every rank die of Python's "can't open file"; the gate names it before anything starts."""
    base = _fake_rank_job(tmp_path, fake, 2, "gate-script", FAKE_STEPS="600")
    gone = str(tmp_path / "proj" / "train.py")
    lacking = dataclasses.replace(base.tasks[1], needs=(gone,))
    job = dataclasses.replace(base, tasks=(dataclasses.replace(base.tasks[0], needs=(str(fake),)),
                                           lacking), gate_need=())
    outcome, text = _orchestrate(job)
    assert outcome.exit_code == 2, text  # type: ignore[attr-defined]
    gate = outcome.gate  # type: ignore[attr-defined]
    # the launching host has it (gate_script_here, the default): never copied to the node
    assert gate is not None and gate.problems == {
        "v1": f"{gone} is not on this node (--sync DIR copies DIR to the same path under the "
              "workdir, relative to your current directory: --sync . for all of it; or use a "
              "shared workdir)"}
    assert gate.facts["v0"]["missing"] == []
    assert "step 1/600" not in text and job_processes("gate-script") == {}
    # ... and when neither the launching host nor any node has it, it exists nowhere
    # (issue 38); one node having it is enough for "not on this node" (the first run)
    nowhere = dataclasses.replace(job, gate_script_here=False, tasks=(
        dataclasses.replace(base.tasks[0], needs=(gone,)), lacking))
    outcome, text = _orchestrate(nowhere)
    assert set(outcome.gate.problems) == {"v0", "v1"}, text  # type: ignore[attr-defined]
    assert all(why.startswith(f"{gone} does not exist, on this node nor here on the launching host")
               for why in outcome.gate.problems.values()), text  # type: ignore[attr-defined]


HELPER_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    # A DataLoader-like helper: same environ (RANK too), a child of the rank.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("ready", flush=True)
    time.sleep(60)
""")


def test_status_lists_each_rank_pid_not_its_helpers(tmp_path: Path) -> None:
    """`clusterkit status JOB` (issue 25): the agent's --status answer names each rank's
    own pid (a helper that inherited RANK is not the rank) and the launcher's pid."""
    env = dict(os.environ, CLUSTERKIT_JOB_ID="pidjob", CLUSTERKIT_NODE="n1", LOCAL_RANK="0")
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    ranks = [subprocess.Popen([sys.executable, "-c", HELPER_PARENT], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, text=True) for r in (4, 5)]
    try:
        for p in ranks:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        node_dir = tmp_path / "nodes" / "n1"
        node_dir.mkdir(parents=True)
        (node_dir / "agent.json").write_text(json.dumps(
            {"state": "running", "agent_pid": os.getpid(), "child_pid": launcher.pid,
             "zygote_pid": None, "ranks": {}}))
        # The launcher, 2 ranks, 2 helpers. Looked for again for a few seconds: once, in a
        # CI-like run at load ~9, one scan of /proc saw 4 (which one is not known).
        deadline = time.monotonic() + 10
        while len(procs := job_processes("pidjob", "n1")) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(procs) == 5, sorted(procs)
        assert rank_pids_of(procs) == {4: ranks[0].pid, 5: ranks[1].pid}
        info = job_status("pidjob", str(tmp_path), "n1")
        assert info["ranks"] == [4, 5] and info["processes"] == 5
        assert info["pids"] == {"4": ranks[0].pid, "5": ranks[1].pid}
        assert info["launcher_pid"] == launcher.pid and info["fork_server_pid"] is None
    finally:
        for p in (launcher, *ranks):
            p.kill()
            p.wait()
        sweep("pidjob", "n1", None, 0.5)  # the helpers


def test_status_text_names_pids_and_the_launcher() -> None:
    from clusterkit.cli.cmd_status import ranks_text
    from clusterkit.jobs.status import NodeStatus
    from clusterkit.launch.registry import JobRecord

    def _ranks_text(answer: dict[str, Any]) -> str:  # an agent's `--status` answer, shown
        return ranks_text(NodeStatus.from_answer("n1", answer))

    assert _ranks_text({"ranks": [0, 1], "pids": {"0": 51, "1": 52}, "fork_server_pid": 50,
                        "launcher_pid": None}) == "ranks 0,1 (pids 51,52)  fork server pid 50"
    assert _ranks_text({"ranks": [2], "pids": {"2": 9}, "launcher_pid": 7}) == \
        "ranks 2 (pids 9)  launcher pid 7"
    assert _ranks_text({"ranks": []}) == "ranks -"  # an older agent's answer: no pids
    record = JobRecord(job_id="j", backend="torchrun", nodes=[], created=0.0, launcher_pid=0)
    assert dataclasses.replace(record, launcher="native").launcher_shown == "native"
    assert record.launcher_shown == "torchrun"  # a record from before issue 25


def test_the_recorded_launcher_is_the_one_chosen() -> None:
    from clusterkit.launchers import launcher_name

    assert launcher_name("torchrun", native=True) == "native"
    assert launcher_name("torchrun", native=False) == "torchrun"
    assert launcher_name("deepspeed", native=False) == "deepspeed"
    assert launcher_name("accelerate", native=False) == "accelerate"
