"""``clusterkit nodes install|env|build-ops``: clusterkit, the Python environment and
DeepSpeed's JIT ops on every selected node (docs/sync.md, docs/getting-nodes-ready.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import add_inventory_option, add_selection_options, resolve_inventory
from clusterkit.errors import ClusterkitError
from clusterkit.hostfile import select_hosts
from clusterkit.provision.envcopy import EnvSource
from clusterkit.provision.jitbuild import summary


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("nodes", help="get the nodes ready (install, env, build-ops)")
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
    env = verbs.add_parser(
        "env", help="make every node's Python environment equal this one (offline, verified)",
        description="Copy this interpreter's environment (sys.prefix; the base interpreter "
        "when it is a venv; editable installs' source trees) to the same absolute path on "
        "every selected node, through clusterkit sync's transfer, and verify it file by "
        "file: afterwards its digest is equal everywhere (doctor and the launch gate compare "
        "it). Refused per node, before any byte moves: another CPU architecture, an older "
        "glibc, a path that exists and is no environment. See docs/getting-nodes-ready.md.")
    add_inventory_option(env)
    add_selection_options(env)
    env.add_argument("--python", metavar="PY", type=nonempty,
                     help="the job's interpreter whose environment travels (default: the one "
                          "running clusterkit)")
    env.add_argument("--node-python", default="python3", metavar="PY",
                     help="a Python 3.8+ that already exists on the nodes, to run the "
                          "copy's node side (default: python3 on the remote PATH)")
    env.set_defaults(func=cmd_env)
    ops = verbs.add_parser(
        "build-ops", help="build DeepSpeed's JIT ops once per node, before a job",
        description="On every selected node, with the inventory's python and env, build the "
        "DeepSpeed ops a job JIT-builds at start (from --ds-config's optimizer and offload, "
        "plus --op; default: the bundled workload's), one process per node: ranks that start "
        "later find them built, so they never race one build and a killed start leaves no "
        "build lock behind. A stale lock is refused with its path. See "
        "docs/getting-nodes-ready.md.")
    add_inventory_option(ops)
    add_selection_options(ops)
    ops.add_argument("--ds-config", metavar="FILE", type=nonempty,
                     help="the job's DeepSpeed config (JSON): its optimizer decides the ops")
    ops.add_argument("--op", action="append", default=[], metavar="BUILDER",
                     help="an op builder's class name too, e.g. CPUAdamBuilder (repeatable)")
    ops.add_argument("--remove-stale-locks", action="store_true",
                     help="remove build locks no live process on the node holds (check first "
                          "that no node sharing the directory builds right now)")
    ops.set_defaults(func=cmd_build_ops)


def _selection(args: argparse.Namespace) -> dict[str, Any]:
    """The inventory and the selection options, as the API takes them."""
    return {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
            "include": args.include, "exclude": args.exclude}


def cmd_install(args: argparse.Namespace) -> int:
    from clusterkit.api import install_nodes
    from clusterkit.hostrange import folded_lines

    inv = resolve_inventory(args.inventory)
    chosen = [h.name for h, _ in select_hosts(inv, **_selection(args))]

    def announce(count: int) -> None:
        print(f"installing clusterkit on {count} node(s)"
              + (f" from {args.wheel}" if args.wheel else " (wheel built here, offline)"),
              file=sys.stderr)

    done = install_nodes(inv, wheel=args.wheel, announce=announce, **_selection(args))
    for line in folded_lines(((n, r.summary()) for n, r in done.nodes.items()), chosen):
        print(f"  {line}")
    done.group.raise_on_failure("nodes install")
    return 0


def _announce(source: EnvSource, count: int) -> None:
    print(f"environment {source.prefix} (Python {source.python_version}) -> "
          f"{count} node(s), at the same path:", file=sys.stderr)
    for part in source.parts:
        how = "" if part.copy else " (the OS's: checked, not copied)"
        print(f"  {part.role}: {part.path}{how}", file=sys.stderr)


def cmd_env(args: argparse.Namespace) -> int:
    from clusterkit.api import copy_env
    from clusterkit.cli.syncshow import Shower
    from clusterkit.hostrange import folded_lines

    inv = resolve_inventory(args.inventory)
    order = [h.name for h, _ in select_hosts(inv, **_selection(args))]
    show = Shower(False)  # clusterkit sync's progress line, for each part that travels
    results = copy_env(inv, python=args.python, node_python=args.node_python,
                       announce=_announce, on_progress=show, **_selection(args))
    show.close()
    good = {n: r for n, r in results.items() if not r.error}
    for line in folded_lines(((n, r.summary()) for n, r in good.items()), order):
        print(f"  {line}")
    for line in folded_lines(((n, w) for n, r in results.items() for w in r.warnings), order):
        print(f"  warning: {line}")
    note = driver_note({n: r.facts.get("driver") for n, r in results.items()}, order)
    if note:
        print(f"  note: {note}")
    bad = folded_lines(((n, r.error) for n, r in results.items() if r.error), order)
    if bad:
        raise ClusterkitError(
            f"nodes env: {len(results) - len(good)} of {len(results)} node(s) do not hold the "
            "environment: " + "; ".join(bad),
            hint="fix what the line says (or --exclude NODE) and run it again: nodes that "
                 "already hold it are left alone")
    return 0


def _ds_config(path: str | None) -> dict[str, object] | None:
    import json

    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ClusterkitError(f"cannot read it as JSON ({exc})", path=path, key="--ds-config",
                              hint="give the job's DeepSpeed config file (JSON)") from None
    if not isinstance(data, dict):
        raise ClusterkitError("is not a JSON object", path=path, key="--ds-config",
                              hint="give the job's DeepSpeed config file (JSON)")
    return data


def cmd_build_ops(args: argparse.Namespace) -> int:
    from clusterkit.api import build_ops
    from clusterkit.hostrange import folded_lines

    ds_config = _ds_config(args.ds_config)  # before any node is asked
    inv = resolve_inventory(args.inventory)
    order = [h.name for h, _ in select_hosts(inv, **_selection(args))]
    print(f"building DeepSpeed's JIT ops on {len(order)} node(s)", file=sys.stderr)
    built = build_ops(inv, ops=args.op, ds_config=ds_config,
                      remove_stale_locks=args.remove_stale_locks, **_selection(args))
    for line in folded_lines(((n, summary(r)) for n, r in built.nodes.items()), order):
        print(f"  {line}")
    if built.failed:
        raise ClusterkitError(
            f"nodes build-ops: {len(built.failed)} of {len(order)} node(s) failed: "
            + "; ".join(folded_lines(built.failed.items(), order)),
            hint="fix what the line says and run it again (built ops are kept)")
    return 0


def driver_note(drivers: dict[str, object], order: list[str]) -> str | None:
    """GPU drivers are the OS's, not the environment's: say when the nodes' differ."""
    from clusterkit.hostrange import fold_by_text

    known = {n: str(v) for n, v in drivers.items() if v}
    if len(set(known.values())) < 2:
        return None
    rows = fold_by_text(((n, v) for n, v in known.items()), order)
    return ("GPU drivers differ (" + ", ".join(f"{v} on {hosts}" for hosts, v in rows)
            + "): not part of the environment, not copied; install one driver everywhere "
              "(doctor's gpu.driver check)")
