"""What ``clusterkit sync`` left on the nodes, and whether its chain can form (doctor).

* :func:`read_manifests`: each node's synced directory against the manifest the sync
  wrote there (node/sync/store.check): its digest and the files that no longer match;
* :func:`probe_ports`: every node listens on the sync port as ``sync.chain serve`` would
  (node program ``sync.chain ports``); this machine connects to the first, each node to the
  next: which hop of the chain is blocked.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from clusterkit.errors import TransportError
from clusterkit.node.protocol import ProtocolError, answer_of
from clusterkit.remote.base import RemoteProcess, SSHTarget, Transport
from clusterkit.remote.fanout import fan_out
from clusterkit.ship import node_command
from clusterkit.sync.engine import DEFAULT_PORT, SyncNode

CHECK_TIMEOUT_S = 600.0
PORTS_TIMEOUT_S = 30.0  # a node's answer while probing the ports


def read_manifests(transport: Transport, nodes: Sequence[SyncNode], dest_dir: str | None = None,
                   *, digest: str | None = None, deep: bool = False,
                   env: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Each node's synced directory against its manifest (node/sync/store.check):
    ``{"state": ok|differs|other|no-manifest|absent|unreachable, "digest", "differ":
    [files], "files"}``; ``digest``: the source's, to tell ``other`` from ``ok``."""
    out: dict[str, dict[str, Any]] = {}

    def one(target: SSHTarget) -> Any:
        node = next(n for n in nodes if n.name == target.name)
        args = ["check", dest_dir or node.dest] + (["--digest", digest] if digest else []) \
            + (["--deep"] if deep else [])
        cmd = node_command(node.python, "sync.chain", args)
        res = transport.run(target, cmd.argv, stdin=cmd.stdin, timeout=CHECK_TIMEOUT_S, env=env)
        try:
            out[target.name] = answer_of(res.stdout)
        except ProtocolError:
            tail = (res.stderr.strip() or res.stdout.strip())[-300:]
            out[target.name] = {"state": "unreachable", "why": f"exit {res.exit_code}: {tail}"}
        return res

    group = fan_out([n.target for n in nodes], one, per_host_budget_s=CHECK_TIMEOUT_S + 60,
                    max_parallel=64)
    for r in group.failed:
        out.setdefault(r.host, {"state": "unreachable", "why": r.reason() or "failed"})
    return {n.name: out.get(n.name, {"state": "unreachable"}) for n in nodes}


def probe_ports(transport: Transport, nodes: Sequence[SyncNode], port: int = DEFAULT_PORT, *,
                env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Can each hop of the chain connect? Every node listens as ``sync.chain serve`` would
    (``sync.chain ports``); this machine connects to the first, each node to the next. Per
    hop ``"A -> B"``: "" when it connected, else why not (``"here -> node1"`` first)."""
    procs: dict[int, RemoteProcess] = {}
    lines: dict[int, Any] = {}
    out: dict[str, str] = {}
    try:
        for i, n in enumerate(nodes):
            cmd = node_command(n.python, "sync.chain", ["ports", str(port)])
            try:
                procs[i] = transport.start(n.target, cmd.argv, env=env)
                procs[i].write_stdin(cmd.stdin)
                lines[i] = _events(procs[i])
            except TransportError as exc:
                out[n.name] = f"not checked: {exc.kind}: {exc.message}"
        listening = {i: _next_event(lines[i]) for i in procs}
        ports = {i: int(ev["port"]) for i, ev in listening.items() if ev.get("ev") == "listening"}
        if 0 in ports:
            try:
                socket.create_connection((nodes[0].address, ports[0]), timeout=5.0).close()
                out[f"here -> {nodes[0].name}"] = ""
            except OSError as exc:
                out[f"here -> {nodes[0].name}"] = f"port {ports[0]}: {exc}"
        for i in range(len(nodes) - 1):
            if i in ports and i + 1 in ports:
                procs[i].write_stdin((json.dumps({"op": "connect", "address": nodes[i + 1].address,
                                                  "port": ports[i + 1]}) + "\n").encode())
                ev = _next_event(lines[i])
                why = "" if ev.get("ok") else f"port {ports[i + 1]}: {ev.get('why', 'no answer')}"
                out[f"{nodes[i].name} -> {nodes[i + 1].name}"] = why
    finally:
        for p in procs.values():
            with contextlib.suppress(TransportError, OSError):
                p.close_stdin()
            with contextlib.suppress(TimeoutError, TransportError):
                p.wait(timeout=10)
    return out


def _events(proc: RemoteProcess) -> queue.Queue[dict[str, Any]]:
    """The node program's JSON events, read by a thread ({} at its end)."""
    q: queue.Queue[dict[str, Any]] = queue.Queue()

    def read() -> None:
        for stream, line in proc.lines():
            if stream == "stdout" and line.startswith("{"):
                with contextlib.suppress(ValueError):
                    q.put(dict(json.loads(line)))
        q.put({})

    threading.Thread(target=read, daemon=True, name=f"clusterkit-ports-{proc.host}").start()
    return q


def _next_event(q: queue.Queue[dict[str, Any]]) -> dict[str, Any]:
    try:
        return q.get(timeout=PORTS_TIMEOUT_S)
    except queue.Empty:
        return {"why": f"no answer within {PORTS_TIMEOUT_S:g} s"}
