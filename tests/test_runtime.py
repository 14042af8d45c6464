"""The launch runtime (clusterkit.launch.runtime) tested as its table in docs/architecture.md:
rows of (state, event, time) -> (stage after, actions), no processes, no clock.

Two nodes, one rank each (v0 rank 0, v1 rank 1) unless a row's state says otherwise.
Each state is built by feeding the runtime the events that lead there; the row then
checks the one event under test.
"""

from __future__ import annotations

from collections.abc import Callable

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
        (1.5, Signalled("SIGINT"))),
    "running": lambda: fed(job(), *START),
    "running, v0 up": lambda: fed(job(), *START, (1.0, Received("v0", protocol.Started("v0")))),
    "running, v1 watches": lambda: fed(job(v1_argv=()), *START),
    "running, keepalive 8": lambda: fed(job(keepalive_s=8.0), *START),
    "running, hang 10": lambda: fed(job(hang_timeout_s=10.0), *START),
    "collecting": lambda: fed(job(hang_timeout_s=10.0), *START, (100.0, Tick())),
    "stopping": lambda: fed(job(), *START, (1.0, Signalled("SIGINT"))),
    "stopping, v1 ended": lambda: fed(job(), *START, (1.0, Signalled("SIGINT")),
                                      (2.0, AgentEnded("v1", 143))),
    "finished": lambda: fed(job(), *START, (5.0, AgentEnded("v0", 0)),
                            (5.0, AgentEnded("v1", 0))),
    "finished, replicated": lambda: fed(
        job(), *START,
        *((3.0, Received(n, protocol.Replica(n, tag="global_step20", source=i,
                                             target=BOTH[1 - i], state="complete")))
          for i, n in enumerate(BOTH)),
        (5.0, AgentEnded("v0", 0)), (5.0, AgentEnded("v1", 0))),
    "finished after SIGINT": lambda: fed(job(), *START, (1.0, Signalled("SIGINT")),
                                         (2.0, AgentEnded("v0", 143)),
                                         (2.0, AgentEnded("v1", -1, dropped=True))),
}

REPLICA = protocol.Replica("v0", tag="global_step20", source=0, target="v1", state="complete",
                           bytes=2_000_000, seconds=0.5)
NO_TRAINING = ("no sign of training within the start-up allowance of 20 s (2 \u00d7 "
               "--hang-timeout 10): no output or heartbeat from any rank since they started "
               "100 s ago: collecting every rank's Python stacks")

