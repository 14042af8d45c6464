"""``clusterkit nodes build-ops``: DeepSpeed's JIT ops built once per node, before a job.

Each node runs the node program :mod:`clusterkit.node.provision.jitops` (``build``) with the
job's interpreter and environment, so the op lands where the job's ranks look
(``TORCH_EXTENSIONS_DIR`` from the inventory's env, else the user's
``~/.cache/torch_extensions``). One process per node builds each op: the ranks that
start later find it built, so they never race one build and a job killed while it
starts cannot leave a half-built op's lock behind. A stale lock found first is a
refusal naming its path, unless ``remove_stale``.

``clusterkit launch`` does the same before its agents start (:func:`ready_ops`): one cheap
``check`` per node (files only, no deepspeed import), then a build only on the nodes
that miss an op, all at once; a stale lock or a failed build refuses that node.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.errors import TransportError
from clusterkit.hostrange import fold
from clusterkit.node.provision.jitops import OP_NAMES, describe
from clusterkit.provision.install import node_json
from clusterkit.remote.base import CommandResult, SSHTarget, Transport
from clusterkit.remote.fanout import fan_out
from clusterkit.ship import node_command

BUILD_TIMEOUT_S = 1800.0  # a CUDA op builds for minutes on a busy node
CHECK_TIMEOUT_S = 30.0  # a Python start and a few stat()s


@dataclass(frozen=True)
class OpsNode:
    name: str
    target: SSHTarget
    python: str  # the job's interpreter
    env: Mapping[str, str] = field(default_factory=dict)


def summary(out: Mapping[str, Any]) -> str:
    """One line per node without its name (equal lines fold): node/provision/jitops.describe, the
    line the batch script's build step prints too."""
    return describe(dict(out))


def _stale_error(node: str, stale: Sequence[Mapping[str, Any]], also: str) -> TransportError:
    paths = ", ".join(str(lk.get("path")) for lk in stale)
    return TransportError(f"stale build lock {paths} (no live process holds it): every "
                          "DeepSpeed start there would wait on it", kind="build-ops",
                          host=node, hint=f"check that no build runs, then rm {paths} "
                                          f"(or {also})")


def build_node(transport: Transport, node: OpsNode, request: Mapping[str, Any]) -> dict[str, Any]:
    cmd = node_command(node.python, "provision.jitops", ["build"],
                       payload=(json.dumps(dict(request)) + "\n").encode())
    res = transport.run(node.target, cmd.argv, stdin=cmd.stdin, timeout=BUILD_TIMEOUT_S,
                        env=dict(node.env) or None)
    out = node_json(res, node.name, "building ops", "build-ops")
    if out.get("error"):
        raise TransportError(f"building ops failed: {out['error']}", kind="build-ops",
                             host=node.name, hint="deepspeed must be importable by the "
                                                  "inventory's python (`clusterkit nodes env`)")
    if out.get("stale"):
        raise _stale_error(node.name, out["stale"], "--remove-stale-locks")
    failed = {op: r for op, r in (out.get("ops") or {}).items() if r.get("state") == "failed"}
    if failed:
        op, r = next(iter(failed.items()))
        raise TransportError(f"{op} failed to build: {r.get('why')}", kind="build-ops",
                             host=node.name, hint="`doctor` checks ninja and CUDA_HOME")
    return dict(out)


def build_all(transport: Transport, nodes: Sequence[OpsNode], request: Mapping[str, Any], *,
              max_parallel: int = 64) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every node at once (one build per node); results and node -> why it failed."""
    results: dict[str, dict[str, Any]] = {}
    by_name = {n.name: n for n in nodes}

    def work(target: SSHTarget) -> CommandResult:
        results[target.name] = build_node(transport, by_name[target.name], request)
        return CommandResult(target.name, ("build-ops",), 0, "", "", 0.0)

    group = fan_out([n.target for n in nodes], work, per_host_budget_s=BUILD_TIMEOUT_S + 60,
                    max_parallel=max_parallel)
    return results, {r.host: r.reason() or "failed" for r in group.failed}


# ----------------------------------------------------------------------------- at launch


def check_node(transport: Transport, node: OpsNode, ops: Sequence[str]) -> dict[str, Any]:
    """The node's ``provision.jitops check`` answer; raises on a stale build lock there."""
    cmd = node_command(node.python, "provision.jitops", ["check"],
                       payload=(json.dumps({"ops": list(ops)}) + "\n").encode())
    res = transport.run(node.target, cmd.argv, stdin=cmd.stdin, timeout=CHECK_TIMEOUT_S,
                        env=dict(node.env) or None)
    out = node_json(res, node.name, "checking the JIT ops", "build-ops")
    if out.get("error"):
        raise TransportError(f"checking the JIT ops failed: {out['error']}", kind="build-ops",
                             host=node.name)
    if out.get("stale"):
        raise _stale_error(node.name, out["stale"],
                           "`clusterkit nodes build-ops --remove-stale-locks`")
    return dict(out)


