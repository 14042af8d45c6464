"""A node lost for good costs a recovery one connect timeout, not one per contact
(remote/unanswered.py; issue 31 follow-up). No test bed: a scripted transport that
records every dial."""

from __future__ import annotations

import io
import threading
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from clusterkit.errors import TransportError
from clusterkit.launch import run as run_mod
from clusterkit.launch.console import PlainSink
from clusterkit.launch.gate import GateNode, run_gate
from clusterkit.launch.outcome import JobOutcome
from clusterkit.launch.registry import Registry
from clusterkit.launch.run import LaunchSettings, launch
from clusterkit.node.facts.gatefacts import need_unshared
from clusterkit.remote import fanout
from clusterkit.remote.base import FileStat, RemoteProcess, SSHTarget, Transport
from clusterkit.remote.unanswered import NoRedial
from clusterkit.spec.job import JobOptions
from tests.fake_transport import FakeTransport, exits, fails, hangs, ok, targets, timeout
from tests.render_cases import plan_for

NODES = ["node1", "node2", "node3"]
HINT = "the host is down, firewalled, or the address is wrong"
NO_ANSWER = fails("timeout", "no answer from port 22 within 10s", HINT)
SEEN = time.mktime((2026, 11, 27, 9, 10, 26, 0, 0, -1))  # local 09:10:26
KNOWN = ("timeout: unreachable (no answer from port 22 within 10s, at 09:10:26; not "
         f"dialled again) — {HINT}")


class Recording(FakeTransport):
    """The fake transport with the single-host calls too: every one is a dial."""

    def start(self, target: SSHTarget, argv: Sequence[str], *,
              env: Mapping[str, str] | None = None) -> RemoteProcess:
        self.run(target, argv)
        return cast(RemoteProcess, types.SimpleNamespace(host=target.name))

    def stat(self, target: SSHTarget, path: str) -> FileStat | None:
        self.run(target, ["stat", path])
        return None

    def dials(self, host: str) -> int:
        return sum(1 for name, _, _ in self.calls if name == host)


def _memo(fake: FakeTransport) -> NoRedial:
    return NoRedial(cast(Transport, fake), clock=lambda: SEEN)


def test_a_node_that_did_not_answer_costs_the_sweep_and_both_gate_rounds_one_dial() -> None:
    """The launcher's three contacts after a lost node, in the order of a recovery: the
    teardown's sweep (a run_all), the gate round and its token round (run_gate with a
    node-local job's unshared-dir tokens): node2 is dialled once; the others every time,
    and the per-host results keep their order."""
    fake = Recording({**dict.fromkeys(NODES, ok("{}\n")), "node2": NO_ANSWER})
    dials = _memo(fake)
    sweep = dials.run_all(targets(NODES), ["stop"], timeout=20)
    assert [r.host for r in sweep] == NODES
    assert sweep["node2"].reason() == f"timeout: no answer from port 22 within 10s — {HINT}"
    gate = run_gate(cast(Transport, dials), [
        GateNode(n, "/usr/bin/python3", t, (need_unshared(f"/ckpt/{n}", "job", n),))
        for n, t in zip(NODES, targets(NODES), strict=True)])
    assert fake.dials("node2") == 1
    assert fake.dials("node1") == fake.dials("node3") == 3  # sweep, facts, tokens
    assert gate.problems["node2"] == KNOWN
    # The single-host calls get the known failure at once too, without a dial.
    for call in (lambda: dials.run(targets(["node2"])[0], ["true"]),
                 lambda: dials.start(targets(["node2"])[0], ["agent"]),
                 lambda: dials.stat(targets(["node2"])[0], "/ckpt")):
        with pytest.raises(TransportError) as info:
            call()
        assert info.value.host == "node2" and info.value.kind == "timeout"
        assert info.value.one_line() == "node2: " + KNOWN.removeprefix("timeout: ")
    assert fake.dials("node2") == 1


