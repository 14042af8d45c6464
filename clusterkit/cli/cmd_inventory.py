"""clusterkit inventory show|validate|import-hostfile|export-hostfile."""

from __future__ import annotations

import argparse
import json
import sys

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import add_inventory_option, add_selection_options, resolve_inventory
from clusterkit.errors import InventoryError
from clusterkit.fsutil import atomic_write_text, check_writable
from clusterkit.hostfile import (
    inventory_pool,
    inventory_yaml_from_hostfile,
    parse_hostfile,
    render_hostfile,
    select,
)
from clusterkit.hostrange import fold
from clusterkit.inventory import Inventory, parse_inventory


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inventory", help="show, validate, import or export the inventory")
    verbs = p.add_subparsers(dest="inventory_verb", metavar="VERB", required=True)

    show = verbs.add_parser("show", help="print the hosts as a table (or --json)")
    add_inventory_option(show)
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=cmd_show)

    validate = verbs.add_parser("validate", help="check the inventory and exit 0/2")
    add_inventory_option(validate)
    validate.set_defaults(func=cmd_validate)

    imp = verbs.add_parser("import-hostfile", help="turn a DeepSpeed hostfile into an inventory")
    imp.add_argument("hostfile", metavar="FILE")
    imp.add_argument("-o", "--out", metavar="FILE", type=nonempty,
                     help="write here (atomically) instead of stdout")
    imp.add_argument("--cpu", action="store_true",
                     help="the slots are CPU ranks, not GPUs (default: slots=N means N GPUs)")
    imp.set_defaults(func=cmd_import)

    exp = verbs.add_parser("export-hostfile", help="print a DeepSpeed hostfile for the inventory")
    add_inventory_option(exp)
    add_selection_options(exp)
    exp.add_argument("-o", "--out", metavar="FILE", type=nonempty,
                     help="write here (atomically) instead of stdout")
    exp.set_defaults(func=cmd_export)


def _summary(inv: Inventory) -> str:
    slots = sum(h.slots for h in inv.hosts if h.name not in inv.spares)
    spares = (f" + spare{'s' * (len(inv.spares) > 1)} {fold(inv.spares)} (never selected)"
              if inv.spares else "")
    return f"{inv.name}: {len(inv.hosts)} hosts ({fold(inv.names())}), {slots} slots{spares}"


def cmd_show(args: argparse.Namespace) -> int:
    inv = resolve_inventory(args.inventory)
    if args.json:
        print(json.dumps(inv.to_dict(), indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=_summary(inv), title_justify="left")
    for col in ("host", "address", "via", "slots", "gpus", "python", "workdir", "checkpoints"):
        table.add_column(col)
    for h in inv.hosts:
        via = "local" if h.transport == "local" else _ssh_label(h.ssh.user, h.ssh.port, h.ssh.proxy_jump)
        dirs = (("local", h.checkpoint.local_dir), ("shared", h.checkpoint.shared_dir))
        ckpt = ", ".join(f"{k}={v}" for k, v in dirs if v)
        gpus = f"{h.gpus}× {h.gpu_model}" if h.gpus and h.gpu_model else str(h.gpus)
        # a spare is never selected: launch --replace runs a lost host's ranks on it
        name = f"{h.name} (spare)" if h.name in inv.spares else h.name
        table.add_row(name, h.address, via, str(h.slots), gpus, h.python or "(launcher's)",
                      h.workdir or "(launcher's cwd)", ckpt or "-")
    # Piped output is read by people in logs: do not squeeze it to 80 columns.
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def _ssh_label(user: str | None, port: int | None, jump: str | None) -> str:
    label = f"ssh {user or '(default user)'} port {port or 22}"
    return f"{label} via {jump}" if jump else label


def cmd_validate(args: argparse.Namespace) -> int:
    inv = resolve_inventory(args.inventory)
    print(f"ok: {_summary(inv)}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, "-o")  # like cp: an existing directory, a file name
    try:
        with open(args.hostfile, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise InventoryError(f"cannot read hostfile: {exc.strerror}", path=args.hostfile) from None
    yaml_text = inventory_yaml_from_hostfile(parse_hostfile(text, args.hostfile), args.hostfile,
                                             cpu=args.cpu)
    parse_inventory(yaml_text, args.out or "<imported>")  # never emit something we cannot read back
    if args.out:
        atomic_write_text(args.out, yaml_text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(yaml_text)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, "-o")
    inv = resolve_inventory(args.inventory)
    chosen = select(inventory_pool(inv), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                    include=args.include, exclude=args.exclude)
    text = render_hostfile(chosen)
    if args.out:
        atomic_write_text(args.out, text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
