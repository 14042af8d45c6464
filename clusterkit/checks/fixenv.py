"""``clusterkit doctor --fix-env``: the settings the facts support, merged into ``.deepspeed_env``."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import TYPE_CHECKING

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.rules_names import VIRTUAL_IFACE_PREFIXES
from clusterkit.node.facts.parity import majority
from clusterkit.plan.ifaces import cluster_env

if TYPE_CHECKING:
    from clusterkit.checks.doctor import DoctorReport


def recommended_env(report: DoctorReport) -> dict[str, str]:
    """NCCL/GLOO interface (exact match) and PATH with the interpreter's bin dir.

    Only what the facts support: no interface when the nodes disagree on its name
    (NCCL then gets the exact list, gloo nothing), no PATH when no node answered.
    """
    nodes = [f for f in report.facts.values() if f.ok]
    out: dict[str, str] = {}
    ifaces = {f.host: i for f in nodes if (i := _peer_iface(f))}
    out.update(cluster_env(ifaces))  # the plan's rule for doctor's pick (plan/ifaces.py)
    pythons = {f.host: f.python_executable for f in nodes if f.python_executable}
    if pythons:
        python = majority(pythons, report.hosts)
        if python and "/" in python:
            out["PATH"] = f"{posixpath.dirname(python)}:$PATH"
    return out


def _peer_iface(f: NodeFacts) -> str | None:
    own = {a for addrs in f.interfaces.values() for a in addrs}
    used = {i for a, i in f.routes.items() if i and a not in own and not a.startswith("127.")}
    if len(used) == 1:
        return used.pop()
    real = [i for i, a in f.interfaces.items() if a and not i.startswith(VIRTUAL_IFACE_PREFIXES)]
    return real[0] if len(real) == 1 else None


def merge_env_file(existing: str, updates: Mapping[str, str]) -> str:
    """``.deepspeed_env`` text with ``updates`` set: other lines kept in order, ours replaced.

    The format is DeepSpeed's (``KEY=VALUE`` per line, split at the first ``=``);
    blank and comment lines are dropped because DeepSpeed's runner crashes on them.
    """
    lines: list[str] = []
    seen: set[str] = set()
    for raw in existing.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key = line.split("=", 1)[0].strip()
        if key in updates:
            if key not in seen:
                lines.append(f"{key}={updates[key]}")
                seen.add(key)
            continue
        lines.append(line)
    lines += [f"{k}={v}" for k, v in updates.items() if k not in seen]
    return "".join(f"{line}\n" for line in lines)
