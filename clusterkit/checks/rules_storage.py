"""Doctor's shared-storage rule (issue 32): a node-local checkpoint dir one filesystem
for several nodes (a home directory on NFS is the common case).

The facts come from :mod:`clusterkit.checks.doctor_storage` (each node writes a token into
its ``checkpoint.local_dir`` and lists the others', node/facts/gatefacts.py); the verdict on
them is the launch gate's (``node/facts/gatefacts.shared_verdict``), so doctor and the gate name the
same nodes with the same line. WARN in general (a job with ``--storage shared`` is fine);
FAIL with ``doctor --storage node-local``, as the gate refuses such a launch. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.rules_base import DoctorContext
from clusterkit.hostrange import fold
from clusterkit.node.contract import StorageKind
from clusterkit.node.facts.gatefacts import SHARED_FIX, shared_line, shared_verdict

CHECK = "storage.node-local"


def check_shared_dirs(tokens: Mapping[str, Mapping[str, object]], ctx: DoctorContext
                      ) -> list[Finding]:
    """``tokens``: host -> its gatefacts ``unshared`` fact ({dir: {"seen": [hosts]}} or
    {dir: {"error": why}}); hosts not probed (unreachable, no local_dir) are absent."""
    if ctx.storage == "shared":
        return []
    bad = Status.FAIL if ctx.storage == StorageKind.NODE_LOCAL else Status.WARN
    shared = {h: shared_line(path, fold(group)) for path, group in shared_verdict(
        {h: {"unshared": t} for h, t in tokens.items()}, ctx.hosts) for h in group}
    out = []
    for host in (h for h in ctx.hosts if h in tokens):
        errors = [str(r.get("error")) for r in tokens[host].values()
                  if isinstance(r, Mapping) and r.get("error")]
        if host in shared:
            out.append(Finding(CHECK, bad, host, shared[host], f"use {SHARED_FIX}"))
        elif errors:
            out.append(Finding(CHECK, Status.WARN, host,
                               f"cannot tell whether checkpoint.local_dir is this node's own: "
                               f"{errors[0]}", "make checkpoint.local_dir writable"))
        else:
            out.append(Finding(CHECK, Status.PASS, host,
                               f"checkpoint.local_dir {ctx.local_dirs.get(host, '')} is this "
                               "node's own (no other node sees it)"))
    return out
