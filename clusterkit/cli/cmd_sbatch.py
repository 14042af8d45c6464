"""clusterkit sbatch: the same job as a Slurm batch script (docs/sbatch.md).

    clusterkit sbatch [JOB FLAGS] [SITE FLAGS] [--dry-run | --write-only | --submit [--watch] [--json]]
    clusterkit sbatch status JOBID [--watch]
    clusterkit sbatch cancel JOBID [--signal SIG [--batch | --full]]

The script comes from the same plan as ``clusterkit launch`` (``plan_job``); the
verb only picks the launcher variant, writes the job directory and talks to Slurm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TextIO

from clusterkit.cli import safety
from clusterkit.cli.argparser import Parser, nonempty
from clusterkit.cli.cmd_render import add_job_options, job_options, write_job_files
from clusterkit.cli.common import (
    add_inventory_option,
    add_ranks_option,
    add_selection_options,
    job_facts,
    resolve_inventory,
)
from clusterkit.cli.jobflags import SCRIPT_OPTION, launcher_given
from clusterkit.errors import ClusterkitError, LaunchError, RenderError
from clusterkit.fold import check_ranks
from clusterkit.fsutil import atomic_write_text
from clusterkit.jobs.here import clusterkit_home
from clusterkit.jobs.sbatch_health import slurm_job_health_lines
from clusterkit.launchers import BACKENDS
from clusterkit.node.contract import ENV_STOP_FILE, SLURM_PLAIN_SUFFIX, JobDir
from clusterkit.render.artifacts import summary
from clusterkit.render.sbatch import DEFAULT_SIGNAL_LEAD_S, SlurmSite
from clusterkit.slurm import submit as slurm_submit
from clusterkit.slurm.client import SlurmClient
from clusterkit.slurm.jobinfo import output_hint, status_line
from clusterkit.slurm.watch import watch
from clusterkit.spec.job import LaunchPlan
from clusterkit.units import duration_type

ACTIONS = ("status", "cancel")
EXIT_JOB_FAILED = 1
ACTION_USAGE = {
    "status": ("clusterkit sbatch status JOBID [--watch [--ranks R]] [--poll S] [--slurm-timeout S]",
               "One line from `scontrol show job JOBID`: state, exit code, nodes, output file. "
               "--watch: follow the job's output until it ends; exit 0 only if it COMPLETED."),
    "cancel": ("clusterkit sbatch cancel JOBID [--signal SIG [--batch | --full]] [--slurm-timeout S]",
               "scancel JOBID (SIGTERM, then SIGKILL after Slurm's KillWait). --signal SIG only "
               "signals the job's steps (USR1: the ranks save and exit 0, the job ends); "
               f"--batch: the batch shell only (USR1 there: ${ENV_STOP_FILE} and USR1 to "
               "the ranks; requeued only if they saved: docs/sbatch.md, Preemption); --full: "
               "both."),
}


class SlurmJobFailed(LaunchError):
    """The watched job ended in a state other than COMPLETED."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sbatch", help="the same job as a Slurm batch script: write, submit, follow",
        description="Render the job's Slurm batch script from the inventory (the same plan as "
                    "`clusterkit launch`), write it with the job's files to the job directory, "
                    "and optionally submit and follow it. Also: `clusterkit sbatch status JOBID "
                    "[--watch]` and `clusterkit sbatch cancel JOBID [--signal SIG]`.",
        epilog="The program comes last, as in `clusterkit launch`: [-m MODULE] [SCRIPT] "
               "[ARGS...]. `clusterkit sbatch status --help` and `clusterkit sbatch cancel "
               "--help` describe the two actions.")
    # The action form's flags are read before the program words too (sbatch --watch status 1).
    p.set_defaults(**{safety.PROGRAM_ACTIONS: ACTIONS})
    add_inventory_option(p)
    add_selection_options(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the script, write nothing")
    mode.add_argument("--write-only", action="store_true",
                      help="write the job directory and print the sbatch line (the default)")
    mode.add_argument("--submit", action="store_true", help="write the job directory and run sbatch")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (slurm_job_id, job_id, job_dir, script) "
                        "instead of text; other messages go to stderr")
    _add_action_flags(p)
    _add_site_options(p)
    add_job_options(p)
    p.set_defaults(func=cmd_sbatch)