# (state, now, event) -> (stage after, actions)
TABLE: list[tuple[str, float, Event, Stage, list[Action]]] = [
    # -- the start
    ("connecting", 0.0, Starting(), Stage.CONNECTING,
     [Info("job j: starting 2 node agents"), Phase("connecting")]),
    ("connecting", 0.0, Spawned(), Stage.RUNNING, [Phase("starting ranks")]),
    ("connecting, gated", 0.0, Spawned(), Stage.GATE, []),
    ("connecting", 0.0, Spawned({"v1": "ssh: refused"}), Stage.STOPPING,
     [Phase("starting ranks"), Info("v1: could not start the agent: ssh: refused"),
      Info(f"v1 failed (the agent could not be started): {STOPPING}"), Phase("tearing down"),
      Send(Control.TERM, ("v0",))]),
    # -- the folded gate
    ("gate", 1.0, Received("v0", protocol.Facts("v0", FACTS)), Stage.GATE,
     [Phase("gate", "1/2 nodes")]),
    ("gate, v0 reported", 2.0, Received("v1", protocol.Facts("v1", FACTS)), Stage.RUNNING,
     [Phase("gate", "2/2 nodes"), Send(Control.GO, BOTH), Phase("starting ranks")]),
    ("gate, v0 reported", 2.0, AgentEnded("v1", 1), Stage.STOPPING,
     [Info("v1: the node agent ended before reporting (exit code 1): no output"),
      Phase("tearing down"), Send(Control.TERM, ("v0",)), NodeDone("v1", 1)]),
    ("gate", GATE_TIMEOUT_S - 0.1, Tick(), Stage.GATE, []),
    # GO after a stop (issue 30): the last node's facts after SIGINT start nothing
    ("stopping, gate undecided", 2.0, Received("v1", protocol.Facts("v1", FACTS)),
     Stage.STOPPING, []),
    ("stopping, gate undecided", 2.0, AgentEnded("v1", 143), Stage.STOPPING,
     [NodeDone("v1", 143)]),
    ("stopping, gate undecided", 1.5 + G + 2.1, Tick(), Stage.STOPPING,
     [Send(Control.KILL, BOTH)]),
    ("gate, v0 reported", 1.0 + GATE_TIMEOUT_S, Tick(), Stage.STOPPING,
     [Info("v1: the node agent did not report within 20 s"), Phase("tearing down"),
      Send(Control.TERM, BOTH)]),
    # -- running: output, reports
    ("running", 1.0, line("v0", 0, "hello"), Stage.RUNNING, [Show("v0", 0, "hello")]),
    ("running", 1.0, line("v0", 0, "step 3/10 | loss 4.2"), Stage.RUNNING,
     [Phase("training"), Show("v0", 0, "step 3/10 | loss 4.2")]),
    ("running", 1.0, line("v1", None, "torchrun: starting"), Stage.RUNNING,
     [Show("v1", None, "torchrun: starting")]),
    ("running", 1.0, Received("v0", protocol.Progress("v0", idle_s=1.0, step=4)),
     Stage.RUNNING, [Phase("training")]),
    ("running", 1.0, Received("v0", protocol.Started("v0")), Stage.RUNNING, [NodeUp("v0")]),
    ("running, v0 up", 1.0, Received("v1", protocol.Started("v1")), Stage.RUNNING,
     [NodeUp("v1"), Phase("initialising")]),
    ("running", 1.0, Received("v0", REPLICA), Stage.RUNNING, [Info(replica_line(REPLICA))]),
    ("running", 1.0, Received("v0", protocol.Error("v0", message="boom")), Stage.RUNNING,
     [Info("v0: agent error: boom")]),
    ("running", 1.0, Received("v0", protocol.Forwarded("v0", signal="USR1")), Stage.RUNNING, []),
    ("running", 1.0, Received("v0", protocol.Teardown("v0", reason="term")), Stage.RUNNING, []),
    ("running", 1.0, Received("v0", protocol.Exit("v0")), Stage.RUNNING, []),
    ("running", 1.0, AgentOutput("v0", "Traceback (most recent call last):"), Stage.RUNNING,
     [Show("v0", None, "Traceback (most recent call last):", agent=True)]),
    ("running", 1.0, Unreadable("v0", "agent event is not JSON"), Stage.RUNNING,
     [Info("v0: unreadable agent event: agent event is not JSON")]),
    # -- running: failures
    ("running", 1.0, Received("v0", protocol.RankFailed("v0", failed_node="v1", rank=1,
                                                          local_rank=0, code=137)),
     Stage.STOPPING,
     [FailedFirst(1, "v1 rank 1", LOGS), Info(f"v1 rank 1 failed (exit code 137): {STOPPING}"),
      Phase("tearing down"), Send(Control.TERM, BOTH)]),
    ("running", 1.0, AgentEnded("v1", 3), Stage.STOPPING,
     [FailedFirst(1, "v1 rank 1", LOGS), Info(f"v1 rank 1 failed (exit code 3): {STOPPING}"),
      Phase("tearing down"), Send(Control.TERM, ("v0",)), NodeDone("v1", 3)]),
    ("running", 1.0, AgentEnded("v1", -1, dropped=True), Stage.STOPPING,
     [Info(f"v1 failed (the SSH connection dropped): {STOPPING}"), Phase("tearing down"),
      Send(Control.TERM, ("v0",)), NodeDone("v1", -1)]),
    ("running", 1.0, AgentEnded("v1", 0), Stage.RUNNING, [NodeDone("v1", 0)]),
    ("running, v1 watches", 1.0, AgentEnded("v0", 0), Stage.RUNNING,
     [NodeDone("v0", 0), Close(("v1",), terminate=False)]),
    # -- signals
    ("running", 1.0, Signalled("SIGUSR1"), Stage.RUNNING,
     [Info("forwarding SIGUSR1 to every node"), Send(Control.USR1, BOTH)]),
    ("running", 1.0, Signalled("SIGINT"), Stage.STOPPING,
     [Info(f"SIGINT: {STOPPING} (again to kill at once)"), Phase("tearing down"),
      Send(Control.TERM, BOTH)]),
    ("stopping", 1.5, Signalled("SIGTERM"), Stage.STOPPING, [Send(Control.KILL, BOTH)]),
    ("stopping", 1.5, Signalled("SIGUSR2"), Stage.STOPPING,
     [Info("forwarding SIGUSR2 to every node"), Send(Control.USR2, BOTH)]),
    # -- time: keepalive, watchdog, the teardown's deadlines (launch/teardown.py)
    ("running", 50.0, Tick(), Stage.RUNNING, []),
    ("running, keepalive 8", 1.0, Tick(), Stage.RUNNING, [Send(Control.PING, BOTH)]),
    ("running, hang 10", 19.0, Tick(), Stage.RUNNING, []),  # the start-up allowance runs
    ("running, hang 10", 100.0, Tick(), Stage.COLLECTING,
     [Info(NO_TRAINING), Send(Control.DUMP, BOTH)]),
    ("collecting", 100.0 + DUMP_COLLECT_S, Tick(), Stage.COLLECTING, []),
    ("collecting", 100.1 + DUMP_COLLECT_S, Tick(), Stage.STOPPING,
     [ReportStacks({}, summarize({}, 2)),
      Info("v0 failed (no progress: the watchdog's stack summary names it): " + STOPPING),
      Phase("tearing down"), Send(Control.TERM, BOTH)]),
    ("stopping", 1.0 + G + 2.0, Tick(), Stage.STOPPING, []),
    ("stopping", 1.0 + G + 2.1, Tick(), Stage.STOPPING, [Send(Control.KILL, BOTH)]),
    ("stopping, v1 ended", 1.0 + G + 4.1, Tick(), Stage.STOPPING,
     [Send(Control.KILL, ("v0",)), Close(("v0",), terminate=True)]),
    ("stopping", 1.0 + G + 15.1, Tick(), Stage.FINISHED,  # given up: dropped
     [Send(Control.KILL, BOTH), Close(BOTH, terminate=True)]),
    ("stopping", 2.0, AgentEnded("v1", 143), Stage.STOPPING, [NodeDone("v1", 143)]),
    # -- the end
    ("running", 5.0, AgentEnded("v1", 0), Stage.RUNNING, [NodeDone("v1", 0)]),
    ("finished", 5.0, Drained(), Stage.FINISHED, [Finish()]),
    ("finished, replicated", 5.0, Drained(), Stage.FINISHED,
     [Info("checkpoints replicated: global_step20 2/2"), Finish()]),
    ("finished after SIGINT", 2.0, Drained(), Stage.FINISHED, [Finish(("v1",))]),
]


