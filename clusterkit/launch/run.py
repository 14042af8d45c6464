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
from typing import Any, assert_never

from clusterkit.errors import ClusterkitError, LaunchError
from clusterkit.hostfile import parse_replace
from clusterkit.launch.attempts import AttemptEnd, Next, RestartRules, RestartState, decide
from clusterkit.launch.console import Sink
from clusterkit.launch.fromplan import job_from_plan
from clusterkit.launch.gate import gate_error, gate_nodes, run_gate, script_is_here
from clusterkit.launch.jobspec import JobSpec
from clusterkit.launch.orchestrator import Orchestrator
from clusterkit.launch.outcome import JobOutcome, describe_failure
from clusterkit.launch.registry import JobRecord, Registry
from clusterkit.launch.resumewatch import ResumeWatch
from clusterkit.launchers import BACKENDS, launcher_name
from clusterkit.node.contract import JobDir, StorageKind
from clusterkit.remote.base import Transport
from clusterkit.remote.unanswered import NoRedial
from clusterkit.render.artifacts import render_all
from clusterkit.spec.job import WORKLOAD_MODULE, JobOptions, JobPlan, LaunchPlan, RunOptions
from clusterkit.spec.jobrecord import JobCheckpoints, JobState, RankMap, RankSpan
from clusterkit.spec.programs import CONTRACT, began_fresh_line

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
                         "workload's --resume auto, or a script of clusterkit's contract, the "
                         "checkpoint is resharded onto fewer nodes instead (docs/programs.md)")
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


def rank_map(plan: JobPlan) -> RankMap:
    """``[(node, first_rank, nproc), ...]``: what node-local checkpoints are tied to."""
    return [RankSpan(n.name, n.first_rank, n.nproc) for n in plan.nodes]


@dataclass(frozen=True)
class Replacement:
    """Node index ``index`` ran on ``old`` and now runs on ``new`` (``--replace``)."""

    index: int
    old: str
    new: str


def replacements(old_map: Sequence[Sequence[Any]], plan: JobPlan) -> list[Replacement] | None:
    """The replaced nodes when the new rank->node mapping is the old one with only
    ``--replace`` names changed (same node index, first rank and ranks); None when the
    mapping changed otherwise. Pure."""
    swap = parse_replace(plan.options.replace)
    if len(old_map) != len(plan.nodes):
        return None
    out: list[Replacement] = []
    for index, (old, node) in enumerate(zip(old_map, plan.nodes, strict=True)):
        name, first, nproc = old
        if [first, nproc] != [node.first_rank, node.nproc]:
            return None
        if name != node.name:
            if swap.get(str(name)) not in (node.name, ""):  # "": a spare picked for it
                return None
            out.append(Replacement(index, str(name), node.name))
    return out


def continue_swaps(plan: JobPlan, prior: JobRecord | None) -> list[Replacement]:
    """The nodes whose node-local checkpoint part must be restored onto their spare
    before this launch continues ``prior`` (empty: nothing to restore)."""
    old_map = None if prior is None else prior.ckpt.rank_map
    if plan.storage != StorageKind.NODE_LOCAL or old_map is None or old_map == rank_map(plan):
        return []
    return replacements(old_map, plan) or []


def resume_arg(plan: JobPlan) -> str | None:
    """The bundled workload's ``--resume`` (default ``auto``); None for a user's program."""
    if not plan.options.uses_workload:
        return None
    args = list(plan.options.script_args)
    for i, word in enumerate(args):
        if word == "--resume" and i + 1 < len(args):
            return args[i + 1]
        if word.startswith("--resume="):
            return word.split("=", 1)[1]
    return "auto"


def reshardable(plan: JobPlan) -> bool:
    """Its newest checkpoint can be resharded for fewer nodes: the bundled workload with
    ``--resume auto``, or a user's script whose profile reshards (clusterkit's contract:
    it loads the tag named by ``CLUSTERKIT_RESUME_TAG``); an explicit ``--resume`` of the
    workload is its own. Not an HF Trainer, accelerate, snapshot or unknown program
    (spec/programs.Profile.reshards)."""
    return _program_reshards(plan) and resume_arg(plan) in ("auto", None)


def _program_reshards(plan: JobPlan) -> bool:
    """The bundled workload, or a program whose profile reshards."""
    prof = plan.profile
    return plan.options.uses_workload or prof is None or prof.profile.reshards


def _not_resharded(plan: JobPlan) -> str:
    """Why a program's checkpoint is not converted for another world size ('' if it is)."""
    prof = plan.profile
    if prof is None or _program_reshards(plan):
        return ""
    return (f"; this program ({prof.name}) saves {prof.profile.layout}, which clusterkit "
            "converts for no other world size (only the bundled workload's and clusterkit's "
            "contract's DeepSpeed tags)")


def is_reshard(plan: JobPlan, prior: JobRecord | None) -> bool:
    """Continuing a node-local job of the bundled workload on another rank->node mapping
    that is not a ``--replace`` (fewer nodes after a loss, ``--exclude``, ``--nodes``):
    its newest checkpoint is converted to DeepSpeed's universal checkpoint, which loads
    on any world size (jobs/recover.py), when the workload resumes by itself (auto)."""
    old_map = None if prior is None else prior.ckpt.rank_map
    return (plan.storage == StorageKind.NODE_LOCAL and old_map is not None and old_map != rank_map(plan)
            and replacements(old_map, plan) is None and reshardable(plan))


