"""clusterkit status [JOB] [--json] (docs/launch.md): ``clusterkit.api.status``, printed."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from clusterkit.cli.jobflags import job_id_type
from clusterkit.hostrange import folded_lines

if TYPE_CHECKING:
    from clusterkit.jobs.status import JobStatus, NodeStatus
    from clusterkit.launch.registry import JobRecord


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("status", help="jobs launched from here and whether their ranks still run")
    s.add_argument("job", nargs="?", metavar="JOB", type=job_id_type,
                   help="one job: per-node liveness")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from clusterkit import api

    if args.job is None:
        _print_jobs(api.status(), as_json=args.json)
        return 0
    status = api.status(args.job)
    if args.json:
        print(json.dumps(status.to_json(), indent=1))
    elif status.slurm:
        _print_batch_job(status.record)
        for line in status.checkpoints.lines() if status.checkpoints else ():
            print(f"  {line}")
    else:
        _print_job(status)
    return 0


def _print_jobs(records: list[JobRecord], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps([json.loads(r.to_json()) for r in records], indent=1))
        return
    if not records:
        print("no jobs launched from this machine")
    for r in records:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created))
        where = (f"slurm {r.slurm_job_id or '?':>5}" if r.transport == "slurm"
                 else f"{len(r.nodes):>3} nodes")
        print(f"{r.job_id:<36} {r.launcher_shown:<11} {where}  {when}  {r.state_shown}"
              + (f"  exit {r.exit_code}" if r.exit_code is not None else "")
              + (f"  ({r.failure})" if r.failure else ""))


def _print_batch_job(record: JobRecord) -> None:
    """A batch job's nodes are Slurm's to report: say which Slurm job it is and where to
    look, instead of 'submitted' on 0 nodes (its agents are Slurm's steps, not ours)."""
    ids = ",".join(record.slurm_job_ids) or "?"
    print(f"{record.job_id}: Slurm job {ids} (submitted by clusterkit sbatch; job dir "
          f"{record.job_dir})  launcher {record.launcher_shown}")
    from clusterkit.jobs.stop import slurm_command

    print(f"  its state and output: {slurm_command(record, 'status')} [--watch]")


def _print_job(status: JobStatus) -> None:
    record = status.record
    print(f"{record.job_id}: {record.state.value}" + (f" (exit {record.exit_code})"
                                                      if record.exit_code is not None else "")
          + f"  launcher {record.launcher_shown}")
    rows: list[tuple[str, str]] = []  # nodes with the same state share one line
    for n in status.nodes:
        if n.error is not None:
            rows.append((n.node, f"unreachable: {n.error}"))
        else:
            rows.append((n.node, f"agent {'up' if n.agent_alive else 'down'}  "
                                 f"processes {n.processes}  {ranks_text(n)}{progress_text(n)}"))
    for line in folded_lines(rows, [n.node for n in status.nodes]):
        print(f"  {line}")
    for line in status.checkpoints.lines() if status.checkpoints else ():
        print(f"  {line}")


def ranks_text(node: NodeStatus) -> str:
    """``ranks 0,1 (pids 4711,4712)  fork server pid 4700``: what `ps` and `kill` need."""
    text = f"ranks {','.join(map(str, node.ranks)) or '-'}"
    if node.pids:
        text += " (pids " + ",".join(str(node.pids.get(r, "?")) for r in node.ranks) + ")"
    for pid, what in ((node.launcher_pid, "launcher pid"),
                      (node.fork_server_pid, "fork server pid")):
        if pid is not None:
            text += f"  {what} {pid}"
    return text


def progress_text(node: NodeStatus) -> str:
    """``  step 57, last progress 10:41:07 (3 s ago)`` while the agent runs (issue 14)."""
    if not node.agent_alive or node.progress_age_s is None:
        return ""
    age = node.progress_age_s
    when = time.strftime("%H:%M:%S", time.localtime(time.time() - age))
    return ("  " + (f"step {node.step}, " if node.step is not None else "")
            + f"last progress {when} ({age:.0f} s ago)")
