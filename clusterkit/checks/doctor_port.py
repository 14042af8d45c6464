"""doctor's master-port phase: the listener on the master and each node's connect.

The probes connect to the master's listener at the end of their own run (one SSH
session per node); ``master_port_findings`` adds the listener's bind result, asks
the nodes that gave up too early once more, and checks that every hello arrived.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from clusterkit.checks.doctor_plan import DoctorPlan, NodeProbe
from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import (
    Finding,
    Status,
)
from clusterkit.checks.invoke import (
    ProbeOutputError,
    connect_argv,
    listen_argv,
    parse_probe_stdout,
    probe_source,
)
from clusterkit.checks.rules_ssh import check_master_port
from clusterkit.errors import TransportError
from clusterkit.remote.base import CommandResult, RemoteProcess, SSHTarget, Transport
from clusterkit.remote.fanout import fan_out

CONNECT_TIMEOUT_S = 3.0  # one TCP connect to the master port
LISTEN_SECONDS = 120.0  # upper bound; the listener ends when doctor closes its channel
LISTEN_READY_TIMEOUT_S = 20.0
HELLO_GRACE_S = 3.0  # wait this long for hellos still in flight after the facts phase


def probe_budget(plan: DoctorPlan, command_timeout: float) -> float:
    # TCP + banner + kex + auth (the SSH transport's worst case) plus the command.
    return 4 * plan.connect_timeout_s + command_timeout


def master_port_findings(plan: DoctorPlan, transport: Transport, listener: Listener,
                         facts: Mapping[str, NodeFacts],
                         connects: Mapping[str, Mapping[str, Any]],
                         stats: dict[str, float] | None = None) -> list[Finding]:
    """The listener's bind result plus each node's connect result (from its probe)."""
    master, port = plan.master, plan.master_port
    assert master is not None and port is not None
    check = f"port:{port}"
    if not facts[master.host].ok:
        return [Finding(check, Status.FAIL, master.host,
                        "master port not checked: the master node is unreachable",
                        "fix the master's SSH first (see the ssh finding)")]
    listen = listener.bind_result(LISTEN_READY_TIMEOUT_S)
    if not listen.get("bound"):
        return check_master_port(master.host, port, listen or None, {})
    late = [n for n in plan.nodes if connects.get(n.host, {}).get("error_kind") == "refused"]
    if stats is not None:
        stats["port_retry_nodes"] = float(len(late))  # a second SSH round for these
    if late:
        # The listener came up after these probes stopped retrying (a slow login shell
        # on the master): ask them once more, now that it listens. Costs a round only here.
        connects = {**connects, **_connect_again(plan, transport, late, master.address, port)}
    reached = {h for h, r in connects.items() if r.get("ok")}
    names = {h: facts[h].hostname or h for h in reached}
    arrived = listener.wait_hellos(set(names.values()), HELLO_GRACE_S)
    findings = check_master_port(master.host, port, listen, connects)
    for host in sorted(reached, key=plan.ctx.hosts.index):
        if names[host] not in arrived:
            findings.append(Finding(
                check, Status.WARN, host,
                f"connected to {master.address}:{port}, but the master's listener never saw "
                "this node (another process or host answered)",
                "check that the master address points at the master node"))
    return findings


def _connect_again(plan: DoctorPlan, transport: Transport, nodes: Sequence[NodeProbe],
                   addr: str, port: int) -> dict[str, Mapping[str, Any]]:
    by_name = {n.host: n for n in nodes}
    timeout = CONNECT_TIMEOUT_S + 15

    def work(target: SSHTarget) -> CommandResult:
        node = by_name[target.name]
        return transport.run(target, connect_argv(node.python, addr, port, CONNECT_TIMEOUT_S),
                             timeout=timeout, stdin=probe_source())

    group = fan_out([n.target for n in nodes], work,
                    per_host_budget_s=probe_budget(plan, timeout), max_parallel=plan.max_parallel)
    out: dict[str, Mapping[str, Any]] = {}
    for hr in group:
        if hr.result is None:
            continue  # keep the probe's own answer
        try:
            out[hr.host] = parse_probe_stdout(hr.result.stdout)
        except ProbeOutputError:
            continue
    return out


class Listener:
    """The ``listen`` probe on the master, started in the background; its JSON lines
    (ready / hello / result) are collected by a reader thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: dict[str, Any] | None = None  # ready line, or the bind-failure result
        self._hellos: set[str] = set()
        self._done = False
        self._proc: RemoteProcess | None = None
        self._closed = False

    @classmethod
    def start_async(cls, transport: Transport, master: NodeProbe, port: int) -> Listener:
        self = cls()
        threading.Thread(target=self._run, args=(transport, master, port), daemon=True,
                         name="doctor-listener").start()
        return self

    def _run(self, transport: Transport, master: NodeProbe, port: int) -> None:
        try:
            proc = transport.start(master.target, listen_argv(master.python, port,
                                                              LISTEN_SECONDS))
            with self._cond:
                self._proc = proc
                closed = self._closed
            if closed:
                proc.terminate()
                return
            proc.write_stdin(probe_source())
            proc.close_stdin()
            for stream, line in proc.lines():
                if stream == "stdout" and line.strip().startswith("{"):
                    self._on_line(line)
        except (TransportError, OSError) as exc:
            self._set_ready({"bound": False, "error": f"listener not started: {exc}"})
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _on_line(self, line: str) -> None:
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            return
        event = data.get("event")
        if event == "ready":
            self._set_ready({"bound": True, **data})
        elif event == "result" and not data.get("bound"):
            self._set_ready(data)
        elif event == "hello" and data.get("hello"):
            with self._cond:
                self._hellos.add(str(data["hello"]))
                self._cond.notify_all()

    def _set_ready(self, data: dict[str, Any]) -> None:
        with self._cond:
            if self._ready is None:
                self._ready = data
            self._cond.notify_all()

    def bind_result(self, timeout: float) -> dict[str, Any]:
        with self._cond:
            self._cond.wait_for(lambda: self._ready is not None or self._done, timeout)
            return dict(self._ready or {})

    def wait_hellos(self, expected: set[str], timeout: float) -> set[str]:
        with self._cond:
            self._cond.wait_for(lambda: expected <= self._hellos or self._done, timeout)
            return set(self._hellos)

    def close(self) -> None:
        """Close the channel: the listener sees its stdout go away and exits at once."""
        with self._cond:
            self._closed = True
            proc = self._proc
        if proc is not None:
            proc.terminate()