def _add_site_options(p: argparse.ArgumentParser) -> None:
    """Site needs only the batch script has (docs/sbatch.md, "Site flags")."""
    s = p.add_argument_group("Slurm site")
    s.add_argument("--exclusive", action="store_true", help="#SBATCH --exclusive: whole nodes")
    s.add_argument("--mem", metavar="SIZE", help="#SBATCH --mem per node, e.g. 200G (0: all)")
    s.add_argument("--constraint", metavar="FEATURES", help="#SBATCH --constraint, e.g. a100")
    s.add_argument("--gpu-type", metavar="TYPE",
                   help="typed GPU request: #SBATCH --gpus-per-node=TYPE:N")
    s.add_argument("--signal-lead", type=duration_type("--signal-lead", zero=False, whole=True),
                   default=DEFAULT_SIGNAL_LEAD_S, metavar="S",
                   help="USR1 this many seconds before the time limit (default %(default)s): "
                        "enough for one checkpoint save")
    s.add_argument("--sbatch-arg", action="append", default=[], metavar="LINE",
                   help="one more #SBATCH option, e.g. --sbatch-arg=--reservation=r1 (repeatable)")
    s.add_argument("--template-dir", metavar="DIR", type=nonempty,
                   help="render DIR/sbatch.sh.j2 instead of clusterkit's template (checked with "
                        "bash -n; with --submit also sbatch --test-only)")


def _add_action_flags(p: argparse.ArgumentParser) -> None:
    """Flags of `--submit --watch` and of the two actions (status, cancel)."""
    _add_watch_flags(p)
    _add_slurm_timeout(p)
    _add_cancel_flags(p)


def _add_watch_flags(p: argparse.ArgumentParser) -> None:
    """`--submit --watch` and `status JOBID`."""
    p.add_argument("--watch", action="store_true",
                   help="with --submit (or status): follow the output until the job ends; "
                        "exit 0 only if it COMPLETED")
    p.add_argument("--poll", type=duration_type("--poll", zero=False), default=1.0, metavar="S",
                   help="seconds between job state polls while watching (default 1)")
    add_ranks_option(p)  # whose lines --watch shows, as in clusterkit launch


def _add_slurm_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slurm-timeout", type=duration_type("--slurm-timeout", zero=False),
                   default=30.0, metavar="S",
                   help="timeout for each sbatch/scontrol/scancel call (default 30)")


