"""The launch runtime (clusterkit.launch.runtime) tested as its table in docs/architecture.md:
rows of (state, event, time) -> (stage after, actions), no processes, no clock.

Two nodes, one rank each (v0 rank 0, v1 rank 1) unless a row's state says otherwise.
Each state is built by feeding the runtime the events that lead there; the row then
checks the one event under test.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from signal import SIGINT, SIGTERM, SIGUSR1, SIGUSR2

import pytest

from clusterkit.launch.gate import GATE_TIMEOUT_S
from clusterkit.launch.jobspec import JobSpec, NodeTask
from clusterkit.launch.replica_events import replica_line
from clusterkit.launch.runtime import Runtime
from clusterkit.launch.runtime_io import (
    Action,
    AgentEnded,
    AgentOutput,
    Close,
    ConsolePhase,
    Drained,
    Event,
    FailedFirst,
    Finish,
    Info,
    NodeDone,
    NodeUp,
    Phase,
    Received,
    ReportStacks,
    Send,
    Show,
    Signalled,
    Spawned,
    Starting,
    Tick,
    Unreadable,
    read_line,
)
from clusterkit.launch.runtime_state import Stage
from clusterkit.launch.stacks import summarize
from clusterkit.launch.watchdog import DUMP_COLLECT_S
from clusterkit.node import protocol
from clusterkit.node.contract import JobDir
from clusterkit.node.protocol import Control
from clusterkit.remote.base import SSHTarget
from tests.paths import REPO

P = ConsolePhase
G = 3.0  # grace_s
BOTH = ("v0", "v1")
LOGS = JobDir("/j").node_log("<node>", "<N>")
FACTS = {"python": "/usr/bin/python3", "version": "3.11.7"}
STOPPING = "stopping the job on every node"


def task(node: str, rank: int, argv: tuple[str, ...] = ("python3", "train.py")) -> NodeTask:
    return NodeTask(node=node, target=SSHTarget(name=node, address="127.0.0.1", local=True),
                    python="python3", argv=argv, rank_offset=rank, nprocs=1, job_dir="/j")


def job(**kw: object) -> JobSpec:
    tasks = (task("v0", 0), task("v1", 1, kw.pop("v1_argv", ("python3", "train.py"))))  # type: ignore[arg-type]
    return JobSpec(job_id="j", tasks=tasks, grace_s=G, **kw)  # type: ignore[arg-type]


def fed(spec: JobSpec, *events: tuple[float, Event]) -> Runtime:
    rt = Runtime(spec, 0.0)
    for now, ev in events:
        rt.on(ev, now)
    return rt


def line(node: str, lrank: int | None, text: str) -> Received:
    return Received(node, protocol.Line(node, lrank, text))


# The states of the table, each as the events that lead there.
START = ((0.0, Starting()), (0.0, Spawned()))
STATES: dict[str, Callable[[], Runtime]] = {
    "connecting": lambda: Runtime(job(), 0.0),
    "connecting, gated": lambda: Runtime(job(gate_need=()), 0.0),
    "gate": lambda: fed(job(gate_need=()), *START),
    "gate, v0 reported": lambda: fed(job(gate_need=()), *START,
                                     (1.0, Received("v0", protocol.Facts("v0", FACTS)))),
    "stopping, gate undecided": lambda: fed(
        job(gate_need=()), *START, (1.0, Received("v0", protocol.Facts("v0", FACTS))),
        (1.5, Signalled(SIGINT))),
    "running": lambda: fed(job(), *START),
    "running, v0 up": lambda: fed(job(), *START, (1.0, Received("v0", protocol.Started("v0")))),
    "running, v1 watches": lambda: fed(job(v1_argv=()), *START),
    "running, keepalive 8": lambda: fed(job(keepalive_s=8.0), *START),
    "running, v0 done": lambda: fed(job(), *START, (4.0, AgentEnded("v0", 0))),
    "running, hang 10": lambda: fed(job(hang_timeout_s=10.0), *START),
    "collecting": lambda: fed(job(hang_timeout_s=10.0), *START, (100.0, Tick())),
    "stopping": lambda: fed(job(), *START, (1.0, Signalled(SIGINT))),
    "stopping, v1 failed": lambda: fed(job(), *START, (1.0, AgentEnded("v1", 3))),
    "stopping, v1 ended": lambda: fed(job(), *START, (1.0, Signalled(SIGINT)),
                                      (2.0, AgentEnded("v1", 143))),
    "finished": lambda: fed(job(), *START, (5.0, AgentEnded("v0", 0)),
                            (5.0, AgentEnded("v1", 0))),
    "finished, replicated": lambda: fed(
        job(), *START,
        *((3.0, Received(n, protocol.Replica(n, tag="global_step20", source=i,
                                             target=BOTH[1 - i],
                                             state=protocol.CopyState.COMPLETE)))
          for i, n in enumerate(BOTH)),
        (5.0, AgentEnded("v0", 0)), (5.0, AgentEnded("v1", 0))),
    "finished after SIGINT": lambda: fed(job(), *START, (1.0, Signalled(SIGINT)),
                                         (2.0, AgentEnded("v0", 143)),
                                         (2.0, AgentEnded("v1", -1, dropped=True))),
}

FAILED_COPY = protocol.Replica("v0", tag="global_step20", source=0, target="v1",
                               state=protocol.CopyState.FAILED, detail="connection refused")
NO_TRAINING = ("no sign of training within the start-up allowance of 20 s (2 \u00d7 "
               "--hang-timeout 10): no output or heartbeat from any rank since they started "
               "100 s ago: collecting every rank's Python stacks")

# (row id of docs/architecture.md's table, state, now, event) -> (stage after, actions)
TABLE: list[tuple[str, str, float, Event, Stage, list[Action]]] = [
    # -- the start
    ("start", "connecting", 0.0, Starting(), Stage.CONNECTING,
     [Info("job j: starting 2 node agents"), Phase(P.CONNECTING)]),
    ("spawned", "connecting", 0.0, Spawned(), Stage.RUNNING, [Phase(P.STARTING)]),
    ("spawned-gated", "connecting, gated", 0.0, Spawned(), Stage.GATE, []),
    ("start-failed", "connecting", 0.0, Spawned({"v1": "ssh: refused"}), Stage.STOPPING,
     [Phase(P.STARTING), Info("v1: could not start the agent: ssh: refused"),
      Info(f"v1 failed (the agent could not be started): {STOPPING}"), Phase(P.TEARING_DOWN),
      Send(Control.TERM, ("v0",))]),
    ("start-failed-gated", "connecting, gated", 0.0, Spawned({"v1": "ssh: refused"}),
     Stage.GATE, []),
    # -- the folded gate
    ("gate-facts", "gate", 1.0, Received("v0", protocol.Facts("v0", FACTS)), Stage.GATE,
     [Phase(P.GATE, "1/2 nodes")]),
    ("gate-go", "gate, v0 reported", 2.0, Received("v1", protocol.Facts("v1", FACTS)),
     Stage.RUNNING, [Phase(P.GATE, "2/2 nodes"), Send(Control.GO, BOTH), Phase(P.STARTING)]),
    ("gate-refused", "gate, v0 reported", 2.0,
     Received("v1", protocol.Facts("v1", {**FACTS, "version": "3.10.1"})), Stage.STOPPING,
     [Phase(P.GATE, "2/2 nodes"),
      Info("v1: differs from the majority: version 3.10.1 != 3.11.7 on v0"),
      Phase(P.TEARING_DOWN), Send(Control.TERM, BOTH)]),
    ("gate-ended", "gate, v0 reported", 2.0, AgentEnded("v1", 1), Stage.STOPPING,
     [Info("v1: the node agent ended before reporting (exit code 1): no output"),
      Phase(P.TEARING_DOWN), Send(Control.TERM, ("v0",)), NodeDone("v1", 1)]),
    ("gate-ended", "gate", 2.0, AgentEnded("v1", 1), Stage.GATE, [NodeDone("v1", 1)]),
    ("gate-timeout", "gate", GATE_TIMEOUT_S - 0.1, Tick(), Stage.GATE, []),
    ("gate-timeout", "gate, v0 reported", 1.0 + GATE_TIMEOUT_S, Tick(), Stage.STOPPING,
     [Info("v1: the node agent did not report within 20 s"), Phase(P.TEARING_DOWN),
      Send(Control.TERM, BOTH)]),
    # GO after a stop (issue 30): the last node's facts after SIGINT start nothing
    ("late-facts", "stopping, gate undecided", 2.0,
     Received("v1", protocol.Facts("v1", FACTS)), Stage.STOPPING, []),
    ("stopping-ended", "stopping, gate undecided", 2.0, AgentEnded("v1", 143),
     Stage.STOPPING, [NodeDone("v1", 143)]),
    ("stopping-tick", "stopping, gate undecided", 1.5 + G + 2.1, Tick(), Stage.STOPPING,
     [Send(Control.KILL, BOTH)]),
    # -- running: output, reports
    ("rank-line", "running", 1.0, line("v0", 0, "hello"), Stage.RUNNING,
     [Show("v0", 0, "hello")]),
    ("rank-line", "running", 1.0, line("v0", 0, "step 3/10 | loss 4.2"), Stage.RUNNING,
     [Phase(P.TRAINING), Show("v0", 0, "step 3/10 | loss 4.2")]),
    ("rank-line", "collecting", 101.0, line("v0", 0, "step 3/10 | loss 4.2"),
     Stage.COLLECTING, [Show("v0", 0, "step 3/10 | loss 4.2")]),
    ("launcher-line", "running", 1.0, line("v1", None, "torchrun: starting"), Stage.RUNNING,
     [Show("v1", None, "torchrun: starting")]),
    ("launcher-line", "stopping", 2.0, line("v1", None, "torchrun: bye"), Stage.STOPPING,
     [Show("v1", None, "torchrun: bye")]),
    ("progress", "running", 1.0, Received("v0", protocol.Progress("v0", idle_s=1.0, step=4)),
     Stage.RUNNING, [Phase(P.TRAINING)]),
    ("progress", "stopping", 2.0, Received("v0", protocol.Progress("v0", idle_s=1.0, step=4)),
     Stage.STOPPING, []),
    ("started", "running", 1.0, Received("v0", protocol.Started("v0")), Stage.RUNNING,
     [NodeUp("v0")]),
    ("started", "running, v0 up", 1.0, Received("v1", protocol.Started("v1")), Stage.RUNNING,
     [NodeUp("v1"), Phase(P.INITIALISING)]),
    ("replica", "running", 1.0, Received("v0", FAILED_COPY), Stage.RUNNING,
     [Info(replica_line(FAILED_COPY))]),
    ("error", "running", 1.0, Received("v0", protocol.Error("v0", message="boom")),
     Stage.RUNNING, [Info("v0: agent error: boom")]),
    ("quiet", "running", 1.0, Received("v0", protocol.Forwarded("v0", signal="USR1")),
     Stage.RUNNING, []),
    ("quiet", "running", 1.0, Received("v0", protocol.Teardown("v0", reason="term")),
     Stage.RUNNING, []),
    ("quiet", "running", 1.0, Received("v0", protocol.Exit("v0")), Stage.RUNNING, []),
    ("agent-output", "running", 1.0, AgentOutput("v0", "Traceback (most recent call last):"),
     Stage.RUNNING, [Show("v0", None, "Traceback (most recent call last):", agent=True)]),
    ("unreadable", "running", 1.0, Unreadable("v0", "agent event is not JSON"), Stage.RUNNING,
     [Info("v0: unreadable agent event: agent event is not JSON")]),
    # -- running: failures
    ("rank-failed", "running", 1.0,
     Received("v0", protocol.RankFailed("v0", failed_node="v1", rank=1, local_rank=0, code=137)),
     Stage.STOPPING,
     [FailedFirst(1, "v1 rank 1", LOGS), Info(f"v1 rank 1 failed (exit code 137): {STOPPING}"),
      Phase(P.TEARING_DOWN), Send(Control.TERM, BOTH)]),
    ("stopping-rank-failed", "stopping", 2.0,
     Received("v0", protocol.RankFailed("v0", failed_node="v1", rank=1, local_rank=0, code=137)),
     Stage.STOPPING, []),
    ("ended-failed", "running", 1.0, AgentEnded("v1", 3), Stage.STOPPING,
     [FailedFirst(1, "v1 rank 1", LOGS), Info(f"v1 rank 1 failed (exit code 3): {STOPPING}"),
      Phase(P.TEARING_DOWN), Send(Control.TERM, ("v0",)), NodeDone("v1", 3)]),
    ("ended-dropped", "running", 1.0, AgentEnded("v1", -1, dropped=True), Stage.STOPPING,
     [Info(f"v1 failed (the SSH connection dropped): {STOPPING}"), Phase(P.TEARING_DOWN),
      Send(Control.TERM, ("v0",)), NodeDone("v1", -1)]),
    ("ended-ok", "running", 1.0, AgentEnded("v1", 0), Stage.RUNNING, [NodeDone("v1", 0)]),
    ("ended-ok", "running, v1 watches", 1.0, AgentEnded("v0", 0), Stage.RUNNING,
     [NodeDone("v0", 0), Close(("v1",), terminate=False)]),
    # -- signals
    ("forward", "running", 1.0, Signalled(SIGUSR1), Stage.RUNNING,
     [Info("forwarding SIGUSR1 to every node"), Send(Control.USR1, BOTH)]),
    ("forward", "stopping", 1.5, Signalled(SIGUSR2), Stage.STOPPING,
     [Info("forwarding SIGUSR2 to every node"), Send(Control.USR2, BOTH)]),
    ("signal", "running", 1.0, Signalled(SIGINT), Stage.STOPPING,
     [Info(f"SIGINT: {STOPPING} (again to kill at once)"), Phase(P.TEARING_DOWN),
      Send(Control.TERM, BOTH)]),
    ("signal", "gate, v0 reported", 1.5, Signalled(SIGTERM), Stage.STOPPING,
     [Info(f"SIGTERM: {STOPPING} (again to kill at once)"), Phase(P.TEARING_DOWN),
      Send(Control.TERM, BOTH)]),
    ("signal-stopping", "stopping, v1 failed", 1.5, Signalled(SIGINT), Stage.STOPPING,
     [Info(f"SIGINT: {STOPPING} (again to kill at once)")]),
    ("signal-again", "stopping", 1.5, Signalled(SIGTERM), Stage.STOPPING,
     [Send(Control.KILL, BOTH)]),
    # -- time: keepalive, watchdog, the teardown's deadlines (launch/teardown.py)
    ("tick", "running", 50.0, Tick(), Stage.RUNNING, []),
    ("keepalive", "running, keepalive 8", 1.0, Tick(), Stage.RUNNING,
     [Send(Control.PING, BOTH)]),
    ("watchdog", "running, hang 10", 19.0, Tick(), Stage.RUNNING, []),  # the allowance runs
    ("watchdog", "running, hang 10", 100.0, Tick(), Stage.COLLECTING,
     [Info(NO_TRAINING), Send(Control.DUMP, BOTH)]),
    ("stacks", "collecting", 101.0, Received("v0", protocol.Stacks("v0", ranks={})),
     Stage.COLLECTING, []),
    ("verdict", "collecting", 100.0 + DUMP_COLLECT_S, Tick(), Stage.COLLECTING, []),
    ("verdict", "collecting", 100.1 + DUMP_COLLECT_S, Tick(), Stage.STOPPING,
     [ReportStacks({}, summarize({}, 2)),
      Info("v0 failed (no progress: the watchdog's stack summary names it): " + STOPPING),
      Phase(P.TEARING_DOWN), Send(Control.TERM, BOTH)]),
    ("stopping-tick", "stopping", 1.0 + G + 2.0, Tick(), Stage.STOPPING, []),
    ("stopping-tick", "stopping", 1.0 + G + 2.1, Tick(), Stage.STOPPING,
     [Send(Control.KILL, BOTH)]),
    ("stopping-tick", "stopping, v1 ended", 1.0 + G + 4.1, Tick(), Stage.STOPPING,
     [Send(Control.KILL, ("v0",)), Close(("v0",), terminate=True)]),
    ("stopping-tick", "stopping", 1.0 + G + 15.1, Tick(), Stage.FINISHED,  # given up: dropped
     [Send(Control.KILL, BOTH), Close(BOTH, terminate=True)]),
    ("stopping-ended", "stopping", 2.0, AgentEnded("v1", 143), Stage.STOPPING,
     [NodeDone("v1", 143)]),
    # -- the end
    ("last-ended", "running, v0 done", 5.0, AgentEnded("v1", 0), Stage.FINISHED,
     [NodeDone("v1", 0)]),
    ("last-ended", "stopping, v1 ended", 5.0, AgentEnded("v0", 143), Stage.FINISHED,
     [NodeDone("v0", 143)]),
    ("drained", "finished", 5.0, Drained(), Stage.FINISHED, [Finish()]),
    ("drained", "finished, replicated", 5.0, Drained(), Stage.FINISHED,
     [Info("checkpoints replicated: global_step20 2/2"), Finish()]),
    ("drained", "finished after SIGINT", 2.0, Drained(), Stage.FINISHED, [Finish(("v1",))]),
]


@pytest.mark.parametrize(("row", "state", "now", "event", "after", "actions"), TABLE,
                         ids=[f"{r[0]}:{r[1]}-{type(r[3]).__name__}" for r in TABLE])
def test_transition(row: str, state: str, now: float, event: Event, after: Stage,
                    actions: list[Action]) -> None:
    rt = STATES[state]()
    assert rt.on(event, now) == actions
    assert rt.stage is after


def doc_rows() -> list[str]:
    """The row ids of docs/architecture.md's table of the launch runtime."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## The launch runtime", 1)[1].split("\n## ", 1)[0]
    header = "| row | stage | event | next stage | actions |"
    assert header in section, "the runtime's table lost its row column"
    table = section.split(header, 1)[1].split("\n\n", 1)[0]
    return [cells.split("|")[1].strip().strip("`") for cells in table.strip().splitlines()[1:]]


