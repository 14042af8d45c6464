"""clusterkit collect-ckpt: gather node-local ZeRO checkpoints (docs/collect-ckpt.md).

The flags, the progress display and the lines printed; the work is
``clusterkit.jobs.collect.collect_job`` (which nodes: jobs/resolve.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from clusterkit.checkpoints.collect.scatter import ScatterReport
from clusterkit.checkpoints.collectplan import CheckpointIncomplete, CollectPlan
from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import (
    add_inventory_option,
    add_selection_options,
    resolve_inventory,
)
from clusterkit.errors import CheckpointError
from clusterkit.jobs.collect import CollectHooks, CollectRequest, CollectResult, collect_job
from clusterkit.jobs.here import clusterkit_home
from clusterkit.jobs.resolve import DEFAULT_DEST, NodeChoice
from clusterkit.slurm.steps import ALLOC_WAIT_S
from clusterkit.units import duration_type, size_type

PLAIN_EVERY_S = 2.0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "collect-ckpt", help="gather, verify and consolidate node-local checkpoints",
        description="List every node's checkpoint dir, refuse (exit 2, nothing copied) unless "
        "every shard, marker and tag agrees, then copy each file once with sha256 checked "
        "end to end. Re-running skips files already verified at DEST.")
    p.add_argument("job", nargs="?", metavar="JOB",
                   help="a job started by `clusterkit launch`, or submitted by `clusterkit "
                        "sbatch --submit` (its clusterkit id, its Slurm job id or its job dir)")
    p.add_argument("--dir", metavar="PATH", type=nonempty,
                   help="checkpoint root on every node ({host} and {node} expand); default: "
                        "the inventory's checkpoint.local_dir. The job dir of a `clusterkit "
                        "sbatch` job (it holds sbatch.sh) stands for that job")
    add_inventory_option(p)
    add_selection_options(p)
    p.add_argument("--tag", default="latest", type=nonempty,
                   help="tag to collect (default: the nodes' latest)")
    p.add_argument("--without-markers", action="store_true",
                   help="for a checkpoint your own script saved (no clusterkit completion "
                        "markers): check DeepSpeed's own file set instead; weaker, see "
                        "docs/collect-ckpt.md")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="with --without-markers: the ranks the save had (default: the "
                        "selected nodes' slots, or JOB's)")
    p.add_argument("--to", dest="dest", metavar="DEST", type=nonempty,
                   help=f"where to gather (default: ./{DEFAULT_DEST}, or the job's dir for JOB)")
    p.add_argument("--consolidate", choices=("fp32", "safetensors"),
                   help="also write one fp32 state dict to DEST/<tag>-fp32/ (DeepSpeed's code)")
    p.add_argument("--max-shard-size", default="5GB", type=size_type("--max-shard-size", 1),
                   metavar="SIZE",
                   help="for --consolidate (default 5GB = 5*10^9 bytes; 5G = 5GiB; docs/units.md)")
    p.add_argument("--scatter", action="store_true",
                   help="instead of collecting: push DEST/<tag> back to the selected nodes' "
                        "local dirs, in the layout a launch on those nodes resumes from")
    p.add_argument("--prune-sources", action="store_true",
                   help="after everything is verified at DEST, delete the tag on the nodes")
    p.add_argument("--jobs", type=int, default=8, metavar="N",
                   help="nodes streaming at once, one connection each (default 8)")
    p.add_argument("--via", choices=("auto", "ssh", "sftp", "slurm"), default="auto",
                   help="data path: OpenSSH streams (auto when ssh exists), SFTP, or slurm: "
                        "srun on each node, no SSH (auto for a `clusterkit sbatch` job)")
    p.add_argument("--slurm-wait", type=duration_type("--slurm-wait", zero=False, whole=True),
                   default=ALLOC_WAIT_S, metavar="S",
                   help="with Slurm, for a job that no longer runs: seconds the one-task "
                        "allocation on each node may wait for it (srun --immediate; "
                        "default %(default)s)")
    p.add_argument("--no-fsync", dest="fsync", action="store_false",
                   help="do not fsync each file before its rename (faster, less crash-safe)")
    p.add_argument("--dry-run", action="store_true", help="list, verify and hash; copy nothing")
    p.add_argument("--json", action="store_true", help="print a JSON report at the end")
    p.set_defaults(func=cmd_collect)


# ------------------------------------------------------------------ progress


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class PlainProgress:
    """Piped output: one line per finished file and a total every few seconds."""

    def __init__(self, out: Any = None) -> None:
        self.out = out or sys.stdout
        self.lock = threading.Lock()
        self.total = 0
        self.done = 0
        self.t0 = time.monotonic()
        self.last = 0.0

    def _line(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def begin(self, per_node_bytes: Mapping[str, int]) -> None:
        self.total = sum(per_node_bytes.values())
        self.t0 = self.last = time.monotonic()
        self._line(f"copying {_mb(self.total)} from {len(per_node_bytes)} node(s)")

    def _rate(self) -> str:
        dt = max(time.monotonic() - self.t0, 1e-6)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return f"{_mb(self.done)}/{_mb(self.total)} ({pct:.0f}%) {self.done / dt / 1e6:,.1f} MB/s"

    def advance(self, node: str, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            now = time.monotonic()
            if now - self.last >= PLAIN_EVERY_S:
                self.last = now
                self._line(f"  {self._rate()}")

    def file_done(self, node: str, relpath: str, size: int, status: str, detail: str = "") -> None:
        with self.lock:
            extra = f": {detail}" if detail else ""
            self._line(f"  {node}: {relpath} {_mb(size)} {status}{extra}")

    def end(self) -> None:
        with self.lock:
            if self.total:
                self._line(f"  {self._rate()}")


class RichProgress:
    """Terminal: one bar per node and a total, with bytes and rate."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(TextColumn("{task.description:<12}"), BarColumn(),
                                 DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
        self.tasks: dict[str, Any] = {}
        self.lock = threading.Lock()

    def begin(self, per_node_bytes: Mapping[str, int]) -> None:
        self.progress.start()
        self.tasks["*"] = self.progress.add_task("total", total=sum(per_node_bytes.values()))
        for node, n in per_node_bytes.items():
            self.tasks[node] = self.progress.add_task(node, total=n)

    def advance(self, node: str, nbytes: int) -> None:
        with self.lock:
            self.progress.advance(self.tasks[node], nbytes)
            self.progress.advance(self.tasks["*"], nbytes)

    def file_done(self, node: str, relpath: str, size: int, status: str, detail: str = "") -> None:
        if status == "failed":
            self.progress.console.print(f"[red]{node}: {relpath}: {detail}[/red]")

    def end(self) -> None:
        self.progress.stop()


