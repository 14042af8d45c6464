"""``clusterkit sync [DIR]``: a directory of any size to the same path under every node's
workdir, node to node at the link's rate (docs/sync.md). Parsing and printing only: the
sync is ``clusterkit.api.sync`` (``jobs/sync.py``, the engine in ``clusterkit/sync/``)."""

from __future__ import annotations

import argparse

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import (
    add_inventory_option,
    add_selection_options,
    resolve_inventory,
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sync", help="copy a directory (code, model, data) to every node's workdir",
        description="Copy DIR (default: .) to the same path under every selected node's "
        "workdir: node to node in a pipelined chain (about size/rate whatever the number "
        "of nodes), only what a node lacks (sha256 per file and per 64 MiB chunk), each "
        "chunk verified on arrival and each file renamed into place when complete; a cut "
        "short run resumes. Files matching DIR/.clusterkitignore (gitignore-style) and "
        ".git/ stay here. See docs/sync.md.")
    p.add_argument("dir", nargs="?", default=".", metavar="DIR", type=nonempty)
    add_inventory_option(p)
    add_selection_options(p)
    p.add_argument("--delete", action="store_true",
                   help="also delete files on the nodes that DIR does not have (only in a "
                   "directory an earlier sync filled)")
    p.add_argument("--exclude-from", metavar="FILE", type=nonempty,
                   help="more gitignore-style patterns (besides DIR/.clusterkitignore)")
    p.add_argument("--dest", metavar="PATH", type=nonempty,
                   help="where under each node's workdir (default: DIR's path relative "
                   "to the current directory)")
    p.add_argument("--port", type=int, metavar="P", default=None,
                   help="first TCP port the nodes listen on for the chain (default 29640; "
                   "16 tried)")
    p.add_argument("--json", action="store_true",
                   help="progress and the result as JSON lines on stdout")
    p.set_defaults(func=cmd_sync)


def cmd_sync(args: argparse.Namespace) -> int:
    from clusterkit import api
    from clusterkit.cli.syncshow import Shower, report

    show = Shower(args.json, args.dir)
    result = api.sync(args.dir, inventory=resolve_inventory(args.inventory), nodes=args.nodes,
                      gpus_per_node=args.gpus_per_node, include=args.include,
                      exclude=args.exclude, delete=args.delete, exclude_from=args.exclude_from,
                      dest=args.dest, port=args.port, hooks=show.hooks())
    show.close()
    report(result, args.json, shown=show.shown)
    return 0