@pytest.mark.parametrize(("state", "now", "event", "after", "actions"), TABLE,
                         ids=[f"{r[0]}-{type(r[2]).__name__}-{i}" for i, r in enumerate(TABLE)])
def test_transition(state: str, now: float, event: Event, after: Stage,
                    actions: list[Action]) -> None:
    rt = STATES[state]()
    assert rt.on(event, now) == actions
    assert rt.stage is after


def test_every_state_is_what_its_name_says() -> None:
    want = {"connecting": Stage.CONNECTING, "gate": Stage.GATE, "running": Stage.RUNNING,
            "collecting": Stage.COLLECTING, "stopping": Stage.STOPPING,
            "finished": Stage.FINISHED}
    for name, build in STATES.items():
        assert build().stage is want[name.split(",")[0].split(" after")[0]], name


def test_a_refused_gate_ends_with_exit_2_and_no_failure() -> None:
    rt = STATES["gate, v0 reported"]()
    acts = rt.on(Received("v1", protocol.Facts("v1", {**FACTS, "version": "3.10.1"})), 2.0)
    assert acts[0] == Phase("gate", "2/2 nodes") and acts[-1] == Send(Control.TERM, BOTH)
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
    assert rt.on(Signalled("SIGINT"), 1.2) == [Send(Control.KILL, BOTH)]
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
