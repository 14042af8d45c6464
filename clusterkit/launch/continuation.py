"""How a launch continues a recorded job: the rank->node map its node-local
checkpoints are tied to, the ``--replace``d nodes, whether its newest checkpoint goes on
on fewer nodes (resharded, or as it is: :func:`other_world`), and who resumes it.

Pure functions of the plan and the prior record; ``launch/run.py`` (the launch loop)
and ``jobs/recover.py`` (what is done on the nodes before the start) both read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clusterkit.errors import LaunchError
from clusterkit.hostfile import parse_replace
from clusterkit.launch.console import Sink
from clusterkit.launch.registry import JobRecord
from clusterkit.launch.resumewatch import ResumeWatch
from clusterkit.node.contract import StorageKind
from clusterkit.spec.job import WORKLOAD_MODULE, JobPlan
from clusterkit.spec.jobrecord import RankMap, RankSpan
from clusterkit.spec.programs import CONTRACT, OtherWorld
from clusterkit.spec.resume import needs_ready as profile_needs_ready


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


def other_world(plan: JobPlan) -> OtherWorld:
    """How its newest checkpoint continues on another rank->node mapping (spec/programs.
    OtherWorld): the bundled workload with ``--resume auto`` is converted to DeepSpeed's
    universal checkpoint (an explicit ``--resume`` of it is its own: refused); a user's
    program as its profile says (clusterkit's contract: converted, it loads the tag named
    by ``CLUSTERKIT_RESUME_TAG``; HF Trainer: converted inside its checkpoint-N, resumed
    with its resume argument; accelerate: converted in the place of step_N/pytorch_model,
    loaded by its own load_state; a torch snapshot: as it is, on every node; DeepSpeed's
    ``latest``, unknown: refused)."""
    prof = plan.profile
    if plan.options.uses_workload or prof is None:
        return OtherWorld.UNIVERSAL if resume_arg(plan) in ("auto", None) else OtherWorld.REFUSED
    return prof.profile.other_world


def reshardable(plan: JobPlan) -> bool:
    """Its newest checkpoint continues on fewer nodes (converted, or as it is): what the
    attempt table's ``reshard`` row reads (launch/attempts.RestartRules.resumes_itself)."""
    return other_world(plan) is not OtherWorld.REFUSED


def _not_resharded(plan: JobPlan) -> str:
    """Why a program's checkpoint does not continue on another world size ('' if it does)."""
    prof = plan.profile
    if prof is None or plan.options.uses_workload or reshardable(plan):
        return ""  # the workload's explicit --resume: its own (the hint says what to do)
    return (f"; this program ({prof.name}) saves {prof.profile.layout}, which clusterkit "
            "continues on no other world size (only the bundled workload's, clusterkit's "
            "contract's, HF Trainer's and accelerate's DeepSpeed tags, converted, and a torch "
            "snapshot, copied as it is)")


def is_reshard(plan: JobPlan, prior: JobRecord | None) -> bool:
    """Continuing a node-local job on another rank->node mapping that is not a
    ``--replace`` (fewer nodes after a loss, ``--exclude``, ``--nodes``) when its
    checkpoint continues there (:func:`other_world`): converted to DeepSpeed's universal
    checkpoint, which loads on any world size, or a snapshot copied to every node as it
    is (jobs/recover.py)."""
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
                 "workload and --resume auto, a script of clusterkit's contract, HF's "
                 "Trainer or accelerate's save_state (resharded through DeepSpeed's "
                 "universal checkpoint) or a torch "
                 "snapshot (copied as it is), relaunch on fewer nodes; or "
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
                 f"{_map_text(old_map)}): " + (
                     "the newest checkpoint is resharded first"
                     if other_world(plan) is not OtherWorld.AS_IS else
                     "its checkpoint loads on any world size as it is: the newest copy is "
                     "put on every node first"))
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
    """A restart of this plan on the same nodes is readied first (spec/resume.needs_ready)."""
    return profile_needs_ready(plan.profile, node_local=plan.storage == StorageKind.NODE_LOCAL,
                                workload=plan.options.uses_workload)


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