def test_every_row_of_the_doc_table_has_a_test_row_and_one_place_in_the_code() -> None:
    doc = doc_rows()
    assert len(doc) == len(set(doc)), "a row id is used twice in the doc table"
    tested = {r[0] for r in TABLE}
    assert sorted(set(doc) - tested) == [], "doc rows without a test row"
    assert sorted(tested - set(doc)) == [], "test rows naming no row of the doc table"
    code = (REPO / "clusterkit" / "launch" / "runtime.py").read_text()
    marked = re.findall(r"# row ([a-z-]+)", code)
    assert sorted(set(doc) - set(marked)) == [], "doc rows with no `# row <id>` in runtime.py"
    assert sorted(set(marked) - set(doc)) == [], "`# row <id>` naming no row of the doc table"


def test_every_state_is_what_its_name_says() -> None:
    want = {"connecting": Stage.CONNECTING, "gate": Stage.GATE, "running": Stage.RUNNING,
            "collecting": Stage.COLLECTING, "stopping": Stage.STOPPING,
            "finished": Stage.FINISHED}
    for name, build in STATES.items():
        assert build().stage is want[name.split(",")[0].split(" after")[0]], name


def test_a_refused_gate_ends_with_exit_2_and_no_failure() -> None:
    rt = STATES["gate, v0 reported"]()
    acts = rt.on(Received("v1", protocol.Facts("v1", {**FACTS, "version": "3.10.1"})), 2.0)
    assert acts[0] == Phase(P.GATE, "2/2 nodes") and acts[-1] == Send(Control.TERM, BOTH)
    assert any(isinstance(a, Info) and a.text.startswith("v1: differs from the majority")
               for a in acts)
    # The held agents exit when told: released, not failures; nothing to sweep.
    assert rt.on(AgentEnded("v0", 0), 3.0) == [NodeDone("v0", 0)]
    assert rt.on(AgentEnded("v1", 0), 3.0) == [NodeDone("v1", 0)]
    assert rt.on(Drained(), 3.0) == [Finish()]
    out = rt.outcome(3.0, {}, [])
    assert (out.exit_code, out.failure, out.gate is not None) == (2, None, True)