# ------------------------------------------------------------------ the verb


def cmd_collect(args: argparse.Namespace) -> int:
    """With --json, stdout carries only the JSON report; human lines go to stderr."""
    if not args.json:
        _collect_verb(args)
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        result = _collect_verb(args)
    print(json.dumps(result.to_json(), indent=1))
    return 0


def _collect_verb(args: argparse.Namespace) -> CollectResult:
    where = NodeChoice(job=args.job, ckpt_dir=args.dir, nodes=args.nodes,
                       gpus_per_node=args.gpus_per_node, include=args.include,
                       exclude=args.exclude, via=args.via, slurm_wait=args.slurm_wait)
    request = CollectRequest(where=where, dest=args.dest, tag=args.tag,
                             without_markers=args.without_markers, world_size=args.world_size,
                             consolidate=args.consolidate, max_shard_size=args.max_shard_size,
                             scatter=args.scatter, prune_sources=args.prune_sources,
                             jobs=args.jobs, fsync=args.fsync, dry_run=args.dry_run)
    sink = RichProgress() if sys.stdout.isatty() and not args.json else PlainProgress()
    hooks = CollectHooks(progress=sink, said=print, planned=_print_plan,
                         collected=_print_report)
    try:
        result = collect_job(request, home=clusterkit_home(),
                             inventory=lambda: resolve_inventory(args.inventory), hooks=hooks)
    except CheckpointIncomplete as exc:
        raise _incomplete(exc) from exc
    if result.scattered is not None:
        _print_scatter(result.scattered)
    elif result.dry_run:
        print("dry run: nothing copied")
    elif result.consolidated is not None:
        c = result.consolidated
        print(f"consolidated {result.tag} -> {c.out_dir}/ ({', '.join(c.files)}; {c.tensors} "
              f"tensors) in {result.consolidate_seconds:.1f} s: {c.model_check}")
    return result


