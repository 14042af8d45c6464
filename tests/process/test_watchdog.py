"""Issue 14, hangs: the stack summary, the watchdog's clock, the agent's progress and
stack collection, and the workload's heartbeat/faulthandler contract (no test bed).

The one launch test here (``slow``) runs on the embedded local virtual nodes: a
user script that hangs without printing is caught through the heartbeat contract.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from clusterkit.launch.stacks import read_stack, signature, summarize
from clusterkit.launch.watchdog import Watchdog, ping_interval
from clusterkit.node import hangrule
from clusterkit.node.agent import core as agent_mod
from clusterkit.node.agent import hangs as agent_hangs
from clusterkit.node.agent.procs import job_status
from clusterkit.node.hangrule import step_of
from clusterkit.node.protocol import AgentSpec, Progress
from clusterkit.workload import hangs

FAULTHANDLER = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 324 in wait
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2050 in all_reduce
  File "/work/clusterkit/workload/main.py", line 283 in _agree_signal
  File "/work/clusterkit/workload/main.py", line 280 in run
  File "/work/train.py", line 9 in <module>
"""
PYSPY = """\
Process 42: python -u train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 42 (idle): "MainThread"
    sleep (time)
    next_batch (train.py:20)
    run (train.py:30)
    <module> (train.py:40)
Thread 43 (idle): "pin_memory"
    wait (threading.py:320)
"""


def test_signature_reads_both_dump_formats() -> None:
    assert signature(read_stack(0, "n1", FAULTHANDLER).frames) == "in all_reduce \u2190 _agree_signal"
    assert signature(read_stack(0, "n1", PYSPY).frames) == "in sleep \u2190 next_batch"
    assert signature(()) == "no Python stack"


def test_summary_folds_ranks_and_names_the_stopped_one() -> None:
    stacks = {r: read_stack(r, f"node{r // 2 + 1}", FAULTHANDLER) for r in range(14) if r != 7}
    stacks[7] = read_stack(7, "node4", PYSPY, state="T")
    s = summarize(stacks, 14)
    assert [g.ranks for g in s.groups] == [tuple(r for r in range(14) if r != 7), (7,)]
    assert s.culprit() == ("node4", 7)
    lines = s.lines()
    assert lines[0].startswith("  ranks 0-6,8-13 (node[1-7]): in all_reduce")
    assert "rank 7 (node4, stopped): in sleep \u2190 next_batch" in lines[1]
    assert lines[1].endswith("odd one out") and not lines[0].endswith("odd one out")


def test_a_stopped_rank_in_the_same_collective_is_still_the_odd_one() -> None:
    stacks = {r: read_stack(r, f"node{r // 2 + 1}", FAULTHANDLER, state="T" if r == 3 else "S")
              for r in range(4)}
    s = summarize(stacks, 4)
    assert [g.ranks for g in s.groups] == [(0, 1, 2), (3,)]
    assert s.lines()[1].startswith("  rank 3 (node2, stopped): in all_reduce")
    assert s.culprit() == ("node2", 3)


def test_py_spy_thread_states_parse() -> None:
    text = PYSPY.replace("Thread 42 (idle)", "Thread 42 (active+gil)")
    assert signature(read_stack(0, "n1", text).frames) == "in sleep \u2190 next_batch"


def test_summary_without_a_stopped_rank_blames_the_smallest_group_and_lists_missing() -> None:
    stacks = {r: read_stack(r, "node1", FAULTHANDLER) for r in range(3)}
    stacks[3] = read_stack(3, "node2", PYSPY)
    s = summarize(stacks, 5)
    assert s.culprit() == ("node2", 3)
    assert s.missing == [4] and "no dump from ranks 4" in s.lines()[-1]


