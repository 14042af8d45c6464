"""One launch, start to end: gate → agents → outcome, and restarts after a failure.

A restart runs the same plan again (same job id, same master port, same
rank→node mapping) and the bundled workload resumes from its newest complete
checkpoint (its default ``--resume auto``). ``--drop-failed-nodes`` re-runs the
gate and plans without the nodes that now fail it. With node-local checkpoints,
whose shards resume only on the same rank→node mapping, a dropped node's place goes
to a free spare of the inventory (its part restored there from a replica), else the
bundled workload is resharded onto the remaining nodes (``jobs/recover.py`` does both,
through ``prepare``, as for a relaunch by hand); a user's program without a spare is
refused.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import assert_never

from clusterkit.errors import ClusterkitError, LaunchError
from clusterkit.launch.attempts import AttemptEnd, Next, RestartRules, RestartState, decide
from clusterkit.launch.console import Sink
from clusterkit.launch.continuation import (
    check_continue,
    continue_swaps,
    is_reshard,
    needs_ready,
    rank_map,
    reshardable,
    resume_note,
    resume_watch,
)
from clusterkit.launch.fromplan import job_from_plan
from clusterkit.launch.gate import gate_error, gate_nodes, run_gate, script_is_here
from clusterkit.launch.jobspec import JobSpec
from clusterkit.launch.orchestrator import Orchestrator
from clusterkit.launch.outcome import JobOutcome, describe_failure
from clusterkit.launch.registry import JobRecord, Registry
from clusterkit.launchers import BACKENDS, launcher_name
from clusterkit.node.contract import JobDir, StorageKind
from clusterkit.remote.base import Transport
from clusterkit.remote.unanswered import NoRedial
from clusterkit.render.artifacts import render_all
from clusterkit.spec.job import WORKLOAD_MODULE, JobOptions, JobPlan, LaunchPlan, RunOptions
from clusterkit.spec.jobrecord import JobCheckpoints, JobState
from clusterkit.spec.resume import began_fresh_line

# JobOptions -> the decisions; made again only when a restart drops nodes.
Planner = Callable[[JobOptions], JobPlan]
# Before the agents start, when a node-local job is continued: check that its newest
# checkpoint can be assembled, restore replaced nodes' parts onto their spares, or
# reshard for fewer nodes (jobs/recover.py). Gets the plan and the job's record.
# Returns the next attempt's plan when that attempt alone differs (a user's script
# resumed from a universal checkpoint: its ds_config and resume tag), else None.
Preparer = Callable[[JobPlan, JobRecord], "JobPlan | None"]
# Before a restart's ranks start: ``launch --sync DIR`` puts DIR on the attempt's nodes
# (a spare in a dropped node's place included; only what is missing travels) and
# refuses (raises) unless every node then holds DIR's digest (jobs/launch.py: ``Sync``).
Syncer = Callable[[JobPlan], None]


@dataclass(frozen=True)
class LaunchSettings:
    """How this launch runs, beside the job itself (``JobOptions``; the hang watchdog's
    limit is the job's ``hang_timeout_s``, which also sets the ranks' backend timeouts)."""

    run: RunOptions = field(default_factory=RunOptions)  # launch's runtime flags
    # clusterkit's own relaunches after a failure (launch's --max-restarts); the plan's
    # JobOptions.max_restarts is the rendered launcher's own restarts (0 under launch).
    relaunches: int = 0
    native: bool = False  # torchrun backend: the agents start the ranks themselves


@dataclass
class LaunchResult:
    exit_code: int
    outcomes: list[JobOutcome]
    plan: LaunchPlan
    # The whole job, from the first attempt's start to the last one's end (restarts,
    # their re-checks and every attempt included); outcomes[i].elapsed_s is attempt i's.
    elapsed_s: float = 0.0

    def timing(self) -> str:
        """``247.0 s`` or ``247.0 s in all (attempts 102.3 + 138.0 s)``."""
        total = f"{self.elapsed_s:.1f} s"
        if len(self.outcomes) < 2:
            return total
        each = " + ".join(f"{o.elapsed_s:.1f}" for o in self.outcomes)
        return f"{total} in all (attempts {each} s)"


def run_id(stamp: str, attempt: int) -> str:
    """One launch run: its commands are rendered for it (it names their rank-log dir)."""
    return f"{stamp}-a{attempt}"


def stamp_now() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def gate_needs(plan: JobPlan) -> tuple[str, ...]:
    """What every node must import: the backend's packages, and clusterkit itself when
    the ranks run the bundled workload (a user's script needs only a Python)."""
    needs = BACKENDS[plan.backend].gate_needs
    if WORKLOAD_MODULE in plan.program:
        needs = (*needs, "clusterkit")
    return needs


def check_nodes(transport: Transport, plan: JobPlan, sink: Sink) -> dict[str, str]:
    """The gate; returns node -> problem (empty when every node is fit)."""
    # The agents' gate, on its own: the same needs (script, checkpoint dir, master).
    result = run_gate(transport, gate_nodes(plan), need=gate_needs(plan),
                      same_python=BACKENDS[plan.backend].same_python,
                      script_here=script_is_here(plan))
    for node, why in result.problems.items():
        sink.info(f"{node}: {why}")
    return result.problems


def _without(options: JobOptions, plan: JobPlan, bad: Sequence[str]) -> JobOptions:
    """The plan's other nodes and slots, as an explicit ``--include`` (DeepSpeed's rules
    refuse ``--exclude`` beside ``--nodes``/``--gpus-per-node``, and a node count alone
    could pick a spare host the job never ran on)."""
    keep = "@".join(f"{n.name}:{','.join(map(str, n.slots))}" for n in plan.nodes
                    if n.name not in bad)
    return dataclasses.replace(options, include=keep, exclude="", nodes=None,
                               gpus_per_node=None)


def restart_plan(options: JobOptions, plan: JobPlan, planner: Planner, sink: Sink,
                 end: AttemptEnd, rules: RestartRules, state: RestartState,
                 check: Callable[[], list[str]]) -> tuple[JobPlan, JobOptions]:
    """The next attempt's plan and options: the attempt table's steps (launch/attempts.py)
    performed until one says which plan runs; ``check`` finds the nodes that fail the
    gate now. A node-local job's dropped nodes go to free spares (``--replace BAD``:
    same node index and ranks), else to fewer nodes when the bundled workload resumes
    by itself or for a user's script (resharded); anything else is refused."""
    spared, new, why = options, plan, ""
    while True:
        step = decide(end, rules, state)
        match step:
            case Next.RESTART:
                return plan, options
            case Next.CHECK:
                bad = check()
                if bad:
                    sink.info(f"dropping {', '.join(bad)} (they fail the pre-launch check now)")
                state = dataclasses.replace(state, bad=tuple(bad))
            case Next.TRY_SPARES:
                spared = dataclasses.replace(options,
                                             replace=(*options.replace, *(state.bad or ())))
                try:
                    new = planner(spared)
                except ClusterkitError as exc:
                    why = exc.message
                state = dataclasses.replace(state, spares_ok=not why)
            case Next.SPARES:
                moved = [f"{old.name} -> {n.name} (node index {i})"
                         for i, (old, n) in enumerate(zip(plan.nodes, new.nodes, strict=True))
                         if old.name != n.name]
                sink.info(f"spares take the dropped nodes' places: {', '.join(moved)}")
                return new, spared
            case Next.FEWER:
                bad = list(state.bad or ())
                if rules.node_local:
                    sink.info(f"no spare for {', '.join(bad)} ({why}): going on with fewer nodes")
                fewer = _without(options, plan, bad)
                return planner(fewer), fewer
            case Next.REFUSE:
                raise LaunchError(
                    f"cannot drop {', '.join(state.bad or ())}: node-local checkpoints resume "
                    "only on the same rank->node mapping, and no spare can take their place "
                    f"({why})",
                    hint="name spares in the inventory (`spares: [...]`); with the bundled "
                         "workload's --resume auto, a script of clusterkit's contract, HF's "
                         "Trainer or accelerate's save_state (the checkpoint resharded) or a "
                         "torch snapshot (copied as it is), the job goes on with fewer "
                         "nodes instead (docs/programs.md)")
            case Next.STOP | Next.REFUSE_GATE:
                raise AssertionError(f"launch() stops before a restart: {step}")
            case _:
                assert_never(step)


def restart_rules(settings: LaunchSettings, plan: JobPlan) -> RestartRules:
    """What the attempt table reads of the launch's options and this plan."""
    return RestartRules(relaunches=settings.relaunches,
                        drop_failed_nodes=settings.run.drop_failed_nodes,
                        node_local=plan.storage == StorageKind.NODE_LOCAL,
                        resumes_itself=reshardable(plan))


def _record(job: JobSpec, plan: JobPlan, attempt: int) -> JobRecord:
    record = JobRecord.for_job(job, plan.backend)
    record.attempts = attempt + 1
    # collect-ckpt reads dirs/slots; check_continue reads rank_map/storage; status and
    # collect-ckpt judge a user's script's saves without markers.
    record.ckpt = JobCheckpoints(storage=StorageKind(plan.storage),
                                 dir=plan.nodes[0].ckpt_dir,
                                 dirs={n.name: n.ckpt_dir for n in plan.nodes},
                                 slots=[n.nproc for n in plan.nodes], rank_map=rank_map(plan),
                                 markers=plan.options.uses_workload)
    # `clusterkit status` names the launcher the user chose (issue 25).
    record.launcher = launcher_name(plan.backend, any(t.native is not None for t in job.tasks))
    return record


def launch(options: JobOptions, planner: Planner, transport: Transport, registry: Registry,
           settings: LaunchSettings, sink: Sink, decisions: JobPlan | None = None,
           prepare: Preparer | None = None, sync: Syncer | None = None) -> LaunchResult:
    """``decisions``: the plan of ``options`` when the caller has made it already;
    ``prepare``: readies a continued node-local job's checkpoint (jobs/recover.py);
    ``sync``: run before each restart (the caller syncs before the first start)."""
    started = time.monotonic()
    decisions = decisions or planner(options)
    if decisions.profile is not None and not decisions.options.uses_workload:
        sink.info(decisions.profile.line())  # how it saves and resumes, and why (issue 38)
    prior = registry.find(decisions.job_id)
    note = check_continue(decisions, prior)
    if note:
        sink.info(note)
    once: JobPlan | None = None
    if prior is not None and decisions.storage == StorageKind.NODE_LOCAL \
            and prior.ckpt.rank_map is not None:
        if prepare is None and (continue_swaps(decisions, prior) or is_reshard(decisions, prior)):
            raise LaunchError("cannot restore or reshard node-local checkpoints from here",
                              key="--replace")
        if prepare is not None:
            once = prepare(decisions, prior)
    # The gate runs inside the agents (facts reported, nothing started until GO): no
    # separate round of SSH commands before the launch.
    need = None if settings.run.skip_checks else gate_needs(decisions)
    outcomes: list[JobOutcome] = []
    stamp = stamp_now()
    for attempt in range(settings.relaunches + 1):
        if attempt and sync is not None:
            sync(decisions)  # this attempt's nodes: a spare gets DIR, the digest re-checked
        # `once`: this attempt's plan alone (a user's script resumed from a universal
        # checkpoint); a restart on the same nodes runs the plan itself again.
        plan = render_all(once or decisions, run_id=run_id(stamp, attempt))
        once = None
        job = job_from_plan(plan, attempt=attempt, native=settings.native, run=settings.run,
                            gate_need=need, hang_timeout_s=options.hang_timeout_s)
        record = _record(job, plan, attempt)
        registry.save(record)
        # The watchdog's stack dumps also land beside the job record (issue 14).
        stacks = str(registry.path(plan.job_id).parent / JobDir.STACKS)
        # One memory of the nodes that did not answer for this attempt and the recovery
        # after it (remote/unanswered.py): a node lost mid-run costs the sweep, the gate
        # round and its token round one connect timeout, not three. Per attempt, not per
        # launch: each attempt starts with none, so its agents' start dials every node,
        # one that came back since (a healed partition) included.
        dials = NoRedial(transport)
        watch = resume_watch(plan, sink)
        outcome = Orchestrator(job, dials, watch or sink, stacks_dir=stacks).run()
        if watch is not None and watch.began_fresh and plan.resume_from is not None:
            # Told where to resume, it started over: never "finished" (issue 38).
            record.state, record.exit_code = JobState.FAILED, outcome.exit_code or 1
            record.failure = began_fresh_line(plan.resume_from, plan.job_id)
            registry.save(record)
            raise LaunchError(record.failure, key="--resume-arg")
        end = AttemptEnd(gate_refused=outcome.gate is not None and not outcome.gate.ok,
                         exit_code=outcome.exit_code, interrupted=outcome.interrupted)
        step = decide(end, restart_rules(settings, decisions), RestartState(attempt))
        if step is Next.REFUSE_GATE and outcome.gate is not None:
            record.state, record.exit_code = JobState.NOT_STARTED, 2
            registry.save(record)
            raise gate_error(outcome.gate)
        outcomes.append(outcome)
        _finish_record(registry, record, outcome)
        if step is Next.STOP:
            return LaunchResult(outcome.exit_code, outcomes, plan,
                                elapsed_s=time.monotonic() - started)
        before = decisions
        try:
            decisions, options = _prepare_restart(options, decisions, planner, dials, settings,
                                                  sink, end, attempt)
            if decisions is not before and decisions.storage == StorageKind.NODE_LOCAL:
                if prepare is None:
                    raise LaunchError("cannot restore or reshard node-local checkpoints from "
                                      "here", key="--drop-failed-nodes")
                once = prepare(decisions, record)  # this attempt's record: its saved mapping
            elif prepare is not None and needs_ready(decisions):
                once = prepare(decisions, record)  # its resume argument, `latest`, the step-0 rule
        except ClusterkitError as exc:  # the restart refused: status says what the launch exits
            record_refusal(registry, record, exc)
            raise
        sink.info(f"restarting (attempt {attempt + 2} of {settings.relaunches + 1}): "
                  + resume_note(options.uses_workload, decisions.storage, decisions))
    raise AssertionError("unreachable")


def _prepare_restart(options: JobOptions, plan: JobPlan, planner: Planner, transport: Transport,
                     settings: LaunchSettings, sink: Sink, end: AttemptEnd,
                     attempt: int) -> tuple[JobPlan, JobOptions]:
    """The I/O of a restart's steps: the gate round on its own, the planner."""
    return restart_plan(options, plan, planner, sink, end, restart_rules(settings, plan),
                        RestartState(attempt),
                        check=lambda: sorted(check_nodes(transport, plan, sink)))


def record_refusal(registry: Registry, record: JobRecord, exc: ClusterkitError) -> None:
    """A restart clusterkit refused ends the launch with the refusal's exit code (2, README
    "Exit codes"), not the failed attempt's: the record says the same (issue 38: status
    said exit 129 where the launch exited 2)."""
    record.exit_code = exc.exit_code
    record.state = JobState.FAILED
    record.failure = "; ".join([*filter(None, [record.failure]),
                                f"restart refused: {exc.one_line()}"])
    registry.save(record)


def _finish_record(registry: Registry, record: JobRecord, outcome: JobOutcome) -> None:
    record.exit_code = outcome.exit_code
    record.state = (JobState.INTERRUPTED if outcome.interrupted
                    else JobState.SUCCEEDED if outcome.exit_code == 0 else JobState.FAILED)
    if outcome.failure is not None:
        record.failure = f"{outcome.failure.where()}: {describe_failure(outcome.failure)}"
    registry.save(record)
