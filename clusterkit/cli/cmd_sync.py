"""``clusterkit sync [DIR]``: the code directory to the same path under every node's workdir."""

from __future__ import annotations

import argparse
import os
import posixpath
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import add_inventory_option, add_selection_options, resolve_inventory
from clusterkit.errors import ClusterkitError
from clusterkit.hostfile import select_hosts
from clusterkit.inventory import Host

if TYPE_CHECKING:
    from clusterkit.remote.sync import SyncNode


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sync", help="copy a code directory to every node's workdir (changed files only)",
        description="Copy DIR (default: .) to the same path under every selected node's "
        "workdir over SSH: only changed files move (size+mtime, then checksum), each is "
        "written atomically and verified. Files matching DIR/.clusterkitignore "
        "(gitignore-style) and .git/ stay here. See docs/sync.md.")
    p.add_argument("dir", nargs="?", default=".", metavar="DIR")
    add_inventory_option(p)
    add_selection_options(p)
    p.add_argument("--delete", action="store_true",
                   help="also delete files on the nodes that DIR does not have")
    p.add_argument("--exclude-from", metavar="FILE", type=nonempty,
                   help="more gitignore-style patterns (besides DIR/.clusterkitignore)")
    p.set_defaults(func=cmd_sync)


def destination(src: str, host: Host, cwd: str) -> str:
    """DIR's path relative to the launcher's cwd, under the node's workdir (same layout)."""
    rel = os.path.relpath(os.path.abspath(src), cwd)
    if rel.startswith(".."):
        rel = os.path.basename(os.path.abspath(src))  # outside the project: by its name
    base = host.workdir or cwd
    return posixpath.normpath(posixpath.join(base, rel.replace(os.sep, "/")))


def run_sync(src: str, hosts: Sequence[Host], *, delete: bool = False,
             exclude_from: str | None = None, cwd: str | None = None) -> int:
    """Sync ``src`` to ``hosts`` and print one folded line per outcome (used by launch --sync)."""
    from clusterkit.hostrange import folded_lines
    from clusterkit.remote.base import target_for
    from clusterkit.remote.dispatch import transport_for
    from clusterkit.remote.sync import SyncNode, load_ignore, manifest, sync_all

    if not os.path.isdir(src):
        raise ClusterkitError(f"{src} is not a directory", path=src,
                              hint="pass the code directory to sync (default: .)")
    if exclude_from is not None and not os.path.isfile(exclude_from):
        raise ClusterkitError("is a directory" if os.path.isdir(exclude_from) else "no such file",
                              path=exclude_from, key="--exclude-from",
                              hint="give a file of gitignore-style patterns")
    cwd = cwd or os.getcwd()
    nodes = [SyncNode(h.name, target_for(h), h.python or sys.executable,
                      destination(src, h, cwd)) for h in hosts]
    ignore = load_ignore(src, exclude_from, _checkpoints_inside(hosts, nodes))
    files = manifest(src, ignore)
    dests = {n.dest for n in nodes}
    print(f"sync {src} ({len(files)} files) -> {dests.pop() if len(dests) == 1 else 'each workdir'}"
          f" on {len(nodes)} node(s)", file=sys.stderr)
    with transport_for() as transport:
        results, group = sync_all(transport, nodes, files, delete=delete, ignore=ignore)
    order = [n.name for n in nodes]
    for line in folded_lines(((n, r.summary()) for n, r in results.items()), order):
        print(f"  {line}")
    group.raise_on_failure("sync")
    return 0


def _checkpoints_inside(hosts: Sequence[Host], nodes: Sequence[SyncNode]) -> list[str]:
    """Checkpoint dirs that lie under a node's destination: never sent over, never deleted."""
    out = []
    for h, n in zip(hosts, nodes, strict=True):
        for d in (h.checkpoint.local_dir, h.checkpoint.shared_dir):
            rel = posixpath.relpath(d, n.dest) if d and d.startswith("/") else None
            if rel and not rel.startswith(".."):
                out.append(rel)
    return sorted(set(out))


def cmd_sync(args: argparse.Namespace) -> int:
    inv = resolve_inventory(args.inventory)
    chosen = select_hosts(inv, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                          include=args.include, exclude=args.exclude)
    return run_sync(args.dir, [h for h, _ in chosen], delete=args.delete,
                    exclude_from=args.exclude_from)