# The watchdog's word (issue 25), as a table: --hang-timeout 10, so the start-up
# allowance is 20 s from begin(). Each row: events in time order, then the verdict
# asked at each "check" (None: quiet; a string: the message must contain it).
#   ("begin", t)  the ranks start      ("line", t, node)  a rank of node printed
#   ("step", t)   a step line          ("report", t, node, idle_s, step)  an agent's report
STARTUP_MSG = "no sign of training within the start-up allowance of 20 s (2 \u00d7 --hang-timeout 10)"
WATCHDOG_TABLE: list[tuple[str, float, list[tuple[Any, ...]]]] = [
    ("silent script: fires when the allowance ends, naming it", 10.0, [
        ("begin", 0.0), ("check", 19.9, None),
        ("check", 20.0, STARTUP_MSG + ": no output or heartbeat from any rank since they "
                        "started 20 s ago")]),
    ("prints, no heartbeat, then hangs (the issue): the allowance ends at its bound", 10.0, [
        ("begin", 0.0), ("line", 1.0, "n1"), ("line", 5.0, "n1"), ("check", 14.0, None),
        ("check", 19.9, None),
        ("check", 20.0, "no progress on any rank for 15 s (--hang-timeout 10; the start-up "
                        "allowance of 20 s (2 \u00d7 --hang-timeout 10) passed with no step line "
                        "or heartbeat)")]),
    ("prints steadily, no step: output is progress, the plain limit after start-up", 10.0, [
        ("begin", 0.0), *[("line", float(t), "n1") for t in range(0, 31, 2)],
        ("check", 40.0, None), ("check", 40.6, "no progress on any rank for 11 s (--hang-timeout 10;")]),
    ("a step line ends the allowance at once", 10.0, [
        ("begin", 0.0), ("step", 3.0), ("line", 3.0, "n1"), ("check", 13.0, None),
        ("check", 13.4, "no progress on any rank for 10 s (--hang-timeout 10)")]),
    ("a heartbeat step ends it too", 10.0, [
        ("begin", 0.0), ("report", 4.0, "n1", 0.0, 1), ("check", 14.0, None),
        ("check", 14.3, "no progress on any rank for 10 s (--hang-timeout 10)")]),
    ("one node progressing holds it off", 10.0, [
        ("begin", 0.0), ("step", 1.0), ("report", 30.0, "n1", 29.0, 1),
        ("report", 30.0, "n2", 1.0, 9), ("check", 35.0, None), ("line", 38.0, "n2"),
        ("check", 47.9, None), ("check", 48.2, "for 10 s (--hang-timeout 10)")]),
    ("an agent's idle before the gate's GO does not count", 10.0, [
        ("report", 40.0, "n1", 40.0, None), ("check", 49.0, None), ("begin", 50.0),
        ("report", 51.0, "n1", 51.0, None), ("check", 69.9, None),
        ("check", 70.0, "since they started 20 s ago")]),
    ("an older report does not undo a line the launcher saw", 10.0, [
        ("begin", 0.0), ("step", 0.5), ("line", 9.0, "n1"), ("report", 9.5, "n1", 8.0, None),
        ("check", 18.9, None), ("check", 19.2, "for 10 s")]),
    ("not begun: never", 10.0, [("check", 1000.0, None)]),
    ("--hang-timeout 0: off", 0.0, [("begin", 0.0), ("check", 1e9, None)]),
]


@pytest.mark.parametrize("case", WATCHDOG_TABLE, ids=[c[0] for c in WATCHDOG_TABLE])
def test_watchdog_table(case: tuple[str, float, list[tuple[Any, ...]]]) -> None:
    _name, timeout, rows = case
    wd = Watchdog(hang_timeout_s=timeout, started_at=0.0)
    for kind, t, *rest in rows:
        if kind == "begin":
            wd.begin(t)
        elif kind == "line":
            wd.output(rest[0], t)
        elif kind == "step":
            wd.saw_training(t)
        elif kind == "report":
            node, idle, step = rest
            wd.report(Progress(node, idle_s=idle, step=step), now=t)
        else:
            got = wd.check(t)
            want = rest[0]
            if want is None:
                assert got is None, (t, got)
            else:
                assert got is not None and want in got, (t, got)


def test_watchdog_limits_and_helpers() -> None:
    wd = Watchdog(hang_timeout_s=10.0, started_at=0.0)
    wd.begin(0.0)
    v = wd.verdict(5.0)  # the allowance (node/hangrule.py), then the limit
    assert (v.hung, v.limit, v.limit_s) == (False, hangrule.STARTUP, 20.0)
    wd.report(Progress("node1", idle_s=30.0, step=4), now=11.0)
    wd.report(Progress("node2", idle_s=1.0, step=5), now=11.0)
    v = wd.verdict(11.0)
    assert (v.hung, v.limit, v.limit_s, v.idle_s) == (False, hangrule.HANG_TIMEOUT, 10.0, 1.0)
    assert wd.idle(11.0) == 1.0 and wd.last_step() == 5
    assert step_of("[clusterkit] step 10/30 | loss 4.8") == 10 and step_of("Step: 3") == 3
    assert step_of("steps=5 loaded") is None and step_of("no numbers") is None
    assert ping_interval(60.0) == 5.0 and ping_interval(4.0) == 1.0


def test_agent_progress_reads_heartbeat_files(tmp_path: Path) -> None:
    spec = AgentSpec(job_id="j", node="node1", job_dir=str(tmp_path),
                          rank_offsets={"node1": 0})
    a = agent_mod.Agent(spec, io.StringIO())
    a.prepare()
    hangs.Heartbeat(1, {"CLUSTERKIT_HEARTBEAT_DIR": a.progress_dir}).beat(17)
    old = os.path.join(a.progress_dir, "rank0.heartbeat")
    Path(old).write_text("30\n")
    os.utime(old, (time.time() - 100, time.time() - 100))  # an earlier attempt's beat
    p = a.progress()
    assert p["step"] == 17 and p["idle_s"] < 5 and "0" not in p["ranks"]


def test_agent_dead_man_switch_stops_a_silent_agent(tmp_path: Path) -> None:
    spec = AgentSpec(job_id="j", node="node1", job_dir=str(tmp_path), keepalive_s=0.2)
    a = agent_mod.Agent(spec, io.StringIO())
    a.check_keepalive()
    assert not a.keepalive_lost
    a.prepare()
    time.sleep(0.3)
    a.check_keepalive()
    assert a.keepalive_lost and a.stop_reason == "keepalive-lost"
    assert "no keepalive" in (Path(a.node_dir) / "launcher.log").read_text()


