"""clusterkit collect-ckpt: gather node-local ZeRO checkpoints (docs/collect-ckpt.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import (
    add_inventory_option,
    add_selection_options,
    resolve_inventory,
)
from clusterkit.errors import CheckpointError
from clusterkit.fsutil import check_writable
from clusterkit.inventory import Host
from clusterkit.jobs.here import clusterkit_home
from clusterkit.remote.base import SSHTarget, target_for
from clusterkit.slurm.steps import ALLOC_WAIT_S
from clusterkit.units import duration_type, size_type

if TYPE_CHECKING:
    from clusterkit.checkpoints.collectplan import WithoutMarkers
    from clusterkit.launch.jobs import JobRecord

DEFAULT_DEST = "checkpoints-collected"
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


# ------------------------------------------------------------------ nodes


def _root(pattern: str | None, host: Host | None, name: str, index: int) -> str:
    value = pattern or (host.checkpoint.local_dir if host else None)
    if not value:
        raise CheckpointError("no checkpoint directory for this node", host=name,
                              key="checkpoint.local_dir",
                              hint="set checkpoint.local_dir in the inventory or pass --dir")
    return value.replace("{host}", name).replace("{node}", str(index))


def resolve_nodes(args: argparse.Namespace) -> tuple[list[Any], list[int], str]:
    """(CollectNodes, slots per node, default DEST) from JOB or inventory + selection."""
    from clusterkit.checkpoints.sources.base import CollectNode

    record = _job_record(args)
    # A job clusterkit launched knows whether its program writes completion markers.
    args.job_markers = None if record is None else record.ckpt.markers
    if record is not None and record.transport == "slurm":
        return _batch_job_nodes(args, record)
    if record is not None:
        inv = None
        nodes = []
        for index, n in enumerate(record.nodes):
            pattern = args.dir or record.ckpt.dir_of(n.node)
            host = None
            if not pattern:
                inv = inv or resolve_inventory(args.inventory)
                if n.node not in {h.name for h in inv.hosts}:  # not a KeyError (exit 70)
                    raise CheckpointError(
                        f"job {args.job} ran on {n.node}, which this inventory does not list",
                        host=n.node, path=inv.path, key="-i",
                        hint="pass the inventory the job was launched with (-i FILE), or "
                             "--dir with the checkpoint directory")
                host = inv.host(n.node)
            nodes.append(CollectNode(n.node, n.target, n.python, _root(pattern, host, n.node, index),
                                     via=_allocation(args, n.node)))
        slots = list(record.ckpt.slots) or [0] * len(nodes)
        if args.include or args.exclude:
            nodes, slots = _select_job_nodes(args, nodes, slots)
        elif not record.ckpt.node_local and not args.dir:
            # Shared storage: every node wrote into the one directory, so the whole
            # checkpoint is read from the first node (each file once), all ranks its own.
            nodes, slots = nodes[:1], [sum(slots)]
        return nodes, slots, str(clusterkit_home() / "jobs" / args.job / "checkpoints")
    from clusterkit.hostfile import select_hosts

    inventory = resolve_inventory(args.inventory)
    chosen = select_hosts(inventory, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                          include=args.include, exclude=args.exclude)
    nodes = [CollectNode(h.name, target_for(h), h.python or "python3",
                         _root(args.dir, h, h.name, i), via=_allocation(args, h.name))
             for i, (h, _) in enumerate(chosen)]
    return nodes, [len(s) for _, s in chosen], DEFAULT_DEST


def _allocation(args: argparse.Namespace, node: str) -> Any:
    """``--via slurm`` on inventory hosts: an allocation on each (host name = Slurm node)."""
    from clusterkit.slurm.steps import SlurmPlace

    return SlurmPlace(node, wait_s=args.slurm_wait) if args.via == "slurm" else None


# ------------------------------------------------------------------ Slurm jobs


def _select_job_nodes(args: argparse.Namespace, nodes: list[Any], slots: list[int]
                      ) -> tuple[list[Any], list[int]]:
    """--include/--exclude over a job's own nodes (DeepSpeed's rules, by node name). One
    node kept out of several reads the whole checkpoint from it: the way to collect a
    node-local dir that was one shared directory (discover.shared_dir's hint)."""
    from clusterkit.hostfile import filter_resources

    pool = {n.name: list(range(s)) for n, s in zip(nodes, slots, strict=True)}
    kept = filter_resources(pool, args.include or "", args.exclude or "")
    chosen = [(n, s) for n, s in zip(nodes, slots, strict=True) if n.name in kept]
    if len(chosen) == 1 < len(nodes):
        return [chosen[0][0]], [sum(slots)]
    return [n for n, _ in chosen], [s for _, s in chosen]


def _job_record(args: argparse.Namespace) -> JobRecord | None:
    """JOB (clusterkit id, Slurm id or job dir) or a job dir given as --dir; None: neither."""
    from clusterkit.launch.jobs import JobRecord, Registry, is_sbatch_dir

    if is_sbatch_dir(args.dir):
        if args.job:
            raise CheckpointError("JOB and a job dir as --dir name the job twice", key="--dir",
                                  path=args.dir, hint="pass one of them")
        record = JobRecord.for_sbatch(args.dir)
        args.dir = None  # it named the job, not the checkpoint root
        return record
    if not args.job:
        return None
    if is_sbatch_dir(args.job):
        return JobRecord.for_sbatch(args.job)
    return Registry(clusterkit_home()).resolve(args.job)


def _batch_job_nodes(args: argparse.Namespace, record: JobRecord
                     ) -> tuple[list[Any], list[int], str]:
    """A `clusterkit sbatch` job: its Slurm nodes, reached through Slurm (default) or,
    with --via ssh/sftp, over SSH by node name."""
    from clusterkit.checkpoints.sources.base import CollectNode
    from clusterkit.hostrange import fold
    from clusterkit.slurm.client import SlurmClient
    from clusterkit.slurm.steps import job_places

    ckpt = record.ckpt
    if not ckpt.node_local and not args.dir:
        raise CheckpointError(
            f"job {record.job_id} saved its checkpoints to shared storage: they are in one "
            "place already, nothing to gather", path=str(ckpt.dir),
            hint="read them there (<dir>/zero_to_fp32.py consolidates), or pass --dir")
    slurm_id = record.slurm_job_id
    job = job_places(SlurmClient(), slurm_id, _first_nodes(record), _site(record),
                     wait_s=args.slurm_wait, job_name=f"ck-collect-{record.job_id}")
    root = args.dir or str(ckpt.dir)
    python = record.python or "python3"
    over_ssh = args.via in ("ssh", "sftp")
    nodes = [CollectNode(p.node, SSHTarget(name=p.node, address=p.node), python,
                         _root(root, None, p.node, i), via=None if over_ssh else p)
             for i, p in enumerate(job.places)]
    how = (f"over {args.via}" if over_ssh else "through Slurm, "
           + ("a step of the running job on each node" if job.places[0].job_id
              else f"a one-task allocation on each node (waits up to {args.slurm_wait} s)"))
    print(f"job {record.job_id} (Slurm job {slurm_id or '?'}, {job.state}): collecting "
          f"{root} from {fold(p.node for p in job.places)} {how}")
    slots = list(ckpt.slots)
    slots = slots if len(slots) == len(nodes) else [slots[0] if slots else 0] * len(nodes)
    home = record.job_dir or str(clusterkit_home() / "jobs" / record.job_id)
    return nodes, slots, os.path.join(home, "checkpoints")


def _site(record: JobRecord) -> tuple[str, ...]:
    """The job script's partition/account/QOS/reservation as the script says now (an
    edit since the submit counts: the fix for a partition that is gone), else as
    recorded at submit."""
    from clusterkit.launch.jobs import SBATCH_SCRIPT
    from clusterkit.slurm.steps import site_args

    if record.job_dir:
        try:
            return site_args((Path(record.job_dir) / SBATCH_SCRIPT).read_text(encoding="utf-8"))
        except OSError:
            pass
    return tuple(record.slurm_site)


def _first_nodes(record: JobRecord) -> str | None:
    """The node list the job's first run wrote (node-local jobs): where the shards are."""
    from clusterkit.cli.cmd_sbatch import NODES_FILE

    if not record.job_dir:
        return None
    try:
        return (Path(record.job_dir) / NODES_FILE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


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
        return _collect_verb(args)
    with contextlib.redirect_stdout(sys.stderr):
        result = _collect_verb(args)
    print(json.dumps(args.json_result, indent=1))
    return result


def _collect_verb(args: argparse.Namespace) -> int:
    from clusterkit.checkpoints.collect.verb import CollectOptions, collect
    from clusterkit.checkpoints.collectplan import CheckpointIncomplete, describe
    from clusterkit.remote.dispatch import transport_for

    if args.jobs < 1:
        raise CheckpointError("--jobs must be >= 1", key="--jobs")
    if args.dest is not None and not args.scatter:  # its parent must exist (like cp)
        check_writable(args.dest, "--to", directory=True)
    nodes, slots, default_dest = resolve_nodes(args)
    dest = os.path.abspath(args.dest or default_dest)
    options = CollectOptions(dest=dest, tag=args.tag, jobs=args.jobs, method=args.via,
                             fsync=args.fsync, dry_run=args.dry_run,
                             prune_sources=args.prune_sources,
                             without_markers=_without_markers(args, slots))
    if args.scatter:
        if any(n.via is not None for n in nodes):
            raise CheckpointError("--scatter does not run through Slurm", key="--scatter",
                                  hint="scatter over SSH: -i INVENTORY --dir CKPT_DIR --scatter "
                                       "(or the job with --via ssh)")
        return _scatter_only(args, nodes, slots, dest)
    sink = RichProgress() if sys.stdout.isatty() and not args.json else PlainProgress()
    with transport_for() as transport:
        try:
            report = collect(transport, nodes, options, sink, on_plan=_print_plan)
        except CheckpointIncomplete as exc:
            if len(exc.problems) == 1:  # one finding: it is the error line
                raise CheckpointError(f"checkpoint {exc.tag or '?'} cannot be collected, nothing "
                                      f"was copied: {exc.problems[0]}", hint=exc.hint,
                                      exit_code=exc.exit_code) from exc
            print(f"checkpoint {exc.tag or '?'} cannot be collected:", file=sys.stderr)
            for line in exc.problems:
                print(f"  - {line}", file=sys.stderr)
            # The findings are listed above: the error line says what that means, once.
            n = len(exc.problems)
            raise CheckpointError(
                f"checkpoint {exc.tag or '?'} is incomplete or inconsistent, nothing was "
                f"copied ({n} finding{'s' if n != 1 else ''} above)",
                hint=exc.hint, exit_code=exc.exit_code) from exc
    _print_report(report, dest)
    result: dict[str, Any] = {"collect": describe(report.plan), "dest": dest,
                              "copied_bytes": report.bytes_copied, "skipped": report.skipped,
                              "notes": report.notes}
    if report.replicas is not None:
        result["replicas"] = {"used": report.replicas.used(not args.dry_run),
                              "parts": report.replicas.parts_json()}
    if args.dry_run:
        print("dry run: nothing copied")
    elif args.consolidate:
        result["consolidated"] = _consolidate(dest, report.plan.tag, report.plan.ds_subdir, args)
    args.json_result = result
    return 0


def _without_markers(args: argparse.Namespace, slots: list[int]) -> WithoutMarkers | None:
    from clusterkit.checkpoints.collectplan import WithoutMarkers

    # A launched user's script writes no markers: no flag needed (issue 32).
    users_script = getattr(args, "job_markers", None) is False
    if not args.without_markers and not users_script:
        if args.world_size is not None:
            raise CheckpointError("--world-size is for --without-markers (markers record it)",
                                  key="--world-size", hint="add --without-markers or drop it")
        return None
    world = args.world_size if args.world_size is not None else sum(slots)
    if world < 1 or (args.world_size is None and not all(slots)):
        raise CheckpointError("the world size of the save is not known", key="--world-size",
                              hint="pass --world-size N (the number of ranks that saved it)")
    return WithoutMarkers(world_size=world,
                          slots=tuple(slots) if args.world_size is None else ())


def _scatter_only(args: argparse.Namespace, nodes: list[Any], slots: list[int], dest: str) -> int:
    from clusterkit.checkpoints.collect.manifest import latest_tag_at
    from clusterkit.remote.dispatch import transport_for

    tag = args.tag if args.tag != "latest" else latest_tag_at(dest)
    if tag is None:
        raise CheckpointError("DEST has no 'latest' file", path=dest,
                              hint="pass --tag, or collect a checkpoint into DEST first")
    if args.dry_run or args.consolidate or args.prune_sources:
        raise CheckpointError("--scatter pushes DEST back to the nodes and does nothing else",
                              key="--scatter", hint="run the collect and the scatter separately")
    with transport_for() as transport:
        result = _scatter(transport, nodes, slots, dest, tag, args)
    args.json_result = {"scatter": result}
    return 0


def _print_plan(plan: Any) -> None:
    stage = "1/2" if plan.zero_stage is None else plan.zero_stage  # without markers: unknown
    print(f"checkpoint {plan.tag}: step {plan.step}, ZeRO-{stage}, "
          f"{plan.world_size} ranks on {len(plan.nodes)} nodes, engine {plan.engine}: "
          f"complete ({len(plan.files)} files, {_mb(plan.total_bytes)} after dedupe)")
    for n in plan.nodes:
        ranks = (f"{n.ranks[0]}-{n.ranks[-1]}" if len(n.ranks) > 1 else str(n.ranks[0])
                 if n.ranks else "-")
        print(f"  {n.node:<12} node {n.node_index:<3} ranks {ranks}")


def _print_report(report: Any, dest: str) -> None:
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
        print(f"collected {report.plan.tag} into {dest}: {copied} file(s) copied "
              f"({_mb(report.bytes_copied)} in {report.seconds_copy:.1f} s, {rate:,.1f} MB/s via "
              f"{report.method}), {report.skipped} already verified; every file sha256-checked")
    for node, status in report.pruned.items():
        print(f"pruned {report.plan.tag} on {node}: {status}")


def _consolidate(dest: str, tag: str, ds_subdir: str, args: argparse.Namespace) -> dict[str, Any]:
    from clusterkit.checkpoints.convert.consolidate import consolidate
    from clusterkit.workload.verify import check_against_workload

    t0 = time.monotonic()
    c = consolidate(dest, tag, args.consolidate, max_shard_size=args.max_shard_size,
                    ds_subdir=ds_subdir, model_check=check_against_workload)
    print(f"consolidated {tag} -> {c.out_dir}/ ({', '.join(c.files)}; {c.tensors} tensors) in "
          f"{time.monotonic() - t0:.1f} s: {c.model_check}")
    return {"out_dir": c.out_dir, "files": list(c.files), "tensors": c.tensors,
            "model_check": c.model_check}


def _scatter(transport: Any, nodes: list[Any], slots: list[int], dest: str, tag: str,
             args: argparse.Namespace) -> dict[str, Any]:
    from clusterkit.checkpoints.collect.scatter import ScatterTarget, scatter

    if not all(slots):
        raise CheckpointError("--scatter needs the slots of each node", key="--scatter",
                              hint="use the inventory (not a JOB) to scatter")
    targets = [ScatterTarget(n, s) for n, s in zip(nodes, slots, strict=True)]
    r = scatter(transport, dest, tag, targets, jobs=args.jobs)
    if r.remapped:
        print("warning: ranks now live on different nodes than when the checkpoint was saved; "
              "launch with exactly this node selection and order to resume")
    for p in r.pushes:
        print(f"scattered {tag} to {p.node}: node {p.node_index}, ranks {list(p.ranks)}, "
              f"{r.uploaded.get(p.node, 0)} uploaded, {r.skipped.get(p.node, 0)} already there")
    return {"nodes": {p.node: list(p.ranks) for p in r.pushes}, "remapped": r.remapped}
