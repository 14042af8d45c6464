"""clusterkit render: every launch artifact for a job, written atomically (or --dry-run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clusterkit.cli import jobflags
from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import (
    add_inventory_option,
    add_selection_options,
    job_facts,
    resolve_inventory,
)
from clusterkit.cli.jobflags import add_job_flags, add_program, default_job_id_now
from clusterkit.errors import RenderError
from clusterkit.fsutil import atomic_write_text, check_writable
from clusterkit.plan.build import plan_job
from clusterkit.render.artifacts import dry_run_text, render_all, summary
from clusterkit.spec.job import JobOptions, LaunchPlan


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "render", help="write every launch artifact for a job",
        description="Render the hostfile, .deepspeed_env, ds_config.json, accelerate configs, "
                    "sbatch script and every command line for one job. The program comes "
                    "last, as in `clusterkit launch`: [-m MODULE] [SCRIPT] [ARGS...].")
    add_inventory_option(p)
    add_selection_options(p)
    out = p.add_mutually_exclusive_group()
    out.add_argument("-o", "--out", metavar="DIR", type=nonempty,
                     help="write the files here (required unless --dry-run; DIR is created if "
                          "missing, its parent must exist)")
    out.add_argument("--dry-run", action="store_true",
                     help="print what would be written, write nothing (not with --out)")
    add_job_options(p)
    p.add_argument("--write-user-deepspeed-env", action="store_true",
                   help="also replace ~/.deepspeed_env (atomically) with the job's environment")
    p.set_defaults(func=cmd_render)


def add_job_options(p: argparse.ArgumentParser) -> None:
    """The job flags and the program, as launch has them (cli/jobflags.py); last."""
    add_job_flags(p)
    add_program(p)


def job_options(args: argparse.Namespace, cluster: str) -> JobOptions:
    return jobflags.job_options(args, job_id=args.job_id or default_job_id_now(cluster))


def build_plan(args: argparse.Namespace) -> LaunchPlan:
    inv = resolve_inventory(args.inventory)
    # job_facts: + doctor's interface pick
    return render_all(plan_job(inv, job_options(args, inv.name), job_facts(args, inv)))


def write_job_files(plan: LaunchPlan, out: str) -> list[Path]:
    written = []
    for name, text in plan.job_files.items():
        mode = 0o755 if name.endswith(".sh") else 0o644
        try:
            written.append(atomic_write_text(Path(out) / name, text, mode=mode))
        except OSError as exc:  # e.g. a directory of that name in DIR: one line, not exit 70
            raise RenderError(f"cannot write {name}: {exc.strerror or exc}",
                              path=str(Path(out) / name),
                              hint="move what is there out of the way, or choose another "
                                   "directory") from None
    return written


def cmd_render(args: argparse.Namespace) -> int:
    if not args.out and not args.dry_run:
        raise RenderError("say where to write the files", key="--out",
                          hint="pass --out DIR, or --dry-run to only print them")
    if args.out:
        check_writable(args.out, "--out", directory=True)  # one line, before any planning
    plan = build_plan(args)
    user_env = Path.home() / ".deepspeed_env"
    if args.dry_run:
        sys.stdout.write(dry_run_text(plan))
        if args.write_user_deepspeed_env:
            print(f"(dry run: would replace {user_env} with deepspeed_env)", file=sys.stderr)
        return 0
    sys.stdout.write(summary(plan))
    written = write_job_files(plan, args.out)
    if args.write_user_deepspeed_env:
        atomic_write_text(user_env, plan.artifacts["deepspeed_env"], mode=0o600)
        print(f"replaced {user_env}", file=sys.stderr)
    print(f"wrote {len(written)} files to {args.out}", file=sys.stderr)
    return 0
