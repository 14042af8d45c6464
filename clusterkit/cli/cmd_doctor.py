"""clusterkit doctor: pre-flight checks on every selected node (docs/doctor.md)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import (
    add_inventory_option,
    add_selection_options,
    resolve_inventory,
)
from clusterkit.cli.jobflags import job_id_type
from clusterkit.errors import ClusterkitError
from clusterkit.fsutil import check_writable
from clusterkit.launchers import BACKENDS, DEFAULT_LAUNCHER
from clusterkit.node.contract import StorageKind
from clusterkit.remote.base import DEFAULT_CONNECT_TIMEOUT_S
from clusterkit.units import duration_type, parse_size, size_type  # the one size rule

if TYPE_CHECKING:
    from clusterkit.checks.doctor import DoctorReport
    from clusterkit.inventory import Host
    from clusterkit.jobs.doctor import DoctorResult, ExtraCheck
    from clusterkit.remote.base import Transport

# The checks (clusterkit.api -> jobs/doctor.py) are imported when doctor runs, not when
# the parser is built: `clusterkit --help` builds every verb's parser.
BANDWIDTH_SIZE = "4M"  # --bandwidth's message size unless --bandwidth-size says otherwise
_STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="pre-flight checks on every node",
                       description="Check every selected node in parallel (one SSH session "
                       "each): SSH, interpreter and package parity, toolchain, names, "
                       "interfaces, NCCL env, GPUs, disk, limits, clocks and the master port.")
    add_inventory_option(p)
    add_selection_options(p)
    # The launcher and port `clusterkit launch` will use (clusterkit.launchers, spec.ports).
    p.add_argument("--launcher", "--backend", dest="backend", choices=tuple(BACKENDS),
                   default=DEFAULT_LAUNCHER,
                   help=f"how the job will be launched, as `clusterkit launch --launcher` "
                   f"(default {DEFAULT_LAUNCHER}; deepspeed = DeepSpeed's runner over pdsh: "
                   "identical interpreter paths and pdsh on the first node required)")
    p.add_argument("--job-id", metavar="JOB", type=job_id_type,
                   help="test the master port `clusterkit launch --job-id JOB` will use")
    p.add_argument("--master-port", type=int, default=None, metavar="P",
                   help="port to test on the master instead (0 skips); default: the port launch "
                   "derives from --job-id, else from the inventory name (both in 20000-32767)")
    p.add_argument("--ckpt-size", metavar="SIZE", type=size_type("--ckpt-size"),
                   help="expected size of one checkpoint per node (e.g. 40G = 40GiB; "
                        "docs/units.md): checks free space")
    p.add_argument("--replicas", metavar="K", type=int, default=None,
                   help="checkpoint replicas each node-local dir also holds (--ckpt-size "
                        "counts 1+K there); default: the inventory's checkpoint.replicas, "
                        "else 1 where the job would be node-local (docs/lost-a-node.md)")
    p.add_argument("--storage", choices=(StorageKind.NODE_LOCAL.value, StorageKind.SHARED.value),
                   default=None,
                   help="the job's checkpoint storage, as `clusterkit launch --storage`: "
                        "node-local FAILs a checkpoint.local_dir that several nodes share "
                        "(default: WARN), shared skips that check")
    p.add_argument("--bandwidth", action="store_true",
                   help="also run a short all_reduce and pairwise tests (needs torch on nodes)")
    p.add_argument("--bandwidth-size", default=None, metavar="SIZE",
                   type=size_type("--bandwidth-size", minimum=1),
                   help=f"message size for --bandwidth (default {BANDWIDTH_SIZE})")
    p.add_argument("--sync", metavar="DIR", type=nonempty, default=None,
                   help="also check that every node holds DIR as `clusterkit sync DIR` put it "
                   "there (names the node and the files that differ; docs/sync.md)")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings")
    p.add_argument("-v", "--verbose", action="store_true", help="also list every passed check")
    p.add_argument("--fix-env", metavar="FILE", type=nonempty,
                   help="write the recommended NCCL/GLOO interface and PATH into this "
                   ".deepspeed_env-format file (atomically; other lines kept)")
    p.add_argument("--accept-new-host-keys", action="store_true",
                   help="add unknown host keys to known_hosts (never changed ones)")
    p.add_argument("--connect-timeout", type=duration_type("--connect-timeout", zero=False),
                   default=DEFAULT_CONNECT_TIMEOUT_S, metavar="S",
                   help=f"SSH connect timeout per node (default {DEFAULT_CONNECT_TIMEOUT_S:g}; "
                   "30s, 1m: docs/units.md)")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from clusterkit import api

    if args.bandwidth_size is not None and not args.bandwidth:  # would be ignored silently
        raise ClusterkitError("only goes with --bandwidth", key="--bandwidth-size",
                              hint="add --bandwidth to measure, or drop --bandwidth-size")
    if args.fix_env:
        check_writable(args.fix_env, "--fix-env")  # before the checks run, not after
    done = api.doctor(
        resolve_inventory(args.inventory), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        include=args.include, exclude=args.exclude, launcher=args.backend, job_id=args.job_id,
        master_port=args.master_port, ckpt_bytes=args.ckpt_size, replicas=args.replicas,
        storage=args.storage,
        bandwidth=(args.bandwidth_size or parse_size(BANDWIDTH_SIZE)) if args.bandwidth else None,
        connect_timeout_s=args.connect_timeout, accept_new_host_keys=args.accept_new_host_keys,
        extra=(_sync_parity(args.sync),) if args.sync else ())
    report = done.report
    if done.ifaces and not args.json:
        _say_ifaces(done)
    if args.json:
        print(json.dumps(report.to_json(strict=args.strict), indent=2))
    else:
        print_report(report, verbose=args.verbose, strict=args.strict)
    if args.fix_env:
        write_fix_env(report, Path(args.fix_env), quiet=args.json)
    return report.exit_code(strict=args.strict)


def _sync_parity(src: str) -> ExtraCheck:
    """``--sync DIR``: one sync.parity finding per node (jobs/sync.py)."""
    from clusterkit.jobs.sync import doctor_sync_parity

    def check(report: DoctorReport, transport: Transport, hosts: Sequence[Host]) -> DoctorReport:
        return doctor_sync_parity(report, transport, src, hosts)

    return check


def _say_ifaces(done: DoctorResult) -> None:
    """Each node's peer interface is kept for launch/render/sbatch (docs/doctor.md, issue 14)."""
    from clusterkit.plan.ifaces import cluster_env

    env = " ".join(f"{k}={v}" for k, v in cluster_env(done.ifaces).items())
    print(f"clusterkit: launch/render/sbatch will set {env} unless the inventory sets them "
          f"({done.ifaces_file})", file=sys.stderr)


