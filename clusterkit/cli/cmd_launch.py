"""clusterkit launch | status | stop (docs/launch.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from datetime import datetime
from typing import Any

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.common import (
    add_inventory_option,
    add_ranks_option,
    add_selection_options,
    check_ranks,
    clusterkit_home,
    job_facts,
    resolve_inventory,
)
from clusterkit.cli.jobflags import (
    add_job_flags,
    add_program,
    add_run_flags,
    job_id_type,
    job_options,
    run_options,
)
from clusterkit.errors import LaunchError
from clusterkit.hostrange import folded_lines
from clusterkit.launchers import BACKENDS
from clusterkit.node.contract import SUMMARY_PREFIX, JobDir
from clusterkit.node.protocol import DEFAULT_GRACE_S, ProtocolError, StopReply
from clusterkit.spec.jobrecord import JobState
from clusterkit.units import duration_type


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

    s = sub.add_parser("status", help="jobs launched from here and whether their ranks still run")
    s.add_argument("job", nargs="?", metavar="JOB", type=job_id_type,
                   help="one job: per-node liveness")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    st = sub.add_parser("stop", help="stop a job on every node (only that job's processes)")
    st.add_argument("job", metavar="JOB", type=job_id_type)
    st.add_argument("--grace", type=duration_type("--grace"), default=DEFAULT_GRACE_S,
                    metavar="S")
    st.set_defaults(func=cmd_stop)


# ------------------------------------------------------------------ launch


def _fresh_job_id(cluster: str) -> str:
    """The default id, made unique against the registry: a new job never continues an old one."""
    from clusterkit.launch.jobs import Registry
    from clusterkit.spec.job import default_job_id

    base = default_job_id(cluster, datetime.now())
    registry = Registry(clusterkit_home())
    job_id, n = base, 1
    while registry.path(job_id).exists():
        n += 1
        job_id = f"{base}-{n}"
    return job_id


def _options(args: argparse.Namespace, cluster: str) -> Any:
    # --max-restarts is clusterkit's own relaunch here (LaunchSettings.relaunches): the
    # ranks' launcher itself must not restart them too (the plan's max_restarts: 0).
    options = job_options(args, job_id=args.job_id or _fresh_job_id(cluster))
    return dataclasses.replace(options, max_restarts=0)


def cmd_launch(args: argparse.Namespace) -> int:
    from clusterkit.launch.console import make_sink
    from clusterkit.launch.gate import ops_step
    from clusterkit.launch.jobs import Registry
    from clusterkit.launch.run import LaunchSettings, launch
    from clusterkit.plan.build import plan_job
    from clusterkit.remote.dispatch import transport_for

    inventory = resolve_inventory(args.inventory)
    if args.max_restarts < 0:
        raise LaunchError("--max-restarts must be >= 0", key="--max-restarts")
    for key, value in (("--hang-timeout", args.hang_timeout_s),
                       ("--keepalive-timeout", args.keepalive_s)):
        if value < 0:
            raise LaunchError(f"{key} must be >= 0 (0: off)", key=key)
    facts = job_facts(args, inventory)  # + doctor's interface pick
    options = _options(args, inventory.name)

    shown: set[str] = set()

    def planner(o: Any) -> Any:
        plan = plan_job(inventory, o, facts)
        for warning in plan.warnings:  # --strict made them errors already
            if warning not in shown:  # made again when a restart drops nodes
                shown.add(warning)
                print(f"clusterkit: warning: {warning}", file=sys.stderr)
        return plan

    first = planner(options)  # the one plan; launch() reuses it
    check_ranks(args.ranks, first.world_size)
    if args.dry_run:
        _print_plan(first, native=BACKENDS[args.launcher].native)
        _dry_run_checks(args, first)  # exit 2 where the launch would refuse
        return 0
    _check_here(args, first)  # what the dry run checks here, before anything starts
    settings = LaunchSettings(run=run_options(args), relaunches=args.max_restarts,
                              native=BACKENDS[args.launcher].native)
    # The code to every node's workdir, then the JIT ops built where missing, before
    # anything starts there (and again before each restart: a spare gets both).
    sync = _syncer(args.sync, ops_step(args.build_ops, lambda t: print(f"[clusterkit] {t}")))
    if sync is not None:
        sync(first)
    sink = make_sink(len(first.nodes), quiet_ranks=args.quiet, world_size=first.world_size,
                     ranks=args.ranks, launcher_logs=_launcher_logs(first))
    registry = Registry(clusterkit_home())
    with transport_for() as transport:
        try:
            result = launch(options, planner, transport, registry, settings, sink,
                            decisions=first, prepare=_preparer(registry, transport, sink),
                            sync=sync)
        finally:
            sink.close()
    _print_summary(result)
    _save_summary(registry, result)
    return result.exit_code


def _launcher_logs(plan: Any) -> str:
    """Where each node's launcher lines are kept, for the console's folded teardown line."""
    dirs = {n.job_dir for n in plan.nodes}
    return JobDir(dirs.pop() if len(dirs) == 1 else "<job dir>").node_log("<node>")


def _syncer(sync_dir: str | None, then: Any = None) -> Any:
    """``--sync DIR`` to a plan's nodes, at the first start and before each restart (a
    spare that took a dropped node's place gets DIR; the others are sent nothing when
    they hold it): raises unless every node then holds DIR's digest."""
    if sync_dir is None:
        return then
    from clusterkit.cli.cmd_sync import run_sync

    def sync(plan: Any) -> None:
        run_sync(sync_dir, [n.host for n in plan.nodes])
        if then is not None:  # the JIT ops (launch/gate.py ops_step)
            then(plan)

    return sync