def _add_cancel_flags(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cancel JOBID")
    c.add_argument("--signal", metavar="SIG", help="only send SIG (e.g. USR1) instead of cancelling")
    c.add_argument("--batch", action="store_true", help="with --signal: the batch shell only")
    c.add_argument("--full", action="store_true", help="with --signal: batch shell and all steps")


def _action_words(args: argparse.Namespace) -> tuple[str, str]:
    """`status JOBID [FLAGS]` / `cancel JOBID [FLAGS]`: the words after the action are
    parsed here (they are not a program), into the same namespace."""
    action, *words = args.program
    usage, text = ACTION_USAGE[action]
    p = Parser(prog=f"clusterkit sbatch {action}", usage=usage, description=text)
    p.add_argument("slurm_job", nargs="?", metavar="JOBID")
    (_add_cancel_flags if action == "cancel" else _add_watch_flags)(p)
    _add_slurm_timeout(p)
    parsed = p.parse_args(words, namespace=args)  # --help: the action's own help
    if parsed.slurm_job is None:
        raise LaunchError(f"usage: clusterkit sbatch {action} JOBID", key=action)
    return action, str(parsed.slurm_job)


def cmd_sbatch(args: argparse.Namespace) -> int:
    # `status`/`cancel` as the first program word: the action form (a script by either
    # name needs a path: ./status).
    if args.program[:1] and args.program[0] in ACTIONS and args.module is None \
            and getattr(args, SCRIPT_OPTION) is None:
        action, slurm_job = _action_words(args)
        return _action(SlurmClient(timeout_s=args.slurm_timeout), action, slurm_job, args)
    client = SlurmClient(timeout_s=args.slurm_timeout)
    cancel_flag = next((f for f, on in (("--signal", args.signal), ("--batch", args.batch),
                                        ("--full", args.full)) if on), None)
    if cancel_flag:  # accepted before the action word, but the job form would ignore it
        raise LaunchError("only for `clusterkit sbatch cancel JOBID`", key=cancel_flag,
                          hint=f"clusterkit sbatch cancel JOBID {cancel_flag} ...")
    if args.watch and not args.submit:
        raise LaunchError("--watch needs --submit (or: clusterkit sbatch status JOBID --watch)",
                          key="--watch")
    # The dry run asks Slurm for the --cpus-per-task default too: it prints the script
    # that --write-only/--submit would write, byte for byte.
    plan, replicas = build_sbatch_plan(args, client)
    check_ranks(args.ranks, plan.world_size)
    script = plan.artifacts[slurm_submit.SCRIPT]
    if args.template_dir is not None:
        slurm_submit.bash_syntax(script, args.template_dir)
    sys.stderr.write(summary(plan))
    if args.dry_run:
        if args.json:
            print(json.dumps({"slurm_job_id": None, "job_id": plan.job_id, "job_dir": plan.job_dir,
                              "script": str(Path(plan.job_dir) / slurm_submit.SCRIPT),
                              "dry_run": True, "script_text": script}))
        else:
            sys.stdout.write(script)
        # The script reads ds_config.json etc. from the job directory at run time.
        print(f"clusterkit: dry run: nothing written. The script needs the job files in "
              f"{plan.job_dir} (written by `clusterkit sbatch ... --write-only` with the same "
              f"flags) before it can run anywhere", file=sys.stderr)
        return 0
    created = not Path(plan.job_dir).exists()
    path = _write_job_dir(plan)
    if not args.submit:
        _report(args, f"wrote {path} (submit with: sbatch {path}, or rerun with --submit)",
                None, plan, path)
        return 0
    job_id = slurm_submit.submit(client, plan, path, args.template_dir, replicas=replicas,
                    remove_on_refusal=created)
    atomic_write_text(Path(plan.job_dir) / "slurm_job_id", job_id + "\n")
    _register(plan.job_dir, job_id)
    _report(args, f"submitted Slurm job {job_id} (clusterkit job {plan.job_id}); script {path}",
            job_id, plan, path)
    if not args.watch:
        if not args.json:
            print(f"follow it with: clusterkit sbatch status {job_id} --watch")
        return 0
    return _watch(client, job_id, args, sys.stderr if args.json else sys.stdout)


def _register(job_dir: str, slurm_id: str) -> None:
    """The job in the local registry (launch/registry.py): collect-ckpt finds it by
    clusterkit's id or Slurm's. The job is submitted already: a failure only warns."""
    from clusterkit.launch.registry import Registry

    try:
        Registry(clusterkit_home()).record_sbatch(job_dir, slurm_id)
    except (OSError, ClusterkitError) as exc:
        print(f"clusterkit: warning: job not recorded in the local registry ({exc}); "
              f"collect-ckpt takes its job dir instead: {job_dir}", file=sys.stderr)


def _write_job_dir(plan: LaunchPlan) -> Path:
    write_job_files(plan, plan.job_dir)
    # A run killed hard after a conversion left its plain config as NAME.plain, which the
    # next run's start would move back over the file just written (a new DeepSpeed config).
    for name in plan.job_files:
        Path(plan.job_dir, name + SLURM_PLAIN_SUFFIX).unlink(missing_ok=True)
    slurm_submit.write_node_program(plan)
    # Slurm opens --output/--error before the script runs: a missing directory fails
    # the job at launch (JobLaunchFailure), so it must exist before sbatch.
    Path(plan.job_dir, JobDir.LOGS).mkdir(parents=True, exist_ok=True)
    return Path(plan.job_dir) / slurm_submit.SCRIPT


def _report(args: argparse.Namespace, text: str, slurm_id: str | None, plan: LaunchPlan,
            path: Path) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)
    if not args.json:
        return
    print(json.dumps({"slurm_job_id": slurm_id, "job_id": plan.job_id, "job_dir": plan.job_dir,
                      "script": str(path)}))
    sys.stdout.flush()