STUCK = textwrap.dedent("""\
    import os, sys, time
    from clusterkit.workload import hangs
    hangs.install_stack_dump(int(os.environ.get("RANK", "0")))
    def data_loader():
        print("ready", flush=True)
        time.sleep(60)
    data_loader()
""")


def test_faulthandler_dump_of_a_stopped_rank(tmp_path: Path) -> None:
    """No py-spy: the workload's SIGWINCH handler writes the stacks, even after SIGSTOP."""
    spec = AgentSpec(job_id="j", node="node1", job_dir=str(tmp_path))
    a = agent_mod.Agent(spec, io.StringIO())
    a.prepare()
    env = dict(os.environ, RANK="5", CLUSTERKIT_HEARTBEAT_DIR=a.progress_dir)
    proc = subprocess.Popen([sys.executable, "-c", STUCK], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        state = agent_hangs.proc_state(proc.pid)
        assert state == "T"
        text = a.stacks.faulthandler_dump(5, proc.pid, state)
    finally:
        proc.kill()
        proc.wait()
    st = read_stack(5, "node1", text, state=state)
    assert signature(st.frames) == "in data_loader \u2190 <module>", text
    assert st.stopped


HANGS_SILENTLY = textwrap.dedent("""\
    import os, time
    rank = int(os.environ["RANK"])
    beat = os.environ["CLUSTERKIT_HEARTBEAT"]
    print(f"rank {rank} starts", flush=True)  # the only line: progress is the heartbeat

    def data_loader():
        time.sleep(3600)

    def collective():
        while True:
            time.sleep(1)

    for step in range(40):
        if rank == 1 and step == 5:
            data_loader()  # hangs, prints nothing, stops beating
        with open(beat, "w") as fh:
            fh.write(str(step))
        time.sleep(0.25)
    collective()  # the others beat for ~10 s, then wait for rank 1 forever
""")


@pytest.mark.slow
def test_user_script_that_hangs_silently_is_caught_by_its_heartbeat(tmp_path: Path) -> None:
    """2 local nodes x 2 ranks: a script that prints once, then only beats; rank 1 hangs."""
    script = tmp_path / "train.py"
    script.write_text(HANGS_SILENTLY)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "clusterkit", "launch", "--nodes", "2", "--gpus-per-node", "2",
         "--skip-checks", "--job-id", "hb", "--hang-timeout", "4", "--grace", "1", str(script)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    took = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    assert proc.returncode == 124, text[-3000:]
    assert "no progress on any rank for" in text
    # The other ranks' heartbeats (no output) held the watchdog off for their ~10 s.
    assert took > 10, (took, text[-2000:])
    assert "rank 1 (local1): in " in text and "data_loader" in text, text[-3000:]
    assert "ranks 0,2-3 (local[1-2]): in " in text and "collective" in text, text[-3000:]
    assert "local1 rank 1 failed (no progress" in text
    dumps = sorted(p.name for p in (tmp_path / "home" / "jobs" / "hb" / "stacks" / "a0").iterdir())
    assert dumps == ["rank0.txt", "rank1.txt", "rank2.txt", "rank3.txt", "summary.txt"], dumps


@pytest.mark.skipif(agent_hangs.py_spy() is None, reason="py-spy is not installed")
def test_py_spy_reads_a_stopped_rank_without_pausing_it(tmp_path: Path) -> None:
    spec = AgentSpec(job_id="j", node="node1", job_dir=str(tmp_path))
    a = agent_mod.Agent(spec, io.StringIO())
    a.prepare()
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, RANK="2"))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        results: dict[str, dict[str, Any]] = {}
        a.stacks.dump_one(2, proc.pid, agent_hangs.py_spy(), results)
    finally:
        proc.kill()
        proc.wait()
    res = results["2"]
    assert res["tool"] == "py-spy" and res["state"] == "T", res
    assert signature(read_stack(2, "node1", str(res["text"])).frames) == \
        "in data_loader \u2190 <module>", res["text"]


def test_status_shows_each_nodes_step_and_last_progress(tmp_path: Path) -> None:
    from clusterkit.cli.cmd_status import progress_text
    from clusterkit.jobs.status import NodeStatus

    spec = AgentSpec(job_id="j", node="node1", job_dir=str(tmp_path))
    a = agent_mod.Agent(spec, io.StringIO())
    a.prepare()
    a.write_state("running", progress={"idle_s": 0.0, "step": 12, "time": time.time() - 7})
    info = job_status("j", str(tmp_path), "node1")
    assert info["progress"]["step"] == 12 and 6 <= info["progress"]["age_s"] < 30
    node = NodeStatus.from_answer("node1", {**info, "agent_alive": True})
    text = progress_text(node)
    assert text.startswith("  step 12, last progress ") and "s ago)" in text
    assert progress_text(NodeStatus.from_answer("node1", {**info, "agent_alive": False})) == ""
