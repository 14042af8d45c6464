"""clusterkit render: every launch artifact for a job, written atomically (or --dry-run)."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime
from pathlib import Path

from clusterkit.cli.common import add_inventory_option, add_selection_options, resolve_job_inventory
from clusterkit.cli.safety import check_out_dir
from clusterkit.errors import RenderError
from clusterkit.fsutil import atomic_write_text
from clusterkit.plan import BACKENDS, JobOptions, LaunchFacts, LaunchPlan, default_job_id, plan_job
from clusterkit.plan.model import DS_LAUNCHERS, RDZV_CHOICES, STORAGE_CHOICES
from clusterkit.render.artifacts import dry_run_text, summary
from clusterkit.render.dsconfig import OFFLOAD_CHOICES


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "render", help="write every launch artifact for a job",
        description="Render the hostfile, .deepspeed_env, ds_config.json, accelerate configs, "
                    "sbatch script and every command line for one job. Arguments after '--' "
                    "go to the script.")
    add_inventory_option(p)
    add_selection_options(p)
    p.add_argument("-o", "--out", metavar="DIR", help="write the files here (required unless --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="print what would be written, write nothing")
    add_job_options(p)
    p.add_argument("--write-user-deepspeed-env", action="store_true",
                   help="also replace ~/.deepspeed_env (atomically) with the job's environment")
    p.set_defaults(func=cmd_render)


def add_job_options(p: argparse.ArgumentParser) -> None:
    """The job flags shared by render, launch and sbatch."""
    j = p.add_argument_group("job")
    j.add_argument("--launcher", choices=BACKENDS, default="torchrun", help="default: torchrun")
    j.add_argument("--job-id", help="default: <cluster>-<date>-<time>")
    j.add_argument("--master-addr", metavar="ADDR",
                   help="node 0's address on the network the nodes share (default: its inventory address)")
    prog = j.add_mutually_exclusive_group()
    prog.add_argument("--script", metavar="PATH", help="a training script (default: the bundled workload)")
    prog.add_argument("--module", metavar="MOD", help="a training module, run as python -m MOD")
    j.add_argument("script_args", nargs="*", metavar="-- ARGS", help="arguments for the script")
    w = p.add_argument_group("workload and ZeRO")
    w.add_argument("--model", default="tiny")
    w.add_argument("--steps", type=int, default=100)
    w.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2)
    w.add_argument("--offload-optimizer", choices=OFFLOAD_CHOICES, default="none")
    w.add_argument("--offload-param", choices=OFFLOAD_CHOICES, default="none")
    w.add_argument("--nvme-path", metavar="DIR")
    w.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto")
    w.add_argument("--micro-batch", type=int, default=1)
    w.add_argument("--grad-accum", type=int, default=1)
    w.add_argument("--clip", type=float, default=1.0)
    w.add_argument("--lr", type=float, default=1e-3)
    w.add_argument("--warmup-steps", type=int, default=10)
    w.add_argument("--save-every", type=int, default=0)
    w.add_argument("--save-16bit", action="store_true")
    w.add_argument("--tensorboard", action="store_true")
    c = p.add_argument_group("checkpoints and environment")
    c.add_argument("--storage", choices=STORAGE_CHOICES, default="auto")
    c.add_argument("--ckpt-dir", metavar="DIR", help="override the inventory's checkpoint directory")
    c.add_argument("--env", action="append", default=[], metavar="NAME",
                   help="also pass this variable (or glob) from your environment (repeatable)")
    c.add_argument("--set-env", action="append", default=[], metavar="NAME=VALUE", help="repeatable")
    la = p.add_argument_group("launcher details")
    la.add_argument("--rdzv", choices=RDZV_CHOICES, default="auto")
    la.add_argument("--max-restarts", type=int, default=0)
    la.add_argument("--local-ranks-filter", metavar="RANKS")
    la.add_argument("--deepspeed-launcher", choices=DS_LAUNCHERS, default="pdsh")
    la.add_argument("--accelerate-no-deepspeed", action="store_true",
                    help="accelerate with MULTI_GPU/MULTI_CPU instead of DEEPSPEED")
    s = p.add_argument_group("Slurm")
    s.add_argument("--partition")
    s.add_argument("--account")
    s.add_argument("--qos")
    s.add_argument("--time", default="01:00:00")
    s.add_argument("--cpus-per-task", type=int)


def _set_env(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise RenderError(f"--set-env {item!r} needs NAME=VALUE", key="--set-env")
        out.append((name, value))
    return tuple(out)


def job_options(args: argparse.Namespace, cluster: str) -> JobOptions:
    return JobOptions(
        job_id=args.job_id or default_job_id(cluster, datetime.now()),
        backend=args.launcher, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        include=args.include, exclude=args.exclude, script=args.script, module=args.module,
        script_args=tuple(args.script_args), model=args.model, steps=args.steps,
        zero_stage=args.zero_stage, offload_optimizer=args.offload_optimizer,
        offload_param=args.offload_param, nvme_path=args.nvme_path, precision=args.precision,
        micro_batch=args.micro_batch, grad_accum=args.grad_accum, clip=args.clip, lr=args.lr,
        warmup_steps=args.warmup_steps, save_16bit=args.save_16bit, tensorboard=args.tensorboard,
        save_every=args.save_every, storage=args.storage, ckpt_dir=args.ckpt_dir,
        env_allowlist=tuple(args.env), set_env=_set_env(args.set_env), rdzv=args.rdzv,
        max_restarts=args.max_restarts, local_ranks_filter=args.local_ranks_filter,
        deepspeed_launcher=args.deepspeed_launcher,
        accelerate_use_deepspeed=not args.accelerate_no_deepspeed, partition=args.partition,
        account=args.account, qos=args.qos, time_limit=args.time, cpus_per_task=args.cpus_per_task)


def launch_facts(args: argparse.Namespace) -> LaunchFacts:
    """The only place the launching machine is looked at."""
    return LaunchFacts(python=sys.executable, cwd=os.getcwd(), environ=dict(os.environ),
                       master_addr=args.master_addr)


def build_plan(args: argparse.Namespace) -> LaunchPlan:
    inv = resolve_job_inventory(args.inventory)  # + doctor's interface pick
    return plan_job(inv, job_options(args, inv.name), launch_facts(args))


def write_artifacts(plan: LaunchPlan, out: str) -> list[Path]:
    written = []
    for name, text in plan.artifacts.items():
        mode = 0o755 if name.endswith(".sh") else 0o644
        written.append(atomic_write_text(Path(out) / name, text, mode=mode))
    return written


def cmd_render(args: argparse.Namespace) -> int:
    if not args.out and not args.dry_run:
        raise RenderError("say where to write the files", key="--out",
                          hint="pass --out DIR, or --dry-run to only print them")
    if args.out and not args.dry_run:
        check_out_dir(args.out)  # one line naming --out, before any planning
    plan = build_plan(args)
    user_env = Path.home() / ".deepspeed_env"
    if args.dry_run:
        sys.stdout.write(dry_run_text(plan))
        if args.write_user_deepspeed_env:
            print(f"(dry run: would replace {user_env} with deepspeed_env)", file=sys.stderr)
        return 0
    sys.stdout.write(summary(plan))
    written = write_artifacts(plan, args.out)
    if args.write_user_deepspeed_env:
        atomic_write_text(user_env, plan.artifacts["deepspeed_env"], mode=0o600)
        print(f"replaced {user_env}", file=sys.stderr)
    print(f"wrote {len(written)} files to {args.out}", file=sys.stderr)
    return 0