def _preparer(registry: Any, transport: Any, sink: Any) -> Any:
    """Readies a continued node-local job's checkpoint before its agents start (spare
    restore, reshard, the refusal: docs/lost-a-node.md), through a staging dir beside
    the job record."""
    from clusterkit.jobs.recover import prepare_continue

    def prepare(plan: Any, prior: Any) -> Any:  # the next attempt's plan, or None
        return prepare_continue(transport, plan, prior, str(registry.path(plan.job_id).parent),
                                sink.info)

    return prepare


def _check_here(args: argparse.Namespace, plan: Any) -> bool:
    """The launch's checks on this machine (script, --sync DIR), the same for a dry run
    and a launch; True when --sync brings the script (launch/gate.py)."""
    from clusterkit.launch.gate import check_here

    return check_here(plan, args.sync, gate=not args.skip_checks)


def _dry_run_checks(args: argparse.Namespace, plan: Any) -> None:
    """Every check a launch makes before starting, made now (issue 25): the ones here,
    then the gate the agents run on every node (interpreter and package parity, the
    script, the checkpoint dir created and written, the master address and port), run
    on its own. Raises the launch's own refusal; prints what passed."""
    from clusterkit.launch.gate import gate_error, gate_nodes, ready_job_ops, run_gate
    from clusterkit.launch.jobs import Registry
    from clusterkit.launch.run import check_continue, gate_needs
    from clusterkit.remote.dispatch import transport_for

    synced = _check_here(args, plan)
    # A --job-id still running, or a node-local job on another rank->node mapping.
    registry = Registry(clusterkit_home())
    prior = registry.find(plan.job_id)
    note = check_continue(plan, prior)
    if note:
        print(note)
    if prior is not None and plan.node_local and prior.ckpt.rank_map is not None:
        from clusterkit.jobs.recover import prepare_continue

        # The launch's checkpoint check: assembled from the nodes and replicas, or refused.
        with transport_for() as transport:
            prepare_continue(transport, plan, prior, str(registry.path(plan.job_id).parent),
                             print, dry_run=True)
    if args.build_ops:  # what the launch would build, and its refusals (stale locks)
        with transport_for() as transport:
            ready_job_ops(transport, plan, print, build=False)
    if args.skip_checks:
        print("pre-launch checks on the nodes: skipped (--skip-checks)")
        return
    with transport_for() as transport:
        result = run_gate(transport, gate_nodes(plan, synced=synced), need=gate_needs(plan),
                          same_python=BACKENDS[plan.backend].same_python)
    if not result.ok:
        raise gate_error(result)
    script = "" if plan.options.script is None or synced else f"{plan.options.script}, "
    print(f"pre-launch checks passed on {len(plan.nodes)} nodes: same Python and packages, "
          f"{script}job and checkpoint dirs writable, master {plan.master_addr} resolves, "
          f"port {plan.master_port} free")


def _print_plan(decisions: Any, native: bool) -> None:
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
    print("files written to every node's job dir: " + ", ".join(sorted(plan.artifacts)))
    print("each node runs: the clusterkit node agent, sent over SSH to <python> (the command "
          "above as its child)")


def _stopped_where(out: Any) -> str:
    """Say so when some nodes could not be checked (partition): their agents' dead-man
    switch stops the ranks there, but nobody saw it happen (issue 14)."""
    if not out.unconfirmed:
        return "every rank on every node was stopped"
    from clusterkit.hostrange import fold

    return (f"every rank on the other nodes was stopped; {fold(out.unconfirmed)} could not be "
            "confirmed (unreachable: its agent stops its ranks by itself)")