def print_report(report: DoctorReport, *, verbose: bool, strict: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from clusterkit.checks.findings import Status
    from clusterkit.hostrange import fold

    # Piped output (CI logs, `| less`) gets wide lines instead of an 80-column wrap.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("", "check", "nodes", "finding", "fix"):
        table.add_column(col, overflow="fold")
    for g in report.groups(include_pass=verbose):
        table.add_row(f"[{_STYLE[str(g.status)]}]{g.status}[/]", g.check, g.host_range or "(all)",
                      g.detail, g.fix or "")
    clean = report.clean_hosts()
    if clean:
        table.add_row(f"[{_STYLE['PASS']}]ok[/]", "all checks", fold(clean), "ok", "")
    console.print(table)
    bw = report.extra.get("bandwidth")
    if isinstance(bw, dict) and bw.get("summary"):
        console.print(str(bw["summary"]))
    style = _STYLE[str(report.status if report.status is not Status.WARN or strict
                       else Status.PASS)]
    console.print(f"[{style}]{report.verdict(strict=strict)}[/]  "
                  f"({sum(report.timings.get(k, 0.0) for k in ('total', 'bandwidth')):.1f} s)")


def write_fix_env(report: DoctorReport, path: Path, *, quiet: bool = False) -> None:
    from clusterkit.checks.fixenv import merge_env_file, recommended_env
    from clusterkit.fsutil import atomic_write_text

    updates = recommended_env(report)
    if not updates:
        print(f"clusterkit: --fix-env: nothing to recommend (no node answered); "
              f"{path} left unchanged", file=sys.stderr)
        return
    try:
        old = path.read_text(encoding="utf-8") if path.exists() else ""
    except OSError as exc:
        raise ClusterkitError(f"cannot read: {exc.strerror}", path=str(path)) from None
    text = merge_env_file(old, updates)
    atomic_write_text(path, text)
    out = sys.stderr if quiet else sys.stdout
    print(f"wrote {path} ({'updated' if old else 'new'}, .deepspeed_env format):", file=out)
    for key, value in updates.items():
        print(f"  {key}={value}", file=out)
