"""clusterkit sbatch: the same job as a Slurm batch script (docs/sbatch.md).

    clusterkit sbatch [JOB FLAGS] [--dry-run | --submit [--watch]]
    clusterkit sbatch status JOBID [--watch]
    clusterkit sbatch cancel JOBID [--signal SIG [--batch | --full]]

The script comes from the same plan as ``clusterkit launch`` (``plan_job``); the
verb only picks the launcher variant, writes the job directory and talks to Slurm.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from clusterkit.cli.cmd_render import add_job_options, job_options, launch_facts, write_artifacts
from clusterkit.cli.common import add_inventory_option, add_selection_options, resolve_inventory
from clusterkit.errors import LaunchError, RenderError
from clusterkit.fsutil import atomic_write_text
from clusterkit.plan import LaunchPlan, plan_job
from clusterkit.render.artifacts import summary
from clusterkit.slurm import JobInfo, SlurmClient
from clusterkit.slurm.watch import watch

ACTIONS = ("status", "cancel")
SCRIPT = "sbatch.sh"
# clusterkit sbatch --launcher X -> the plan backend whose sbatch variant it is.
PLAN_BACKEND = {"torchrun": "slurm", "slurm": "slurm", "deepspeed": "deepspeed",
                "accelerate": "accelerate"}
EXIT_JOB_FAILED = 1
LOG_SUBDIR = "logs"  # where the template's #SBATCH --output/--error point


class SlurmJobFailed(LaunchError):
    """The watched job ended in a state other than COMPLETED."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sbatch", help="the same job as a Slurm batch script: write, submit, follow",
        description="Render the job's Slurm batch script from the inventory (the same plan as "
                    "`clusterkit launch`), write it with the job's files to the job directory, "
                    "and optionally submit and follow it. Also: `clusterkit sbatch status JOBID "
                    "[--watch]` and `clusterkit sbatch cancel JOBID [--signal SIG]`.",
        epilog="Arguments after '--' go to the training script.")
    add_inventory_option(p)
    add_selection_options(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the script, write nothing")
    mode.add_argument("--submit", action="store_true", help="write the job directory and run sbatch")
    p.add_argument("--watch", action="store_true",
                   help="with --submit (or status): follow the output until the job ends; "
                        "exit 0 only if it COMPLETED")
    p.add_argument("--poll", type=float, default=1.0, metavar="S",
                   help="seconds between job state polls while watching (default 1)")
    p.add_argument("--slurm-timeout", type=float, default=30.0, metavar="S",
                   help="timeout for each sbatch/scontrol/scancel call (default 30)")
    c = p.add_argument_group("cancel JOBID")
    c.add_argument("--signal", metavar="SIG", help="only send SIG (e.g. USR1) instead of cancelling")
    c.add_argument("--batch", action="store_true", help="with --signal: the batch shell only")
    c.add_argument("--full", action="store_true", help="with --signal: batch shell and all steps")
    add_job_options(p)
    p.set_defaults(func=cmd_sbatch)


def cmd_sbatch(args: argparse.Namespace) -> int:
    client = SlurmClient(timeout_s=args.slurm_timeout)
    words = list(args.script_args)
    # `status`/`cancel` as the first free word: the action form. A training script's own
    # arguments always follow a script (--script/--module) or the bundled workload's flags.
    if words and words[0] in ACTIONS and args.script is None and args.module is None:
        if len(words) != 2:
            raise LaunchError(f"usage: clusterkit sbatch {words[0]} JOBID", key=words[0])
        return _action(client, words[0], words[1], args)
    if args.watch and not args.submit:
        raise LaunchError("--watch needs --submit (or: clusterkit sbatch status JOBID --watch)",
                          key="--watch")
    plan = build_sbatch_plan(args)
    script = plan.artifacts[SCRIPT]
    if args.dry_run:
        sys.stderr.write(summary(plan))
        sys.stdout.write(script)
        return 0
    sys.stderr.write(summary(plan))
    write_artifacts(plan, plan.job_dir)
    # Slurm opens --output/--error before the script runs: a missing directory fails
    # the job at launch (JobLaunchFailure), so it must exist before sbatch.
    Path(plan.job_dir, LOG_SUBDIR).mkdir(parents=True, exist_ok=True)
    path = Path(plan.job_dir) / SCRIPT
    if not args.submit:
        print(f"wrote {path} (submit with: sbatch {path}, or rerun with --submit)")
        return 0
    job_id = client.submit(path)
    atomic_write_text(Path(plan.job_dir) / "slurm_job_id", job_id + "\n")
    print(f"submitted Slurm job {job_id} (clusterkit job {plan.job_id}); script {path}")
    sys.stdout.flush()
    if not args.watch:
        print(f"follow it with: clusterkit sbatch status {job_id} --watch")
        return 0
    return _watch(client, job_id, args.poll)


def build_sbatch_plan(args: argparse.Namespace) -> LaunchPlan:
    inv = resolve_inventory(args.inventory)
    options = job_options(args, inv.name)
    options = dataclasses.replace(options, backend=PLAN_BACKEND[options.backend])
    plan = plan_job(inv, options, launch_facts(args))
    if SCRIPT not in plan.artifacts:
        why = plan.skipped.get(SCRIPT, "the plan has no batch script")
        raise RenderError(f"cannot render the batch script: {why}", key="--launcher")
    return plan


def _action(client: SlurmClient, action: str, job_id: str, args: argparse.Namespace) -> int:
    if action == "cancel":
        if (args.batch or args.full) and not args.signal:
            raise LaunchError("--batch/--full only go with --signal", key="--signal")
        client.cancel(job_id, signal=args.signal, batch=args.batch, full=args.full)
        what = f"sent {args.signal} to" if args.signal else "cancelled"
        print(f"{what} Slurm job {job_id}")
        return 0
    if args.watch:
        return _watch(client, job_id, args.poll)
    info = client.show(job_id)
    print(_status_line(info))
    return 0


def _status_line(info: JobInfo) -> str:
    where = f" on {info.nodes}" if info.nodes and info.nodes != "(null)" else ""
    return f"job {info.job_id} ({info.name}): {info.describe()}{where}; output {info.stdout}"


def _watch(client: SlurmClient, job_id: str, poll_s: float) -> int:
    try:
        info = watch(client, job_id, sys.stdout, sys.stderr, poll_s=poll_s)
    except KeyboardInterrupt:
        # Stopping the watch must not stop the job: say how to do either.
        print(f"clusterkit: stopped watching; job {job_id} keeps running "
              f"(clusterkit sbatch cancel {job_id} to stop it)", file=sys.stderr)
        raise
    if info.succeeded:
        print(f"clusterkit: Slurm job {job_id} COMPLETED", file=sys.stderr)
        return 0
    raise SlurmJobFailed(f"Slurm job {job_id} ended {info.describe()}",
                         hint=f"see {info.stdout}" + (f" and {info.stderr}"
                                                      if info.stderr != info.stdout else ""),
                         exit_code=EXIT_JOB_FAILED)