def check_continue(plan: JobPlan, prior: JobRecord | None) -> str | None:
    """Launching with the id of a recorded job continues it; say how, or refuse.

    The checkpoint dir is ``<root>/<job_id>``, so the same id means the same dir and
    the workload's ``--resume auto`` picks up the newest complete checkpoint there.
    Node-local shards resume only on the same rank->node mapping: a changed one is
    refused here, never silently turned into a fresh start, except a ``--replace``d
    node (same node index, ranks and slots on a spare), whose part is restored onto
    the spare from its replica before the start (jobs/recover.py).
    """
    if prior is None:
        return None
    if prior.launcher_alive:
        raise LaunchError(f"job {plan.job_id} is still running (launcher pid {prior.launcher_pid})",
                          key="--job-id", hint=f"`clusterkit stop {plan.job_id}` first, or pick "
                                               "another --job-id")
    old_map = prior.ckpt.rank_map
    swaps = None if old_map is None else replacements(old_map, plan)
    if plan.storage == StorageKind.NODE_LOCAL and old_map is not None and old_map != rank_map(plan) \
            and swaps is None and not is_reshard(plan, prior):
        raise LaunchError(
            f"cannot continue job {plan.job_id} on a different rank->node mapping: its "
            "node-local checkpoints resume only where each rank saved its shards "
            f"(was {_map_text(old_map)}, now {_map_text(rank_map(plan))})"
            + _not_resharded(plan),
            key="--job-id",
            hint="a lost node: run its ranks on a spare with --replace OLD=NEW (its part is "
                 "restored from its replica; docs/lost-a-node.md), or, with the bundled "
                 "workload and --resume auto or a script of clusterkit's contract, relaunch "
                 "on fewer nodes (resharded through DeepSpeed's universal checkpoint); or "
                 "start a new --job-id (this job's checkpoints stay); or gather the shards with "
                 f"`clusterkit collect-ckpt {plan.job_id}`, re-spread them with `clusterkit "
                 f"collect-ckpt --scatter --to DEST --dir {plan.nodes[0].ckpt_dir} ...` for "
                 "the new nodes, then launch again; or launch on the same nodes and "
                 "--gpus-per-node")
    dirs = sorted({n.ckpt_dir for n in plan.nodes})
    where = dirs[0] if len(dirs) == 1 else f"{len(dirs)} dirs"
    moved = "".join(f"; node index {s.index} runs on {s.new} instead of {s.old}"
                    + (" (its checkpoint part restored there first)"
                       if plan.storage == StorageKind.NODE_LOCAL else "")
                    for s in swaps or ())
    if old_map is not None and is_reshard(plan, prior):
        moved = (f"; on {len(plan.nodes)} nodes, {plan.world_size} ranks (was "
                 f"{_map_text(old_map)}): the newest checkpoint is resharded first")
    return (f"continuing job {plan.job_id} ({prior.state.value} before): checkpoints in {where} "
            f"({plan.storage}){moved}; "
            + resume_note(plan.program[:2] == ("-m", WORKLOAD_MODULE), plan.storage, plan))


def resume_watch(plan: JobPlan, sink: Sink) -> ResumeWatch | None:
    """A watch on an attempt told where to resume whose library logs that it did."""
    prof = plan.profile
    if plan.resume_from is None or prof is None or not prof.profile.resumed_marker:
        return None
    return ResumeWatch(sink, prof.profile)


def needs_ready(plan: JobPlan) -> bool:
    """A restart on the same nodes of a node-local job is readied first (jobs/recover.py)
    when its program's profile is told where to resume, picks by DeepSpeed's ``latest``,
    writes a file on one rank only (copied to every node), picks the newest checkpoint it
    finds (newer unassemblable ones moved aside), or has no known way to resume
    (the step-0 rule): spec/programs.py."""
    prof = plan.profile
    # The contract's scripts take the newest tag every rank has by their own rule: on the
    # same nodes nothing is in their way (on fewer nodes the reshard readies them).
    own_rule = prof is not None and prof.name == CONTRACT
    return (plan.storage == StorageKind.NODE_LOCAL and prof is not None
            and not plan.options.uses_workload
            and bool(prof.resume or prof.profile.top_latest or prof.profile.one_writer
                     or (prof.profile.picks_newest and not own_rule)
                     or not prof.profile.resumes_itself))


def resume_note(workload: bool, storage: str, plan: JobPlan | None = None) -> str:
    """Who resumes a continued or restarted job, and the node-local trap for a user's program."""
    if workload:
        return "the workload resumes from its newest complete checkpoint"
    prof = None if plan is None else plan.profile
    if prof is not None and prof.resume and storage == StorageKind.NODE_LOCAL:
        return (f"clusterkit resumes it from the newest checkpoint complete on every node "
                f"({' '.join(prof.resume)})")
    if prof is not None and prof.profile.resumes_itself and prof.name != CONTRACT \
            and storage == StorageKind.NODE_LOCAL:
        # A profile whose checkpoint clusterkit readies (needs_ready): the trap below is
        # handled for it (accelerate loads an explicit tag; `latest`, copies, set-asides).
        return (f"{prof.name} resumes by itself; clusterkit readies the newest checkpoint "
                "complete on every node for it first (docs/programs.md)")
    if storage == StorageKind.NODE_LOCAL:
        # Seen as a user: load_checkpoint(tag=None) resumed node 0 only, the others
        # started fresh, and DeepSpeed failed on "tag name ... not consistent".
        return ("your program must resume by itself: DeepSpeed's `latest` is on rank 0's node "
                "only, so load an explicit tag every rank has (docs/launch.md, "
                "\"Your own training script\")")
    return "your program must resume by itself"


def _map_text(m: RankMap) -> str:
    return ", ".join(f"{node}:r{first}-{first + n - 1}" for node, first, n in m)


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