def test_outcome_names_the_first_failure_and_its_tail() -> None:
    rt = STATES["running"]()
    for i in range(3):
        rt.on(line("v1", 0, f"step {i}"), 1.0)
    rt.on(Received("v1", protocol.RankFailed("v1", failed_node="v1", rank=1, local_rank=0,
                                              code=-9)), 2.0)
    rt.on(AgentEnded("v0", 1), 2.5)  # collateral: the first failure stays named
    out = rt.outcome(3.0, {}, [])
    assert out.failure is not None and out.failure.where() == "v1 rank 1"
    assert out.failure.tail == ["step 0", "step 1", "step 2"]
    assert out.exit_code == 137 and not out.interrupted


def test_a_second_signal_after_the_first_kills_and_the_exit_is_130() -> None:
    rt = STATES["stopping"]()
    assert rt.on(Signalled(SIGINT), 1.2) == [Send(Control.KILL, BOTH)]
    rt.on(AgentEnded("v0", -9), 1.3)
    rt.on(AgentEnded("v1", -9), 1.3)
    out = rt.outcome(2.0, {}, [])
    assert (out.exit_code, out.failure, out.interrupted) == (130, None, True)


def test_the_keepalive_pings_every_interval() -> None:
    rt = STATES["running, keepalive 8"]()
    sent = [now for now in (1.0, 1.5, 2.9, 3.1, 4.0, 5.2)
            if rt.on(Tick(), now) == [Send(Control.PING, BOTH)]]
    assert sent == [1.0, 3.1, 5.2]  # ping_interval(8) = 2 s


