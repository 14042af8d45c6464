"""One launch from this machine, end to end: ``clusterkit launch`` and ``clusterkit.api.launch``.

:func:`plan_launch` turns the job options into the first plan (the job id, the
launcher's plan backend, this machine's facts, the plan's warnings shown once);
:func:`run_launch` makes the checks here, puts ``--sync DIR`` and the JIT ops on the
nodes, runs ``launch.run.launch`` with a console and the recovery hook
(jobs/recover.py), and keeps rank 0's summary beside the job record. The dry run
(:func:`dry_run_checks`) makes every check the launch would make, and starts nothing.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from clusterkit.errors import LaunchError
from clusterkit.fold import check_ranks
from clusterkit.fsutil import atomic_write_text
from clusterkit.inventory import Inventory
from clusterkit.jobs.here import clusterkit_home, launch_facts
from clusterkit.jobs.recover import prepare_continue
from clusterkit.launch.console import Sink, make_sink
from clusterkit.launch.continuation import check_continue
from clusterkit.launch.gate import (
    check_here,
    gate_error,
    gate_nodes,
    ops_step,
    ready_job_ops,
    run_gate,
    script_is_here,
)
from clusterkit.launch.recording import recording
from clusterkit.launch.registry import JobRecord, Registry
from clusterkit.launch.run import LaunchResult, LaunchSettings, Preparer, Syncer, gate_needs, launch
from clusterkit.launchers import BACKENDS, DEFAULT_LAUNCHER
from clusterkit.node.contract import JobDir
from clusterkit.plan.build import plan_job
from clusterkit.remote.base import Transport
from clusterkit.remote.dispatch import transport_for
from clusterkit.spec.job import JobOptions, JobPlan, RunOptions, default_job_id

Say = Callable[[str], None]


def warn_stderr(text: str) -> None:
    """A plan warning as every verb shows it."""
    print(f"clusterkit: warning: {text}", file=sys.stderr)


def say_launch(text: str) -> None:
    """A launch's own line (the JIT ops step), as the console's ``[clusterkit]`` lines."""
    print(f"[clusterkit] {text}")


@dataclass(frozen=True)
class Sync:
    """``launch --sync DIR``: the directory, and what puts it on a plan's nodes and
    raises unless every node then holds its digest (``clusterkit sync``'s own code,
    which prints its progress). Run before the first start and before each restart."""

    source: str
    put: Syncer


@dataclass(frozen=True)
class LaunchRequest:
    """A launch planned and not started: the job (its id chosen), the first plan (the
    one ``launch`` reuses) and the planner a restart that drops nodes plans again with."""

    inventory: Inventory
    options: JobOptions
    plan: JobPlan
    planner: Callable[[JobOptions], JobPlan]
    relaunches: int  # launch's --max-restarts: clusterkit's own relaunches
    launcher: str


def fresh_job_id(cluster: str, registry: Registry) -> str:
    """The default id, made unique against the registry: a new job never continues an old one."""
    base = default_job_id(cluster, datetime.now())
    job_id, n = base, 1
    while registry.path(job_id).exists():
        n += 1
        job_id = f"{base}-{n}"
    return job_id


def launch_options(options: JobOptions, cluster: str, *, launcher: str = DEFAULT_LAUNCHER,
                   home: Path | None = None) -> JobOptions:
    """The job a launch runs: an empty ``job_id`` gets the default id (a new job); the
    plan backend is the launcher's; ``max_restarts`` is clusterkit's own relaunch here
    (the request's ``relaunches``), so the ranks' launcher must not restart them too."""
    if launcher not in BACKENDS:
        raise LaunchError(f"unknown launcher {launcher!r}", key="--launcher",
                          hint=f"one of {', '.join(BACKENDS)}")
    job_id = options.job_id or fresh_job_id(cluster, Registry(home or clusterkit_home()))
    return dataclasses.replace(options, job_id=job_id, max_restarts=0,
                               backend=BACKENDS[launcher].plan_backend)


def check_values(options: JobOptions, run: RunOptions) -> None:
    """The numbers a launch refuses before planning (the parser's types let them by)."""
    if options.max_restarts < 0:
        raise LaunchError("--max-restarts must be >= 0", key="--max-restarts")
    for key, value in (("--hang-timeout", options.hang_timeout_s),
                       ("--keepalive-timeout", run.keepalive_s)):
        if value < 0:
            raise LaunchError(f"{key} must be >= 0 (0: off)", key=key)


def plan_launch(options: JobOptions, inventory: Inventory, *, run: RunOptions,
                launcher: str = DEFAULT_LAUNCHER, master_addr: str | None = None,
                warn: Say = warn_stderr) -> LaunchRequest:
    """The first plan of a launch; each plan warning shown once (``--strict`` made them
    errors already), also when a restart that drops nodes plans again."""
    check_values(options, run)
    facts = launch_facts(cluster=inventory.name, script=options.script, master_addr=master_addr,
                         args=options.script_args)
    job = launch_options(options, inventory.name, launcher=launcher)
    shown: set[str] = set()

    def planner(o: JobOptions) -> JobPlan:
        plan = plan_job(inventory, o, facts)
        for warning in plan.warnings:
            if warning not in shown:
                shown.add(warning)
                warn(warning)
        return plan

    return LaunchRequest(inventory, job, planner(job), planner, options.max_restarts, launcher)


def run_launch(request: LaunchRequest, *, run: RunOptions, sync: Sync | None = None,
               quiet: bool = False, ranks: frozenset[int] | None = None) -> LaunchResult:
    """Start the planned job, stream its lines to the console, tear it down; returns
    when it ended (its last attempt's exit code in the result). Raises a
    :class:`~clusterkit.errors.ClusterkitError` where the launch refuses to start."""
    first = request.plan
    check_ranks(ranks, first.world_size)
    check_here(first, sync.source if sync else None, gate=not run.skip_checks)
    settings = LaunchSettings(run=run, relaunches=request.relaunches,
                              native=BACKENDS[request.launcher].native)
    # The code to every node's workdir, then the JIT ops built where missing, before
    # anything starts there (and again before each restart: a spare gets both).
    before = _steps(sync.put if sync else None, ops_step(run.build_ops, say_launch))
    if before is not None:
        before(first)
    sink = recording(make_sink(len(first.nodes), quiet_ranks=quiet, world_size=first.world_size,
                               ranks=ranks, launcher_logs=launcher_logs(first)))
    registry = Registry(clusterkit_home())
    with transport_for() as transport:
        try:
            result = launch(request.options, request.planner, transport, registry, settings,
                            sink, decisions=first, prepare=preparer(registry, transport, sink),
                            sync=before)
        finally:
            sink.close()
    save_summary(registry, result)
    return result


def _steps(*steps: Syncer | None) -> Syncer | None:
    """The steps before a start, in order, as one (None: there are none)."""
    todo = [s for s in steps if s is not None]
    if not todo:
        return None

    def run(plan: JobPlan) -> None:
        for step in todo:
            step(plan)

    return run


def launcher_logs(plan: JobPlan) -> str:
    """Where each node's launcher lines are kept, for the console's folded teardown line."""
    dirs = {n.job_dir for n in plan.nodes}
    return JobDir(dirs.pop() if len(dirs) == 1 else "<job dir>").node_log("<node>")


def preparer(registry: Registry, transport: Transport, sink: Sink) -> Preparer:
    """Readies a continued node-local job's checkpoint before its agents start (spare
    restore, reshard, the refusal: docs/lost-a-node.md), through a staging dir beside
    the job record."""

    def prepare(plan: JobPlan, prior: JobRecord) -> JobPlan | None:
        return prepare_continue(transport, plan, prior, str(registry.path(plan.job_id).parent),
                                sink.info)

    return prepare


def save_summary(registry: Registry, result: LaunchResult) -> None:
    """Rank 0's summary, once, beside the job record (``jobs/<JOB>/summary.json``)."""
    summary = result.outcomes[-1].summary
    if summary is not None:
        path = registry.path(result.plan.job_id).parent / JobDir.SUMMARY
        atomic_write_text(path, json.dumps(summary, sort_keys=True, indent=1) + "\n")


def dry_run_checks(plan: JobPlan, *, run: RunOptions, sync_dir: str | None = None,
                   say: Say = print) -> None:
    """Every check a launch makes before starting, made now (issue 25): the ones here,
    then the gate the agents run on every node (interpreter and package parity, the
    script, the checkpoint dir created and written, the master address and port), run
    on its own. Raises the launch's own refusal; says what passed."""
    synced = check_here(plan, sync_dir, gate=not run.skip_checks)
    if plan.profile is not None and not plan.options.uses_workload:
        say(plan.profile.line())  # which profile, and why (issue 38, docs/programs.md)
    # A --job-id still running, or a node-local job on another rank->node mapping.
    registry = Registry(clusterkit_home())
    prior = registry.find(plan.job_id)
    note = check_continue(plan, prior)
    if note:
        say(note)
    if prior is not None and plan.node_local and prior.ckpt.rank_map is not None:
        # The launch's checkpoint check: assembled from the nodes and replicas, or refused.
        with transport_for() as transport:
            prepare_continue(transport, plan, prior, str(registry.path(plan.job_id).parent),
                             say, dry_run=True)
    if run.build_ops:  # what the launch would build, and its refusals (stale locks)
        with transport_for() as transport:
            ready_job_ops(transport, plan, say, build=False)
    if run.skip_checks:
        say("pre-launch checks on the nodes: skipped (--skip-checks)")
        return
    with transport_for() as transport:
        result = run_gate(transport, gate_nodes(plan, synced=synced), need=gate_needs(plan),
                          same_python=BACKENDS[plan.backend].same_python,
                          script_here=script_is_here(plan))
    if not result.ok:
        raise gate_error(result)
    script = "" if plan.options.script is None or synced else f"{plan.options.script}, "
    say(f"pre-launch checks passed on {len(plan.nodes)} nodes: same Python and packages, "
        f"{script}job and checkpoint dirs writable, master {plan.master_addr} resolves, "
        f"port {plan.master_port} free")
