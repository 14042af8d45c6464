"""``clusterkit nodes build-ops``: DeepSpeed's JIT ops built once per node, before a job.

Each node runs the node program :mod:`clusterkit.node.jitops` (``build``) with the
job's interpreter and environment, so the op lands where the job's ranks look
(``TORCH_EXTENSIONS_DIR`` from the inventory's env, else the user's
``~/.cache/torch_extensions``). One process per node builds each op: the ranks that
start later find it built, so they never race one build and a job killed while it
starts cannot leave a half-built op's lock behind. A stale lock found first is a
refusal naming its path, unless ``remove_stale``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.errors import TransportError
from clusterkit.node.ship import node_command
from clusterkit.remote.base import CommandResult, SSHTarget, Transport
from clusterkit.remote.fanout import fan_out
from clusterkit.remote.install import node_json

BUILD_TIMEOUT_S = 1800.0  # a CUDA op builds for minutes on a busy node


@dataclass(frozen=True)
class OpsNode:
    name: str
    target: SSHTarget
    python: str  # the job's interpreter
    env: Mapping[str, str] = field(default_factory=dict)


def summary(out: Mapping[str, Any]) -> str:
    """One line per node without its name (equal lines fold)."""
    parts = []
    for op, r in (out.get("ops") or {}).items():
        state = r.get("state")
        parts.append(f"{op} built" if state == "built" else f"{op} {state} ({r.get('why')})")
    removed = out.get("removed") or []
    if removed:
        parts.append(f"removed {len(removed)} stale lock(s): {', '.join(removed)}")
    return f"{out.get('accelerator')}: " + ("; ".join(parts) or "no op to build")


def build_node(transport: Transport, node: OpsNode, request: Mapping[str, Any]) -> dict[str, Any]:
    cmd = node_command(node.python, "jitops", ["build"],
                       payload=(json.dumps(dict(request)) + "\n").encode())
    res = transport.run(node.target, cmd.argv, stdin=cmd.stdin, timeout=BUILD_TIMEOUT_S,
                        env=dict(node.env) or None)
    out = node_json(res, node.name, "building ops", "build-ops")
    if out.get("error"):
        raise TransportError(f"building ops failed: {out['error']}", kind="build-ops",
                             host=node.name, hint="deepspeed must be importable by the "
                                                  "inventory's python (`clusterkit nodes env`)")
    stale = out.get("stale") or []
    if stale:
        paths = ", ".join(str(lk.get("path")) for lk in stale)
        raise TransportError(f"stale build lock {paths} (no live process holds it): every "
                             "DeepSpeed start here would wait on it", kind="build-ops",
                             host=node.name, hint=f"check that no build runs, then rm {paths} "
                                                  "(or --remove-stale-locks)")
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
