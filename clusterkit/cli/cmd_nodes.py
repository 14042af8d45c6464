"""``clusterkit nodes install|env|build-ops``: clusterkit, the Python environment and
DeepSpeed's JIT ops on every selected node (docs/sync.md, docs/getting-nodes-ready.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import add_inventory_option, add_selection_options, resolve_inventory
from clusterkit.errors import ClusterkitError
from clusterkit.hostfile import select_hosts
from clusterkit.inventory import Host


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


def _selected(args: argparse.Namespace) -> list[tuple[Host, list[int]]]:
    """The inventory's hosts the selection options chose, in rank order."""
    inv = resolve_inventory(args.inventory)
    return list(select_hosts(inv, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                             include=args.include, exclude=args.exclude))


def cmd_install(args: argparse.Namespace) -> int:
    from clusterkit.hostrange import folded_lines
    from clusterkit.provision.install import InstallNode, check_wheel, install_all
    from clusterkit.remote.base import target_for
    from clusterkit.remote.dispatch import transport_for

    if args.wheel:
        check_wheel(Path(args.wheel))  # before any node is asked
    chosen = _selected(args)
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


def cmd_env(args: argparse.Namespace) -> int:
    from clusterkit.cli.syncshow import Shower
    from clusterkit.hostrange import folded_lines
    from clusterkit.jobs.here import clusterkit_home
    from clusterkit.provision.envcopy import EnvNode, describe_local, distribute_transfer, replicate
    from clusterkit.remote.base import target_for
    from clusterkit.remote.dispatch import transport_for
    from clusterkit.remote.openssh import with_openssh

    chosen = _selected(args)
    source = describe_local(args.python)  # an editable tree that cannot travel: refused here
    nodes = [EnvNode(h.name, target_for(h), args.node_python, h.address, dict(h.env))
             for h, _ in chosen]
    print(f"environment {source.prefix} (Python {source.python_version}) -> "
          f"{len(nodes)} node(s), at the same path:", file=sys.stderr)
    for part in source.parts:
        how = "" if part.copy else " (the OS's: checked, not copied)"
        print(f"  {part.role}: {part.path}{how}", file=sys.stderr)
    cache = str(clusterkit_home() / "sync-cache")
    show = Shower(False)  # clusterkit sync's progress line, for each part that travels
    with transport_for() as transport:
        results = replicate(with_openssh(transport), nodes, source, transfer=lambda t, ns, part:
                            distribute_transfer(t, ns, part, cache_dir=cache, on_progress=show))
    show.close()
    order = [n.name for n in nodes]
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
    from clusterkit.hostrange import folded_lines
    from clusterkit.provision.jitbuild import OpsNode, build_all, summary
    from clusterkit.remote.base import target_for
    from clusterkit.remote.dispatch import transport_for

    request = {"ops": list(args.op), "ds_config": _ds_config(args.ds_config),
               "remove_stale": args.remove_stale_locks}
    chosen = _selected(args)
    nodes = [OpsNode(h.name, target_for(h), h.python or sys.executable, dict(h.env))
             for h, _ in chosen]
    print(f"building DeepSpeed's JIT ops on {len(nodes)} node(s)", file=sys.stderr)
    with transport_for() as transport:
        results, failed = build_all(transport, nodes, request)
    order = [n.name for n in nodes]
    for line in folded_lines(((n, summary(r)) for n, r in results.items()), order):
        print(f"  {line}")
    if failed:
        raise ClusterkitError(
            f"nodes build-ops: {len(failed)} of {len(nodes)} node(s) failed: "
            + "; ".join(folded_lines(failed.items(), order)),
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