def _print_summary(result: Any) -> None:
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
    for node, count in out.leftovers.items():
        print(f"[clusterkit] warning: {count} process(es) of this job still on {node}; "
              f"run `clusterkit stop {plan.job_id}`", file=sys.stderr)
    if out.summary is not None:
        s = out.summary
        keys = ("final_loss", "steps_run", "global_step", "resumed_from", "tokens_per_s")
        brief = ", ".join(f"{k}={_fmt(s[k])}" for k in keys if k in s)
        if brief:
            print(f"[clusterkit] summary: {brief}")
        print(SUMMARY_PREFIX + json.dumps(s, sort_keys=True))


def _save_summary(registry: Any, result: Any) -> None:
    """Rank 0's summary, once, beside the job record (``jobs/<JOB>/summary.json``)."""
    from clusterkit.fsutil import atomic_write_text

    summary = result.outcomes[-1].summary
    if summary is not None:
        path = registry.path(result.plan.job_id).parent / JobDir.SUMMARY
        atomic_write_text(path, json.dumps(summary, sort_keys=True, indent=1) + "\n")


def _fmt(value: Any) -> str:
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


# ------------------------------------------------------------------ status / stop


def cmd_status(args: argparse.Namespace) -> int:
    from clusterkit.launch.jobs import Registry

    registry = Registry(clusterkit_home())
    if args.job is None:
        records = registry.all()
        if args.json:
            print(json.dumps([json.loads(r.to_json()) for r in records], indent=1))
            return 0
        if not records:
            print("no jobs launched from this machine")
        for r in records:
            state = r.state_shown
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created))
            where = (f"slurm {r.slurm_job_ids[-1] if r.slurm_job_ids else '?':>5}"
                     if r.transport == "slurm" else f"{len(r.nodes):>3} nodes")
            print(f"{r.job_id:<36} {r.launcher_shown:<11} {where}  {when}  {state}"
                  + (f"  exit {r.exit_code}" if r.exit_code is not None else "")
                  + (f"  ({r.failure})" if r.failure else ""))
        return 0
    record = registry.load(args.job)
    if record.transport == "slurm":
        return _slurm_record_status(record, args.json)
    per_node = _node_status(record)
    ckpts = _checkpoint_health(record)
    if args.json:
        print(json.dumps({"job": json.loads(record.to_json()), "launcher": record.launcher_shown,
                          "nodes": per_node,
                          "checkpoints": ckpts.to_json() if ckpts else None}, indent=1))
        return 0
    print(f"{record.job_id}: {record.state.value}" + (f" (exit {record.exit_code})"
                                                      if record.exit_code is not None else "")
          + f"  launcher {record.launcher_shown}")
    rows: list[tuple[str, str]] = []  # nodes with the same state share one line
    for node, info in per_node.items():
        if "error" in info:
            rows.append((node, f"unreachable: {info['error']}"))
        else:
            rows.append((node, f"agent {'up' if info['agent_alive'] else 'down'}  "
                               f"processes {info['processes']}  {_ranks_text(info)}"
                               + _progress_text(info.get("progress"), info["agent_alive"])))
    for line in folded_lines(rows, list(per_node)):
        print(f"  {line}")
    for line in ckpts.lines() if ckpts else ():
        print(f"  {line}")
    return 0


def _checkpoint_health(record: Any) -> Any:
    """A node-local job's replica health per checkpoint (checkpoints/replicas/health.py)."""
    from clusterkit.checkpoints.replicas.health import job_health
    from clusterkit.remote.dispatch import transport_for

    with transport_for() as transport:
        return job_health(transport, record.nodes, record.ckpt)


def _slurm_command(record: Any, action: str) -> str:
    slurm_id = record.slurm_job_ids[-1] if record.slurm_job_ids else "JOBID"
    return f"clusterkit sbatch {action} {slurm_id}"


def _slurm_record_status(record: Any, as_json: bool) -> int:
    """A batch job's nodes are Slurm's to report: say which Slurm job it is and where to
    look, instead of 'submitted' on 0 nodes (its agents are Slurm's steps, not ours)."""
    ids = ",".join(record.slurm_job_ids) or "?"
    if as_json:
        print(json.dumps({"job": json.loads(record.to_json()), "launcher": record.launcher_shown,
                          "slurm_job_ids": record.slurm_job_ids}, indent=1))
        return 0
    print(f"{record.job_id}: Slurm job {ids} (submitted by clusterkit sbatch; job dir "
          f"{record.job_dir})  launcher {record.launcher_shown}")
    print(f"  its state and output: {_slurm_command(record, 'status')} [--watch]")
    return 0


