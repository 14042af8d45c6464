"""``clusterkit sync DIR`` as a whole: which nodes, where on each, what stays here, then
the engine (``clusterkit.sync.engine``; docs/sync.md). What the verb, ``launch --sync``,
``doctor --sync`` and :func:`clusterkit.api.sync` call; printing is the CLI's."""

from __future__ import annotations

import os
import posixpath
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clusterkit.errors import ClusterkitError
from clusterkit.hostrange import fold
from clusterkit.inventory import Host
from clusterkit.jobs.here import clusterkit_home
from clusterkit.sync.engine import DEFAULT_PORT, SyncNode, SyncOptions, sync_dir
from clusterkit.sync.source import load_ignore
from clusterkit.sync.types import Progress, SyncResult

if TYPE_CHECKING:
    from clusterkit.checks.doctor import DoctorReport
    from clusterkit.remote.base import Transport


@dataclass(frozen=True)
class SyncHooks:
    """What a caller hears while a sync runs (the CLI prints them; all optional)."""

    on_start: Callable[[str, int], None] | None = None  # (where, node count), before hashing
    on_progress: Callable[[Progress], None] | None = None
    on_note: Callable[[str], None] | None = None  # a note as it happens (also in notes)


def destination(src: str, host: Host, cwd: str, dest: str | None = None) -> str:
    """DIR's path relative to the launcher's cwd (or ``dest``), under the node's workdir."""
    base = posixpath.normpath(host.workdir or cwd)
    if dest is not None:
        path = posixpath.normpath(posixpath.join(base, dest))
        if path != base and not path.startswith(base.rstrip("/") + "/"):
            raise ClusterkitError(f"{dest} is outside the workdir {base}", key="--dest",
                                  host=host.name, hint="give a path under the workdir")
        return path
    rel = os.path.relpath(os.path.abspath(src), cwd)
    if rel.startswith(".."):
        rel = os.path.basename(os.path.abspath(src))  # outside the project: by its name
    return posixpath.normpath(posixpath.join(base, rel.replace(os.sep, "/")))


def check_source(src: str) -> None:
    if os.path.islink(src) and not os.path.exists(src):
        raise ClusterkitError("a symbolic link loop or a dangling link", path=src,
                              hint="pass the directory itself")
    if not os.path.isdir(src):
        raise ClusterkitError(f"{src} is not a directory", path=src,
                              hint="pass the directory to sync (default: .)")


def sync_hosts(src: str, hosts: Sequence[Host], *, delete: bool = False,
               exclude_from: str | None = None, cwd: str | None = None,
               dest: str | None = None, port: int | None = None,
               hooks: SyncHooks | None = None) -> SyncResult:
    """Sync ``src`` to ``hosts``: per-node results (``result.ok``); raises only for bad
    input (:func:`require_complete` is the verb's refusal of an incomplete sync)."""
    from clusterkit.remote.dispatch import transport_for
    from clusterkit.remote.openssh import with_openssh

    hooks = hooks or SyncHooks()
    check_source(src)
    if exclude_from is not None and not os.path.isfile(exclude_from):
        raise ClusterkitError("is a directory" if os.path.isdir(exclude_from) else "no such file",
                              path=exclude_from, key="--exclude-from",
                              hint="give a file of gitignore-style patterns")
    cwd = cwd or os.getcwd()
    nodes = sync_nodes(src, hosts, cwd, dest)
    ignore = load_ignore(src, exclude_from, _checkpoints_inside(hosts, nodes))
    dests = {n.dest for n in nodes}
    if hooks.on_start:
        hooks.on_start(dests.pop() if len(dests) == 1 else "each workdir", len(nodes))
    opts = SyncOptions(delete=delete, ignore=ignore, port=DEFAULT_PORT if port is None else port,
                       cache_dir=str(clusterkit_home() / "sync-cache"),
                       on_progress=hooks.on_progress, on_note=hooks.on_note)
    with transport_for() as transport:
        # The sessions over the system ssh where there is one: its handshakes run in C, in
        # parallel processes (paramiko's hold the GIL here, as doctor measured).
        return sync_dir(with_openssh(transport), nodes, src, options=opts)


def require_complete(result: SyncResult) -> None:
    """Raise (exit 2) unless every node holds the source's digest."""
    order = list(result.nodes)
    bad = [n for n in order if not result.node_ok(n)]
    if result.changed:
        raise ClusterkitError(f"{result.changed[0]} changed while it was sent"
                              + (f" (and {len(result.changed) - 1} more)"
                                 if len(result.changed) > 1 else "")
                              + ": the nodes refused it", hint="run sync again once it is "
                              "written (the other files are in place and stay)")
    if bad:
        raise ClusterkitError(f"sync incomplete on {len(bad)} of {len(order)} node(s): {fold(bad)}",
                              hint="see the lines above; run sync again to complete only what "
                              "is missing")


def sync_nodes(src: str, hosts: Sequence[Host], cwd: str, dest: str | None = None
               ) -> list[SyncNode]:
    from clusterkit.remote.base import target_for

    return [SyncNode(h.name, target_for(h), h.python or sys.executable, h.address,
                     destination(src, h, cwd, dest)) for h in hosts]


def doctor_sync_parity(report: DoctorReport, transport: Transport, src: str,
                       hosts: Sequence[Host]) -> DoctorReport:
    """``doctor --sync DIR``: one sync.parity finding per node (checks/rules_sync.py)."""
    from clusterkit.checks.rules_sync import add_sync_parity

    check_source(src)
    nodes = sync_nodes(src, hosts, os.getcwd())
    ignore = load_ignore(src, None, _checkpoints_inside(hosts, nodes))
    return add_sync_parity(report, transport, nodes, src, ignore,
                           cache_dir=str(clusterkit_home() / "sync-cache"))


def _checkpoints_inside(hosts: Sequence[Host], nodes: Sequence[SyncNode]) -> list[str]:
    """Checkpoint dirs that lie under a node's destination: never sent over, never deleted."""
    out = []
    for h, n in zip(hosts, nodes, strict=True):
        for d in (h.checkpoint.local_dir, h.checkpoint.shared_dir):
            rel = posixpath.relpath(d, n.dest) if d and d.startswith("/") else None
            if rel and not rel.startswith(".."):
                out.append(rel)
    return sorted(set(out))
