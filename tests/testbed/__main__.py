"""``python -m tests.testbed up|status|exec|down`` — the test bed for humans.

Examples::

    python -m tests.testbed up 7              # prints ssh config + inventory paths
    python -m tests.testbed exec node3 -- ip -br addr
    python -m tests.testbed status
    python -m tests.testbed down --all
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence

from tests.testbed.core import MAX_NODES, Testbed, down_all, down_prefix
from tests.testbed.sysutil import TestbedError, alive


def _pick(prefix: str | None) -> Testbed:
    if prefix is not None:
        return Testbed.load(prefix)
    prefixes = Testbed.list_prefixes()
    if len(prefixes) == 1:
        return Testbed.load(prefixes[0])
    if not prefixes:
        raise TestbedError("no test bed is up", hint="python -m tests.testbed up 7")
    raise TestbedError(f"several test beds are up ({', '.join(prefixes)})",
                       hint="choose one with --prefix")


def cmd_up(args: argparse.Namespace) -> int:
    started = time.monotonic()
    if args.prefix is not None and args.prefix in Testbed.list_prefixes():
        tb = Testbed.load(args.prefix)  # grow an existing one
    else:
        tb = Testbed.create(args.prefix, persistent=True, mask_bashrc=args.mask_bashrc,
                            auto_down=False, user=args.user)
    try:
        tb.ensure(args.nodes)
        tb.write_inventory(tb.inventory_path, slots=args.slots)
    except BaseException:
        tb.down()
        raise
    nodes = tb.nodes
    first, last = nodes[0].name, nodes[-1].name
    print(f"test bed {tb.prefix}: {len(nodes)} nodes up in {time.monotonic() - started:.1f} s "
          f"({tb.subnet}, host at {tb.bridge_address} on {tb.bridge})")
    print(f"  ssh config : {tb.ssh_config}")
    print(f"  inventory  : {tb.inventory_path}")
    print(f"  shared dir : {tb.shared_dir}   node-local dir: {tb.local_mountpoint}")
    print(f"  try        : ssh -F {tb.ssh_config} {first} hostname")
    print(f"               PDSH_SSH_ARGS_APPEND='-F {tb.ssh_config}' "
          f"pdsh -R ssh -w {nodes[0].name[:-len(str(nodes[0].index))]}"
          f"[{nodes[0].index}-{nodes[-1].index}] hostname")
    print(f"               python -m tests.testbed exec {last} -- ssh {first} hostname")
    if tb.user is not None:
        u = tb.user
        user_inv = tb.write_inventory(u.home / "inventory.yaml", slots=args.slots, as_user=True)
        print(f"  user       : {u.name} (uid {u.uid}) on every node, home {u.home}")
        print(f"  its inventory: {user_inv}")
        print(f"  as the user: unshare --mount --propagation private -- /bin/bash "
              f"tests/testbed/as_user.sh {tb.root} {u.name} ssh {first} id")
    print(f"  tear down  : python -m tests.testbed down --prefix {tb.prefix}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    prefixes = [args.prefix] if args.prefix else Testbed.list_prefixes()
    if not prefixes:
        print("no test bed is up")
    for prefix in prefixes:
        tb = Testbed.load(prefix)
        nodes = tb.nodes
        up = [n for n in nodes if alive(n.pid, n.pid_start)]
        print(f"{prefix}: {len(up)}/{len(nodes)} nodes running, {tb.subnet}, root {tb.root}")
        for n in nodes:
            state = "running" if n in up else "DOWN"
            print(f"  {n.name:<8} {n.address:<15} netns {n.netns:<22} init pid {n.pid:<7} {state}")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise TestbedError("no command given", hint="exec NODE -- CMD ...")
    tb = _pick(args.prefix)
    # Output streams straight to the terminal; no capture, no timeout (a human is watching).
    return subprocess.call([*tb._nsenter(args.node, None), *argv])


def cmd_down(args: argparse.Namespace) -> int:
    if args.all:
        gone = down_all()
        print(f"removed {len(gone)} test bed(s){': ' + ', '.join(gone) if gone else ''}")
        return 0
    # An explicit --prefix also works with a missing/broken state file (leftovers).
    prefix = args.prefix if args.prefix is not None else _pick(None).prefix
    if down_prefix(prefix):
        print(f"removed test bed {prefix}")
    else:
        print(f"nothing to remove for test bed {prefix}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.testbed",
                                     description="namespace test bed of real SSH nodes")
    sub = parser.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="bring up (or grow) a test bed")
    up.add_argument("nodes", type=int, help=f"number of nodes (1-{MAX_NODES})")
    up.add_argument("--prefix", help="test bed name (default: tb<K>)")
    up.add_argument("--slots", type=int, default=2, help="slots per node in the inventory")
    up.add_argument("--user", metavar="NAME", default=None,
                    help="also an unprivileged user NAME on every node (docs/testbed.md)")
    up.add_argument("--mask-bashrc", action="store_true",
                    help="hide root's ~/.bashrc inside nodes (saves ~90 ms per ssh command)")
    up.set_defaults(func=cmd_up)
    st = sub.add_parser("status", help="list test beds and their nodes")
    st.add_argument("--prefix")
    st.set_defaults(func=cmd_status)
    ex = sub.add_parser("exec", help="run a command inside a node (no ssh)")
    ex.add_argument("--prefix")
    ex.add_argument("node")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    ex.set_defaults(func=cmd_exec)
    dn = sub.add_parser("down", help="tear a test bed down")
    group = dn.add_mutually_exclusive_group()
    group.add_argument("--prefix")
    group.add_argument("--all", action="store_true", help="every cktb-* test bed on this host")
    dn.set_defaults(func=cmd_down)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TestbedError as exc:
        print(f"testbed: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("testbed: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
