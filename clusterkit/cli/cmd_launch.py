"""clusterkit launch (docs/launch.md): its flags, and the plan and the summary it prints.

The launch itself is ``clusterkit.api.launch`` (jobs/launch.py); ``status`` and ``stop``
are cli/cmd_status.py and cli/cmd_stop.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import (
    add_inventory_option,
    add_ranks_option,
    add_selection_options,
    resolve_inventory,
)
from clusterkit.cli.jobflags import (
    add_job_flags,
    add_program,
    add_run_flags,
    job_options,
    run_options,
)
from clusterkit.hostrange import fold
from clusterkit.launchers import BACKENDS
from clusterkit.node.contract import SUMMARY_PREFIX, JobDir
from clusterkit.spec.job import JobOptions, JobPlan

if TYPE_CHECKING:
    from clusterkit.launch.run import LaunchResult


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("launch", help="start a job on every node, stream its logs, tear it down",
                       description="Start a job on every selected node (default: the bundled "
                       "ZeRO workload on the embedded local virtual nodes).")
    add_inventory_option(p)
    add_selection_options(p)
    # the same job flags as render and sbatch (cli/jobflags.py); Slurm's: only for sbatch
    add_job_flags(p, slurm=False)
    # the runtime flags (--grace, --keepalive-timeout, ...) from spec.job.RunOptions
    r = add_run_flags(p)["running"]
    r.add_argument("--sync", metavar="DIR", type=nonempty,
                   help="first copy DIR to every selected node's workdir (changed files only; "
                        "as `clusterkit sync DIR`, docs/sync.md)")
    r.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    r.add_argument("--quiet", action="store_true", help="no rank lines, only the summary")
    add_ranks_option(r)
    add_program(p)  # [-m MODULE] [SCRIPT] [ARGS...], as render and sbatch
    p.set_defaults(func=cmd_launch)


def launch_job_options(args: argparse.Namespace) -> JobOptions:
    """The job of the command line; no --job-id: an empty id, a new job's default id
    (jobs/launch.py ``launch_options``)."""
    return job_options(args, job_id=args.job_id or "")


def cmd_launch(args: argparse.Namespace) -> int:
    from clusterkit import api
    from clusterkit.fold import check_ranks
    from clusterkit.jobs.launch import Sync, dry_run_checks, plan_launch

    inventory = resolve_inventory(args.inventory)  # -i, --hostfile, or the default chain
    options, run = launch_job_options(args), run_options(args)
    if args.dry_run:
        request = plan_launch(options, inventory, run=run, launcher=args.launcher,
                              master_addr=args.master_addr)
        check_ranks(args.ranks, request.plan.world_size)
        _print_plan(request.plan, native=BACKENDS[args.launcher].native)
        dry_run_checks(request.plan, run=run, sync_dir=args.sync)  # exit 2 where it would refuse
        return 0
    sync = Sync(args.sync, _put(args.sync)) if args.sync is not None else None
    result = api.launch(options, inventory=inventory, launcher=args.launcher, run=run,
                        master_addr=args.master_addr, quiet=args.quiet, ranks=args.ranks,
                        sync=sync)
    _print_summary(result)
    return result.exit_code


def _put(sync_dir: str) -> Callable[[JobPlan], None]:
    """``--sync DIR`` to a plan's nodes (shown as ``clusterkit sync`` shows it,
    cli/syncshow.py); raises unless every node then holds DIR's digest."""
    from clusterkit.cli.syncshow import sync_and_show

    def put(plan: JobPlan) -> None:
        sync_and_show(sync_dir, [n.host for n in plan.nodes])

    return put


def _print_plan(decisions: JobPlan, native: bool) -> None:
    from clusterkit.launch.fromplan import job_from_plan
    from clusterkit.launch.run import run_id, stamp_now
    from clusterkit.render.artifacts import render_all

    # Rendered as a launch starting now would render its first run.
    plan = render_all(decisions, run_id=run_id(stamp_now(), 0))
    job = job_from_plan(plan, native=native)
    backend = "native (the agents start the ranks)" if native else plan.backend
    print(f"job {plan.job_id} on {plan.cluster}: {len(plan.nodes)} nodes, {plan.world_size} ranks, "
          f"backend {backend}, master {plan.master_addr}:{plan.master_port}, "
          f"storage {plan.storage}, checkpoints {plan.nodes[0].ckpt_dir}")
    for task in job.tasks:
        what = " ".join(task.argv) if task.argv else "(watch only: started by DeepSpeed's runner)"
        if task.native:
            what = f"{task.nprocs} x {what}  (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* set per rank)"
        print(f"  {task.node}: ranks {task.rank_offset}-{task.rank_offset + task.nprocs - 1} "
              f"job dir {task.job_dir}\n    {what}")
    print("files written to every node's job dir: "
          + ", ".join(sorted(plan.job_files)))
    print("each node runs: the clusterkit node agent, sent over SSH to <python> (the command "
          "above as its child)")


def _stopped_where(out: Any) -> str:
    """Say so when some nodes could not be checked (partition): their agents' dead-man
    switch stops the ranks there, but nobody saw it happen (issue 14)."""
    if not out.unconfirmed:
        return "every rank on every node was stopped"
    return (f"every rank on the other nodes was stopped; {fold(out.unconfirmed)} could not be "
            "confirmed (unreachable: its agent stops its ranks by itself)")


def _print_summary(result: LaunchResult) -> None:
    from clusterkit.launch.outcome import describe_failure

    out = result.outcomes[-1]
    plan = result.plan
    tries = f" after {len(result.outcomes)} attempts" if len(result.outcomes) > 1 else ""
    if out.failure is not None:
        f = out.failure
        node = plan.node(f.node) if f.node in {n.name for n in plan.nodes} else None
        log = JobDir(node.job_dir).node_log(f.node, f.rank) if node else "?"
        print(f"[clusterkit] job {plan.job_id} FAILED{tries}: {f.where()} failed first "
              f"({describe_failure(f)}); {_stopped_where(out)} "
              f"(exit code {out.exit_code})", file=sys.stderr)
        if f.tail:
            print(f"[clusterkit] last lines of {f.where()}:", file=sys.stderr)
            for line in f.tail[-10:]:
                print(f"    {line}", file=sys.stderr)
        print(f"[clusterkit] full log on {f.node}: {log}", file=sys.stderr)
    elif out.interrupted:
        print(f"[clusterkit] job {plan.job_id} interrupted: stopped on every node", file=sys.stderr)
    else:
        print(f"[clusterkit] job {plan.job_id} finished{tries}: {len(plan.nodes)} nodes, "
              f"{plan.world_size} ranks, {result.timing()}")
    for where, count in out.leftovers.items():
        print(f"[clusterkit] warning: {count} process(es) of this job still on {where}; "
              f"run `clusterkit stop {plan.job_id}`", file=sys.stderr)
    if out.summary is not None:
        s = out.summary
        keys = ("final_loss", "steps_run", "global_step", "resumed_from", "tokens_per_s")
        brief = ", ".join(f"{k}={_fmt(s[k])}" for k in keys if k in s)
        if brief:
            print(f"[clusterkit] summary: {brief}")
        print(SUMMARY_PREFIX + json.dumps(s, sort_keys=True))


def _fmt(value: Any) -> str:
    return f"{value:,.4g}" if isinstance(value, float) else str(value)