def site_options(args: argparse.Namespace) -> SlurmSite:
    return SlurmSite(exclusive=args.exclusive, mem=args.mem, constraint=args.constraint,
                     gpu_type=args.gpu_type, signal_lead_s=int(args.signal_lead),
                     extra_lines=tuple(args.sbatch_arg), template_dir=args.template_dir)


def build_sbatch_plan(args: argparse.Namespace, client: SlurmClient | None = None
                      ) -> tuple[LaunchPlan, int]:
    """The plan, its batch script rendered with the site flags, and its replica count.
    ``client``: ask Slurm for the nodes' CPUs when --cpus-per-task is not given (None:
    do not ask)."""
    inv = resolve_inventory(args.inventory)
    options = slurm_submit.absolute_script(job_options(args, inv.name), os.getcwd())
    if launcher_given(args) and BACKENDS[args.launcher].native:
        # Not a silent torchrun: native's agents fork the ranks, which Slurm's srun does here.
        raise RenderError(f"{args.launcher} is clusterkit launch's own (its agents "
                          "start the ranks); a Slurm batch script starts them with srun",
                          key="--launcher", hint="leave --launcher out (torchrun under srun), "
                          "or pick torchrun, accelerate or deepspeed")
    # --launcher X submits the batch script of X's Slurm variant (the registry's sbatch_plan).
    options = dataclasses.replace(options, backend=BACKENDS[args.launcher].sbatch_plan)
    return slurm_submit.sbatch_plan(inv, options, job_facts(args, inv), site_options(args), client)


def _action(client: SlurmClient, action: str, job_id: str, args: argparse.Namespace) -> int:
    if action == "cancel":
        if (args.batch or args.full) and not args.signal:
            raise LaunchError("--batch/--full only go with --signal", key="--signal")
        client.cancel(job_id, signal=args.signal, batch=args.batch, full=args.full)
        what = f"sent {args.signal} to" if args.signal else "cancelled"
        print(f"{what} Slurm job {job_id}")
        return 0
    if args.watch:
        return _watch(client, job_id, args)
    info = client.show(job_id)
    for line in [status_line(info), *slurm_job_health_lines(clusterkit_home(), job_id)]:
        print(line)  # a node-local job's checkpoints and their replicas, as `clusterkit status`
    # The job's outcome, as for --watch: 0 pending, running or COMPLETED; 1 any other end.
    return EXIT_JOB_FAILED if info.finished and not info.succeeded else 0


def _watch(client: SlurmClient, job_id: str, args: argparse.Namespace,
           out: TextIO | None = None) -> int:
    try:
        info = watch(client, job_id, out or sys.stdout, sys.stderr, poll_s=args.poll,
                     ranks=args.ranks)
    except KeyboardInterrupt:
        # Stopping the watch must not stop the job: say how to do either.
        print(f"clusterkit: stopped watching; job {job_id} keeps running "
              f"(clusterkit sbatch cancel {job_id} to stop it)", file=sys.stderr)
        raise
    if info.succeeded:
        print(f"clusterkit: Slurm job {job_id} COMPLETED", file=sys.stderr)
        return 0
    raise SlurmJobFailed(f"Slurm job {job_id} ended {info.describe()}",
                         hint=output_hint(info), exit_code=EXIT_JOB_FAILED)
