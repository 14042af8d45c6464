"""``clusterkit sync [DIR]``: a directory of any size to the same path under every node's
workdir, node to node at the link's rate (clusterkit.remote.distribute; docs/sync.md)."""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import (
    add_inventory_option,
    add_selection_options,
    resolve_inventory,
)
from clusterkit.errors import ClusterkitError
from clusterkit.hostfile import select_hosts
from clusterkit.inventory import Host
from clusterkit.jobs.here import clusterkit_home

if TYPE_CHECKING:
    from clusterkit.checks.doctor import DoctorReport
    from clusterkit.remote.base import Transport
    from clusterkit.remote.distribute import DistNode
    from clusterkit.remote.disttypes import DistributeResult, Progress


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


def run_sync(src: str, hosts: Sequence[Host], *, delete: bool = False,
             exclude_from: str | None = None, cwd: str | None = None, dest: str | None = None,
             port: int | None = None, as_json: bool = False) -> DistributeResult:
    """Sync ``src`` to ``hosts``; print the progress and one folded line per outcome
    (also ``launch --sync``). Raises (exit 2) unless every node holds the source's digest."""
    from clusterkit.remote.dispatch import transport_for
    from clusterkit.remote.distribute import DEFAULT_PORT, DistOptions, distribute
    from clusterkit.remote.openssh import with_openssh
    from clusterkit.remote.sync import load_ignore

    check_source(src)
    if exclude_from is not None and not os.path.isfile(exclude_from):
        raise ClusterkitError("is a directory" if os.path.isdir(exclude_from) else "no such file",
                              path=exclude_from, key="--exclude-from",
                              hint="give a file of gitignore-style patterns")
    cwd = cwd or os.getcwd()
    nodes = dist_nodes(src, hosts, cwd, dest)
    ignore = load_ignore(src, exclude_from, _checkpoints_inside(hosts, nodes))
    dests = {n.dest for n in nodes}
    where = dests.pop() if len(dests) == 1 else "each workdir"
    if not as_json:
        print(f"sync {src} -> {where} on {len(nodes)} node(s)", file=sys.stderr)
    show = Shower(as_json)
    opts = DistOptions(delete=delete, ignore=ignore, port=DEFAULT_PORT if port is None else port,
                       cache_dir=str(clusterkit_home() / "sync-cache"), on_progress=show,
                       on_note=show.note)
    with transport_for() as transport:
        # The sessions over the system ssh where there is one: its handshakes run in C, in
        # parallel processes (paramiko's hold the GIL here, as doctor measured).
        result = distribute(with_openssh(transport), nodes, src, options=opts)
    show.close()
    report(result, [n.name for n in nodes], as_json, shown=show.shown)
    return result


def dist_nodes(src: str, hosts: Sequence[Host], cwd: str, dest: str | None = None
               ) -> list[DistNode]:
    from clusterkit.remote.base import target_for
    from clusterkit.remote.distribute import DistNode

    return [DistNode(h.name, target_for(h), h.python or sys.executable, h.address,
                     destination(src, h, cwd, dest)) for h in hosts]


class Shower:
    """Progress on stderr: one line rewritten in place on a terminal, else every 10 s."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.width = 0
        self.shown: list[str] = []  # notes said as they happened (not again at the end)

    def note(self, text: str) -> None:
        """A note as it happens (e.g. a node fed over SSH): said once, on stderr."""
        if self.as_json:
            return
        self.close()
        self.width = 0
        print(f"  note: {text}", file=sys.stderr, flush=True)
        self.shown.append(text)

    def __call__(self, p: Progress) -> None:
        from clusterkit.remote.distplan import progress_line

        if self.as_json:
            print(json.dumps({"event": "progress", "elapsed_s": round(p.elapsed_s, 1),
                              "sent": p.sent, "nodes": {v.name: [v.got, v.need, v.state]
                                                        for v in p.views}}), flush=True)
            return
        line = progress_line(p.views, p.elapsed_s, p.sent)
        if self.tty:
            sys.stderr.write("\r" + line[:200].ljust(self.width))
            self.width = min(200, len(line))
            sys.stderr.flush()
        elif p.elapsed_s - self.last >= 10:
            self.last = p.elapsed_s
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and self.width and not self.as_json:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


def report(result: DistributeResult, order: Sequence[str], as_json: bool,
           shown: Sequence[str] = ()) -> None:
    """The end: one folded line per outcome (or one JSON object); exit 2 unless all is well."""
    from clusterkit.hostrange import fold, folded_lines
    from clusterkit.remote.distplan import fmt_bytes

    bad = [n for n in order if not result.node_ok(n)]
    if as_json:
        print(json.dumps({"event": "done", "ok": result.ok, "digest": result.digest,
                          "files": result.files, "bytes": result.total_bytes,
                          "sent_from_here": result.sent_bytes, "seconds": round(result.seconds, 2),
                          "chains": result.chains, "notes": result.notes,
                          "changed": result.changed, "links": result.links,
                          "nodes": {n: vars(r) for n, r in result.nodes.items()}}), flush=True)
    else:
        for note in result.notes:
            if note not in shown:
                print(f"  note: {note}")
        for line in folded_lines(((n, r.summary()) for n, r in result.nodes.items()), order):
            print(f"  {line}")
        if result.links:
            print(f"  note: {len(result.links)} symbolic link(s) not copied: "
                  + ", ".join(result.links[:3]) + (" ..." if len(result.links) > 3 else ""))
        rate = result.sent_bytes / result.seconds if result.seconds else 0.0
        print(f"  {result.files} file(s), {fmt_bytes(result.total_bytes)}, digest "
              f"{result.digest[:12]}; {fmt_bytes(result.sent_bytes)} sent from here in "
              f"{result.seconds:.1f} s ({fmt_bytes(rate)}/s)", file=sys.stderr)
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


def doctor_sync_parity(report: DoctorReport, transport: Transport, src: str,
                       hosts: Sequence[Host]) -> DoctorReport:
    """``doctor --sync DIR``: one sync.parity finding per node (checks/rules_sync.py)."""
    from clusterkit.checks.rules_sync import add_sync_parity
    from clusterkit.remote.sync import load_ignore

    check_source(src)
    nodes = dist_nodes(src, hosts, os.getcwd())
    ignore = load_ignore(src, None, _checkpoints_inside(hosts, nodes))
    return add_sync_parity(report, transport, nodes, src, ignore,
                           cache_dir=str(clusterkit_home() / "sync-cache"))


def _checkpoints_inside(hosts: Sequence[Host], nodes: Sequence[DistNode]) -> list[str]:
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
    run_sync(args.dir, [h for h, _ in chosen], delete=args.delete,
             exclude_from=args.exclude_from, dest=args.dest, port=args.port, as_json=args.json)
    return 0