def missing(check: Mapping[str, Any]) -> list[str]:
    """The builders a node's ranks would build at start (not ``built`` there). Pure."""
    if not check.get("deepspeed"):
        return []  # no deepspeed there: the gate says so when the job needs it
    return [op for op, state in (check.get("ops") or {}).items() if state != "built"]


@dataclass
class OpsReport:
    """What :func:`ready_ops` found and did, per node, in the plan's order."""

    order: list[str]
    needed: dict[str, list[str]] = field(default_factory=dict)  # node -> builders missing
    seconds: dict[str, float] = field(default_factory=dict)  # node -> its build's wall time
    refused: dict[str, str] = field(default_factory=dict)  # node -> why (folds)

    def names(self, node: str) -> str:
        return ", ".join(OP_NAMES.get(op, op) for op in self.needed[node])

    def line(self, *, dry_run: bool = False) -> str:
        """``deepspeed_shm_comm built on node[1-4] (38 s); already built on node[5-7]``."""
        groups: dict[str, list[str]] = {}
        for node in self.order:
            if node in self.needed and node not in self.refused:
                groups.setdefault(self.names(node), []).append(node)
        verb = "would be built" if dry_run else "built"
        parts = []
        for names, nodes in groups.items():
            took = "" if dry_run else f" ({max(self.seconds.get(n, 0.0) for n in nodes):.0f} s)"
            parts.append(f"{names} {verb} on {fold(nodes)}{took}")
        ready = [n for n in self.order if n not in self.needed and n not in self.refused]
        if ready:
            parts.append(f"already built on {fold(ready)}")
        return "DeepSpeed's JIT ops: " + "; ".join(parts)


def ready_ops(transport: Transport, nodes: Sequence[OpsNode], ops: Mapping[str, Sequence[str]], *,
              build: bool = True, max_parallel: int = 64) -> OpsReport:
    """Every node checked at once; where an op is missing (and ``build``), built there by
    one process per node, all such nodes at once. Never stops at a node's failure."""
    report = OpsReport([n.name for n in nodes])
    nodes = [n for n in nodes if ops.get(n.name)]
    by_name = {n.name: n for n in nodes}

    def look(target: SSHTarget) -> CommandResult:
        need = missing(check_node(transport, by_name[target.name], ops.get(target.name, ())))
        if need:
            report.needed[target.name] = need
        return CommandResult(target.name, ("provision.jitops", "check"), 0, "", "", 0.0)

    def make(target: SSHTarget) -> CommandResult:
        t0 = time.monotonic()
        build_node(transport, by_name[target.name],
                   {"ops": report.needed[target.name], "ds_config": {}})
        report.seconds[target.name] = time.monotonic() - t0
        return CommandResult(target.name, ("provision.jitops", "build"), 0, "", "", 0.0)

    checked = fan_out([n.target for n in nodes], look, per_host_budget_s=CHECK_TIMEOUT_S + 10,
                      max_parallel=max_parallel)
    report.refused.update({r.host: r.reason() or "failed" for r in checked.failed})
    todo = [by_name[n].target for n in report.order if n in report.needed
            and n not in report.refused]
    if build and todo:
        built = fan_out(todo, make, per_host_budget_s=BUILD_TIMEOUT_S + 60,
                        max_parallel=max_parallel)
        report.refused.update({r.host: r.reason() or "failed" for r in built.failed})
    return report