def test_read_line_is_the_one_decoder() -> None:
    msg = protocol.Started("v0", pid=7)
    assert read_line("v0", protocol.encode(msg)) == Received("v0", msg)
    assert read_line("v0", "@ck:L v0 1 hi") == Received("v0", protocol.Line("v0", 1, "hi"))
    assert read_line("v0", "plain") == AgentOutput("v0", "plain")
    assert isinstance(read_line("v0", '@ck:E {"v": 99}'), Unreadable)


NEW_KIND = """
@dataclass(frozen=True)
class NewKind(AgentEvent):
    EV: ClassVar[str] = "new-kind"


"""


def test_a_new_agent_message_kind_without_a_launcher_case_fails_mypy(tmp_path: Path) -> None:
    """protocol.AnyEvent gains a kind, runtime.py does not: mypy names the dispatch."""
    root = REPO
    shutil.copytree(root / "clusterkit", tmp_path / "clusterkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proto = tmp_path / "clusterkit" / "node" / "protocol.py"
    text = proto.read_text()
    anchor = "AnyEvent = Union["
    assert anchor in text
    proto.write_text(text.replace(anchor, NEW_KIND + anchor + "NewKind, ", 1))
    # The two modules checked for real, every other import as Any: a few seconds.
    cmd = [sys.executable, "-m", "mypy", "--follow-imports=skip",
           "--no-incremental", "--python-version", "3.11",
           "clusterkit/launch/runtime.py", "clusterkit/node/protocol.py"]
    got = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    errors = [ln for ln in got.stdout.splitlines() if ": error:" in ln]
    assert errors and all("runtime.py" in ln and "assert_never" in ln and "NewKind" in ln
                          for ln in errors), got.stdout


def test_every_agent_message_kind_is_dispatched() -> None:
    """Run time's side of the same rule: each kind of the union reaches a case."""
    from typing import get_args
    kinds = get_args(protocol.AnyEvent)
    assert set(kinds) == set(protocol.EVENT_TYPES.values())
    for kind in kinds:
        rt = STATES["running"]()
        rt.on(Received("v0", kind("v0")), 1.0)  # assert_never raises on a missing case