def _ranks_text(info: dict[str, Any]) -> str:
    """``ranks 0,1 (pids 4711,4712)  fork server pid 4700``: what `ps` and `kill` need."""
    pids = info.get("pids") if isinstance(info.get("pids"), dict) else {}
    ranks = [str(x) for x in info.get("ranks", [])]
    text = f"ranks {','.join(ranks) or '-'}"
    if pids:
        text += " (pids " + ",".join(str(pids.get(r, "?")) for r in ranks) + ")"
    for key, what in (("launcher_pid", "launcher pid"), ("fork_server_pid", "fork server pid")):
        if isinstance(info.get(key), int):
            text += f"  {what} {info[key]}"
    return text


def _progress_text(progress: Any, alive: bool) -> str:
    """``  step 57, last progress 10:41:07 (3 s ago)`` while the agent runs (issue 14)."""
    if not alive or not isinstance(progress, dict) or progress.get("age_s") is None:
        return ""
    age = float(progress["age_s"])
    when = time.strftime("%H:%M:%S", time.localtime(time.time() - age))
    step = progress.get("step")
    return ("  " + (f"step {step}, " if step is not None else "")
            + f"last progress {when} ({age:.0f} s ago)")


def _node_status(record: Any) -> dict[str, dict[str, Any]]:
    from clusterkit.launch.orchestrator import agent_control
    from clusterkit.remote.dispatch import transport_for

    cmds = {n.node: agent_control(n.python, "--status", record.job_id, "--job-dir", n.job_dir,
                                  "--node", n.node) for n in record.nodes}
    out: dict[str, dict[str, Any]] = {}
    with transport_for() as transport:
        for r in transport.run_all([n.target for n in record.nodes],
                                   {k: c.argv for k, c in cmds.items()}, timeout=20.0,
                                   stdin=next(iter(cmds.values())).stdin if cmds else None):
            out[r.host] = _last_json(r)
    return out


def _last_json(r: Any) -> dict[str, Any]:
    if r.error is not None:
        return {"error": r.reason()}  # without the host's name: equal errors fold
    try:
        value = json.loads(r.result.stdout.strip().splitlines()[-1])
        return value if isinstance(value, dict) else {"error": "bad answer"}
    except (ValueError, IndexError):
        tail = (r.result.stderr or r.result.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {r.result.exit_code}: {tail[0]}"}


def cmd_stop(args: argparse.Namespace) -> int:
    from clusterkit.launch.jobs import Registry
    from clusterkit.launch.orchestrator import agent_control
    from clusterkit.remote.dispatch import transport_for

    registry = Registry(clusterkit_home())
    record = registry.load(args.job)
    if record.transport == "slurm":
        raise LaunchError(f"job {record.job_id} is Slurm job "
                          f"{','.join(record.slurm_job_ids) or '?'}: Slurm stops it, not clusterkit's "
                          "agents", key="JOB", hint=f"run `{_slurm_command(record, 'cancel')}`")
    if record.launcher_alive:
        # The launcher tears the job down itself (and records it); the sweep below
        # still runs in case a node is beyond its reach.
        os.kill(record.launcher_pid, signal.SIGTERM)
    cmds = {n.node: agent_control(n.python, "--stop", record.job_id, "--grace", f"{args.grace:g}")
            for n in record.nodes}
    failed = 0
    with transport_for() as transport:
        results = transport.run_all([n.target for n in record.nodes],
                                    {k: c.argv for k, c in cmds.items()},
                                    timeout=args.grace + 20.0,
                                    stdin=next(iter(cmds.values())).stdin if cmds else None)
    rows: list[tuple[str, str]] = []  # nodes that fared the same share one line
    for r in results:
        info = _last_json(r)  # `agent --stop`'s reply (node/protocol.py), or an error
        try:
            reply = None if "error" in info else StopReply.from_dict(info)
        except ProtocolError as exc:
            reply, info = None, {"error": str(exc)}
        if reply is None:
            failed += 1
            rows.append((r.host, f"could not stop: {info['error']}"))
        else:
            rows.append((r.host, f"signalled {reply.signalled}, killed {reply.killed}, "
                                 f"left {reply.left}"))
            failed += bool(reply.left)
    for line in folded_lines(rows, [n.node for n in record.nodes]):
        print(f"  {line}")
    if record.state is JobState.RUNNING and not record.launcher_alive:
        record.state = JobState.STOPPED
        registry.save(record)
    if failed:
        raise LaunchError(f"could not stop job {record.job_id} on {failed} node(s)",
                          hint="check the nodes above; run `clusterkit stop` again")
    print(f"job {record.job_id}: no process left on {len(record.nodes)} node(s)")
    return 0
