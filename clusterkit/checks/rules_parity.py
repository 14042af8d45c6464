"""Doctor rules: environment parity (interpreter, versions, pip freeze) and the workdir.

The package table and the parity rule are node/facts/parity.py's, which the launch gate
uses too: the same facts get the same verdict from both."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.rules_base import (
    DoctorContext,
    ok_nodes,
    parity,
    python_of,
)
from clusterkit.hostrange import fold
from clusterkit.launchers.base import DoctorMode
from clusterkit.node.facts.parity import MUST, PACKAGES, SHOULD, majority

# Doctor modes whose launcher runs its own sys.executable on every node: DeepSpeed's
# runner from the launching machine or from node 0 (DoctorMode.same_python).
SAME_PYTHON_BACKENDS = tuple(m for m in DoctorMode if m.same_python)


# ----------------------------------------------------------------------------- environment parity


def check_interpreter(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    values = {f.host: f.python_executable or "?" for f in ok_nodes(facts)}
    bad = Status.FAIL if ctx.backend.same_python else Status.WARN
    why = (" (the DeepSpeed runner starts its own sys.executable on every node)"
           if bad is Status.FAIL else "")
    out = parity("python.path", "interpreter", values, ctx, bad,
                 lambda h, common: f"use the same absolute interpreter path on every node "
                                   f"(e.g. a venv at {common}){why}")
    if ctx.head_python and bad is Status.FAIL and values:
        for host, path in values.items():
            if path != ctx.head_python:
                out.append(Finding("python.head", Status.FAIL, host,
                                   f"interpreter {path} ≠ launcher's {ctx.head_python}",
                                   f"create {ctx.head_python} on this node or launch from "
                                   f"an interpreter at {path}"))
    return out


# The packages compared across nodes and what a mismatch is: the one table
# (node/facts/parity.py), whose MUST packages the launch gate refuses on.
_VERSION_CHECKS: tuple[tuple[str, Status], ...] = tuple(
    (pkg, Status.FAIL if kind == MUST else Status.WARN)
    for pkg, kind in PACKAGES.items() if kind in (MUST, SHOULD))


def check_versions(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    nodes = ok_nodes(facts)
    out = parity("version.python", "python", {f.host: f.python_version for f in nodes}, ctx,
                 Status.FAIL, lambda h, v: f"recreate the environment with Python {v}")
    for pkg, severity in _VERSION_CHECKS:
        values = {f.host: f.versions.get(pkg) for f in nodes}
        if not any(values.values()):
            continue  # nobody has it: nothing to compare

        def fix(host: str, want: str | None, pkg: str = pkg) -> str:
            if want is None:
                return f"{python_of(facts, host)} -m pip uninstall {pkg}"
            return f"{python_of(facts, host)} -m pip install '{pkg}=={want}'"

        out += parity(f"version.{pkg}", pkg, values, ctx, severity, fix)
    with_torch = [f for f in nodes if f.versions.get("torch")]
    out += parity("version.torch-cuda", "torch CUDA", {f.host: f.torch_cuda or "cpu"
                                                        for f in with_torch}, ctx, Status.FAIL,
                  lambda h, v: f"install the torch build for CUDA {v} "
                               f"(same --index-url as the other nodes)")
    nccl = {f.host: f.nccl_version for f in with_torch}
    if any(nccl.values()):
        out += parity("version.nccl", "NCCL", nccl, ctx, Status.FAIL,
                      lambda h, v: f"install the same NCCL ({v}), e.g. the torch wheel's "
                                   f"nvidia-nccl-cu* pin")
    return out


def _freeze_map(items: Iterable[str]) -> dict[str, str]:
    pairs = (i.split("==", 1) for i in items if "==" in i)
    return {name: ver for name, ver in pairs}


def check_freeze(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    nodes = [f for f in ok_nodes(facts) if f.freeze]
    if not nodes:
        return []
    sets = {f.host: f.freeze for f in nodes}
    common = majority(sets, ctx.hosts)
    holders = fold(h for h in ctx.hosts if sets.get(h) == common)
    first = next((h for h in ctx.hosts if sets.get(h) == common), holders)
    want = _freeze_map(common)
    out = []
    for f in nodes:
        if f.freeze == common:
            out.append(Finding("pip.freeze", Status.PASS, f.host,
                               f"same {len(common)} packages as {holders}"))
            continue
        have = _freeze_map(f.freeze)
        diffs = ([f"{n} {have[n]}≠{want[n]}" for n in sorted(want) if n in have
                  and have[n] != want[n]]
                 + [f"{n} missing" for n in sorted(want) if n not in have]
                 + [f"+{n} {have[n]}" for n in sorted(have) if n not in want])
        shown = ", ".join(diffs[:8]) + (f" (+{len(diffs) - 8} more)" if len(diffs) > 8 else "")
        out.append(Finding("pip.freeze", Status.WARN, f.host,
                           f"{len(diffs)} package(s) differ from {holders}: {shown}",
                           f"`pip freeze` on {first} > req.txt, then "
                           f"`{python_of(facts, f.host)} -m pip install -r req.txt` here"))
    return out


def check_workdir(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in ok_nodes(facts):
        if f.workdir is None:
            continue
        if not f.workdir_exists:
            out.append(Finding("workdir", Status.FAIL, f.host, f"{f.workdir} does not exist",
                               "the launcher does `cd <workdir>` on every node: create it or "
                               "sync the code there (same path on all nodes)"))
        elif not f.workdir_writable:
            out.append(Finding("workdir", Status.WARN, f.host, f"{f.workdir} is not writable",
                               "fix ownership/permissions (logs and .deepspeed_env go there)"))
        else:
            out.append(Finding("workdir", Status.PASS, f.host, f"{f.workdir} exists"))
    return out