def _incomplete(exc: CheckpointIncomplete) -> CheckpointError:
    """The refusal's error line; several findings are listed first, one line each."""
    if len(exc.problems) == 1:  # one finding: it is the error line
        return CheckpointError(f"checkpoint {exc.tag or '?'} cannot be collected, nothing "
                               f"was copied: {exc.problems[0]}", hint=exc.hint,
                               exit_code=exc.exit_code)
    print(f"checkpoint {exc.tag or '?'} cannot be collected:", file=sys.stderr)
    for line in exc.problems:
        print(f"  - {line}", file=sys.stderr)
    # The findings are listed above: the error line says what that means, once.
    n = len(exc.problems)
    return CheckpointError(
        f"checkpoint {exc.tag or '?'} is incomplete or inconsistent, nothing was "
        f"copied ({n} finding{'s' if n != 1 else ''} above)",
        hint=exc.hint, exit_code=exc.exit_code)


def _print_plan(plan: CollectPlan) -> None:
    stage = "1/2" if plan.zero_stage is None else plan.zero_stage  # without markers: unknown
    print(f"checkpoint {plan.tag}: step {plan.step}, ZeRO-{stage}, "
          f"{plan.world_size} ranks on {len(plan.nodes)} nodes, engine {plan.engine}: "
          f"complete ({len(plan.files)} files, {_mb(plan.total_bytes)} after dedupe)")
    for n in plan.nodes:
        ranks = (f"{n.ranks[0]}-{n.ranks[-1]}" if len(n.ranks) > 1 else str(n.ranks[0])
                 if n.ranks else "-")
        print(f"  {n.node:<12} node {n.node_index:<3} ranks {ranks}")


def _print_report(result: CollectResult) -> None:
    report = result.report
    assert report is not None
    hashed = (f"hashed on the nodes in {report.seconds_hash:.1f} s" if report.seconds_hash
              else "hashed on the nodes while sending")
    print(f"listed in {report.seconds_list:.1f} s, {hashed}")
    for note in report.notes:
        print(f"note: {note}")
    for line in report.replicas.used(bool(report.method)) if report.replicas else ():
        print(line)
    if report.method:
        copied = sum(len(r.copied) for r in report.results.values())
        rate = report.bytes_copied / report.seconds_copy / 1e6 if report.seconds_copy else 0.0
        print(f"collected {report.plan.tag} into {result.dest}: {copied} file(s) copied "
              f"({_mb(report.bytes_copied)} in {report.seconds_copy:.1f} s, {rate:,.1f} MB/s via "
              f"{report.method}), {report.skipped} already verified; every file sha256-checked")
    for node, status in report.pruned.items():
        print(f"pruned {report.plan.tag} on {node}: {status}")


def _print_scatter(r: ScatterReport) -> None:
    if r.remapped:
        print("warning: ranks now live on different nodes than when the checkpoint was saved; "
              "launch with exactly this node selection and order to resume")
    for p in r.pushes:
        print(f"scattered {r.tag} to {p.node}: node {p.node_index}, ranks {list(p.ranks)}, "
              f"{r.uploaded.get(p.node, 0)} uploaded, {r.skipped.get(p.node, 0)} already there")
