"""Doctor rules: the replicated Python environment (``nodes env``) and DeepSpeed's build locks.

:func:`env_parity` compares each node's record of its environment with the launcher's
own record of the same path (so it reads a file here: doctor.py calls it beside
``clusterkit_parity``); the verdict is node/facts/envfacts.py's ``env_problems``, the one
the launch gate gives. :func:`check_jit_locks` is a pure rule (``ALL_RULES``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.rules_base import DoctorContext, ok_nodes
from clusterkit.node.facts.envfacts import ENV_FIX, env_problems, env_state

SHOWN = 6  # differing packages/files named per node


def _names(items: list[str], more: int = 0) -> str:
    extra = len(items) - SHOWN + more
    return ", ".join(items[:SHOWN]) + (f" (+{extra} more)" if extra > 0 else "")


def differing_groups(node: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """The packages / top directories whose digests differ between two records."""
    a, b = node.get("groups") or {}, ours.get("groups") or {}
    return sorted(g for g in set(a) | set(b) if a.get(g) != b.get(g))


def env_parity(facts: Mapping[str, NodeFacts],
               here: Callable[[str], Mapping[str, Any]] = env_state) -> list[Finding]:
    """Each node's environment against the launcher's record of the same path."""
    nodes = [f for f in facts.values() if f.ok and f.env_state.get("prefix")]
    mine: dict[str, Mapping[str, Any]] = {}
    for f in nodes:
        prefix = str(f.env_state["prefix"])
        if prefix not in mine:
            mine[prefix] = here(prefix) or {}
    problems = env_problems({f.host: {"env": dict(f.env_state)} for f in nodes},
                            lambda p: dict(mine.get(p) or {}))
    out = []
    for f in nodes:
        st, prefix = f.env_state, str(f.env_state["prefix"])
        ours = mine.get(prefix) or {}
        changed = [str(c) for c in st.get("changed") or []]
        fix = ENV_FIX.format(prefix=prefix)
        if f.host in problems:
            groups = differing_groups(st, ours) if st.get("digest") else []
            what = f"; differs in {_names(groups)}" if groups else ""
            out.append(Finding("env.parity", Status.FAIL, f.host, problems[f.host] + what, fix))
        elif changed:
            out.append(Finding("env.parity", Status.FAIL, f.host,
                               f"environment {prefix}: {len(changed)} file(s) changed since it "
                               f"was replicated: {_names(changed)}", fix))
        elif ours.get("digest") and st.get("digest"):
            out.append(Finding("env.parity", Status.PASS, f.host,
                               f"environment {prefix} identical to the launcher's "
                               f"(digest {str(st['digest'])[:12]})"))
    return out


def check_jit_locks(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    """A JIT build's ``lock`` that no build holds: every DeepSpeed start on the node that
    needs this op waits in FileBaton.wait forever. Each lock's state is the node's own
    judgement (node/provision/jitops.locks, node/provision/buildowner.judge): ``held`` by a process there,
    ``building`` on the node its owner record names (a node sharing the directory), ``dead``
    (the record proves its builder gone), ``unknown`` (no holder, no record)."""
    out = []
    for f in ok_nodes(facts):
        for lk in f.jit_locks:
            path, age = str(lk.get("path")), float(lk.get("age_s") or 0)
            state = str(lk.get("state") or ("held" if lk.get("holders") else "unknown"))
            if state == "held":
                pids = ", ".join(str(p) for p in lk.get("holders") or [])
                out.append(Finding("jit.lock", Status.PASS, f.host,
                                   f"build lock {path} held by pid {pids} (a build runs)"))
            elif state == "building":
                out.append(Finding("jit.lock", Status.PASS, f.host,
                                   f"build lock {path}: {lk.get('why')} (a build runs; "
                                   "starts here wait for it)"))
            elif state == "dead":
                out.append(Finding(
                    "jit.lock", Status.FAIL, f.host,
                    f"stale DeepSpeed/torch build lock {path} ({age / 60:.0f} min old): "
                    f"{lk.get('why')}",
                    "the next `clusterkit launch`, `sbatch` job or `clusterkit nodes build-ops` "
                    f"removes it by itself (its record proves it dead); or `rm {path}`"))
            else:
                out.append(Finding(
                    "jit.lock", Status.FAIL, f.host,
                    f"stale DeepSpeed/torch build lock {path} ({age / 60:.0f} min old, no live "
                    "process here holds it and no builder recorded it): every rank that "
                    "builds this op waits in FileBaton.wait forever",
                    f"check that no build runs (here or on a node sharing this directory: "
                    f"`fuser {path}`, `ps aux | grep ninja`), then `rm {path}` (or "
                    "`clusterkit nodes build-ops --remove-stale-locks`); builds made by "
                    "`clusterkit nodes build-ops`, `launch` and `sbatch` record their node"))
    return out