def test_the_next_attempt_dials_again() -> None:
    """The memory is one wrapper's: the next attempt's (or launch's) is empty, so a node
    that came back is reached."""
    script: dict[str, Any] = {**dict.fromkeys(NODES, ok()), "node2": NO_ANSWER}
    fake = Recording(script)
    first = _memo(fake)
    first.run_all(targets(NODES), ["sweep"])
    script["node2"] = ok()  # the partition healed
    assert not first.run_all(targets(NODES), ["gate"])["node2"].ok  # same recovery: known
    assert _memo(fake).run_all(targets(NODES), ["start"])["node2"].ok
    assert fake.dials("node2") == 2


@pytest.mark.parametrize("behaviour", [
    fails("refused", "connection refused on port 22"),
    fails("dropped", "the SSH connection dropped while the command ran"),
    fails("channel", "cannot open a session channel"),
    timeout(),  # the command ran past its timeout: the host answered
    exits(3, "boom"),
], ids=["refused", "dropped", "channel", "command-timeout", "exit"])
def test_only_no_answer_is_remembered(behaviour: Any) -> None:
    fake = Recording({"node1": ok(), "node2": behaviour})
    dials = _memo(fake)
    for _ in range(3):
        assert not dials.run_all(targets(["node1", "node2"]), ["x"])["node2"].ok
    assert fake.dials("node2") == 3


def test_the_fan_outs_overall_deadline_is_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host past the fan-out's deadline may have connected and hung in its command:
    it is not "no answer", and the next round dials it."""
    monkeypatch.setattr(fanout, "_SLACK_S", 0.0)
    release = threading.Event()
    fake = Recording({"node1": ok(), "node2": hangs(release)})
    dials = _memo(fake)
    try:
        group = dials.run_all(targets(["node1", "node2"]), ["x"], timeout=0.2)
        assert group["node2"].error is not None and group["node2"].error.kind == "timeout"
        assert "overall deadline" in group["node2"].error.message
        assert dials.known(targets(["node2"])[0]) is None
    finally:
        release.set()


def test_a_local_target_is_never_remembered() -> None:
    fake = Recording({"v1": NO_ANSWER})
    dials = _memo(fake)
    local = SSHTarget("v1", "127.0.0.1", local=True)
    for _ in range(2):
        with pytest.raises(TransportError):
            dials.run(local, ["true"])
    assert fake.dials("v1") == 2


def test_each_attempt_and_its_recovery_share_one_memory(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """launch(): the attempt's orchestrator (its agents' start, the sweep) and the
    restart's gate round after it get one NoRedial over the launch's transport; the next
    attempt a fresh one."""
    seen: list[tuple[str, object]] = []
    codes = iter([1, 0])

    class FakeOrchestrator:
        def __init__(self, _job: Any, transport: object, *_a: Any, **_k: Any) -> None:
            seen.append(("attempt", transport))

        def run(self) -> JobOutcome:
            return JobOutcome(exit_code=next(codes), failure=None, summary=None, node_codes={},
                              interrupted=False, elapsed_s=1.0)

    def restart(options: Any, plan: Any, _planner: Any, transport: object,
                *_a: Any) -> tuple[Any, Any]:
        seen.append(("restart", transport))
        return plan, options

    monkeypatch.setattr(run_mod, "Orchestrator", FakeOrchestrator)
    monkeypatch.setattr(run_mod, "_prepare_restart", restart)
    base = object()
    plan = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=2)
    result = launch(JobOptions(job_id=plan.job_id), lambda _o: plan, transport=cast(Transport, base),
                    registry=Registry(tmp_path), settings=LaunchSettings(relaunches=1),
                    sink=PlainSink(io.StringIO()), decisions=plan)
    assert result.exit_code == 0
    assert [what for what, _ in seen] == ["attempt", "restart", "attempt"]
    first, again, second = (t for _, t in seen)
    assert isinstance(first, NoRedial) and first.inner is base
    assert again is first
    assert isinstance(second, NoRedial) and second is not first and second.inner is base
