"""``clusterkit nodes install``: the bundled workload's code on every selected node."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import add_inventory_option, add_selection_options, resolve_inventory
from clusterkit.hostfile import select_hosts


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("nodes", help="manage clusterkit on the nodes (install)")
    verbs = p.add_subparsers(dest="nodes_verb", metavar="VERB", required=True)
    inst = verbs.add_parser(
        "install", help="install this exact clusterkit (a local wheel) into every node's python",
        description="Build a wheel of this clusterkit here (offline) and install it into the "
        "inventory's python on every selected node over SSH with pip --no-index --no-deps. "
        "Needed only for the bundled workload (python -m clusterkit.workload); launch, doctor "
        "and collect-ckpt need nothing but a Python on the nodes. Idempotent. See docs/sync.md.")
    add_inventory_option(inst)
    add_selection_options(inst)
    inst.add_argument("--wheel", metavar="FILE", type=nonempty,
                      help="install this wheel instead of building one")
    inst.set_defaults(func=cmd_install)


def cmd_install(args: argparse.Namespace) -> int:
    from clusterkit.hostrange import folded_lines
    from clusterkit.remote.base import target_for
    from clusterkit.remote.dispatch import transport_for
    from clusterkit.remote.install import InstallNode, check_wheel, install_all

    if args.wheel:
        check_wheel(Path(args.wheel))  # before any node is asked
    inv = resolve_inventory(args.inventory)
    chosen = select_hosts(inv, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                          include=args.include, exclude=args.exclude)
    nodes = [InstallNode(h.name, target_for(h), h.python or sys.executable) for h, _ in chosen]
    print(f"installing clusterkit on {len(nodes)} node(s)"
          + (f" from {args.wheel}" if args.wheel else " (wheel built here, offline)"),
          file=sys.stderr)
    with transport_for() as transport:
        results, group = install_all(transport, nodes, Path(args.wheel) if args.wheel else None)
    for line in folded_lines(((n, r.summary()) for n, r in results.items()),
                             [n.name for n in nodes]):
        print(f"  {line}")
    group.raise_on_failure("nodes install")
    return 0
