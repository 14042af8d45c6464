"""How a program is restarted from a checkpoint (issue 38), pure: the resume template
put into its arguments (:func:`with_resume`), the rule that readies its restart
(:func:`resume_rule`: the plain values node/ckpt/ready.readiness reads for a launch's
restart and for a requeued ``clusterkit sbatch`` run), when a restart on the same nodes
is readied at all (:func:`needs_ready`), and the step-0 lines. The profiles themselves
are spec/programs.py's; docs/programs.md ("Restarts and relaunches") is the user's
account.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clusterkit.node.ckpt.ready import resume_words
from clusterkit.node.contract import (
    CKPT_TAG_TOKEN,
    OTHER_WORLD_AS_IS,
    OTHER_WORLD_CONVERT,
    OTHER_WORLD_REFUSE,
    RESUME_DIR_FIELD,
)
from clusterkit.spec.job import JobPlan
from clusterkit.spec.programs import (
    CONTRACT,
    DERIVED_DS_CONFIG,
    OWN_CONFIG_FIX,
    OWN_CONFIG_WHY,
    PROGRAM_CHOICES,
    OtherWorld,
    ProgramChoice,
)


def _strip_flag(args: Sequence[str], flag: str) -> list[str]:
    """``args`` without ``flag VALUE`` / ``flag=VALUE`` (the value: the next word unless it
    is a flag itself)."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == flag:
            skip = i + 1 < len(args) and not args[i + 1].startswith("--")
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def with_resume(template: Sequence[str], args: Sequence[str], ckpt: str) -> tuple[str, ...]:
    """``args`` resuming from ``ckpt``: the template's words with ``{dir}`` filled in,
    replacing what the arguments said for the template's flag before (a relaunch's own
    ``--resume_from_checkpoint`` of an older checkpoint, say)."""
    if not template:
        return tuple(args)
    return (*without_resume(template, args), *resume_words(template, ckpt))


def without_resume(template: Sequence[str], args: Sequence[str]) -> tuple[str, ...]:
    """``args`` without what they said for the template's flag (``with_resume`` adds it)."""
    if not template or not template[0].startswith("-"):
        return tuple(args)
    return tuple(_strip_flag(args, template[0].split("=", 1)[0]))


def _program_head(program: Sequence[str]) -> int:
    """How many words of a node's interpreter arguments are the program itself
    (``script`` or ``-m module``); its arguments follow."""
    return 2 if list(program[:1]) == ["-m"] else 1


def resumed_program(program: Sequence[str], template: Sequence[str], ckpt: str
                    ) -> tuple[str, ...]:
    """One node's interpreter arguments (``script ARGS`` or ``-m module ARGS``) with the
    resume argument for ``ckpt``."""
    head = _program_head(program)
    return (*program[:head], *with_resume(template, program[head:], ckpt))


def program_without_resume(program: Sequence[str], template: Sequence[str]) -> tuple[str, ...]:
    """One node's interpreter arguments without their own resume flag (the batch script
    appends the resume words it decides at the start of a run)."""
    head = _program_head(program)
    return (*program[:head], *without_resume(template, program[head:]))


def latest_rules(choice: ProgramChoice | None, *, node_local: bool) -> tuple[bool, bool]:
    """(point every node's top-level ``latest`` at the resume tag, write the ``latest``
    each tag dir lacks): what readying a node's checkpoint dir does with DeepSpeed's
    ``latest`` for this program (node/ckpt/ready.py), the same for a launch's agents and
    the batch script. Only on node-local storage: a shared dir has rank 0's files."""
    prof = None if choice is None else choice.profile
    return (bool(node_local and prof is not None and prof.top_latest),
            bool(node_local and prof is not None and prof.nested_latest))


def needs_ready(choice: ProgramChoice | None, *, node_local: bool, workload: bool) -> bool:
    """A restart on the same nodes of a node-local job is readied first (a launch:
    jobs/recover.py; sbatch: its ``plan`` and ``ready`` steps) when its program's profile
    is told where to resume, picks by DeepSpeed's ``latest``, writes a file on one rank
    only (copied to every node), picks the newest checkpoint it finds (newer
    unassemblable ones moved aside), or has no known way to resume (the step-0 rule)."""
    if not node_local or workload or choice is None:
        return False
    prof = choice.profile
    # The contract's scripts take the newest tag every rank has by their own rule: on the
    # same nodes nothing is in their way (on fewer nodes the reshard readies them).
    own_rule = prof.name == CONTRACT
    return bool(choice.resume or prof.top_latest or prof.one_writer
                or (prof.picks_newest and not own_rule) or not prof.resumes_itself)


def saves_on_usr1(choice: ProgramChoice | None) -> bool:
    """The program saves and exits 0 on SIGUSR1 (its profile: clusterkit's contract and
    the bundled workload do; a program whose source handles SIGUSR1 or the stop file
    does, whatever its profile; no profile given: as before, it is taken to). Rendered into
    the batch script (render/sbatch.py) and node/slurm/end.py's settings: at USR1 a
    program that does not is not asked to save; its step is ended when it saved since
    the run began, and the job requeued (docs/sbatch.md, "How the batch job decides")."""
    return choice is None or choice.profile.saves_on_usr1 or choice.handles_stop


def resume_rule(choice: ProgramChoice | None, *, job_id: str, ckpt_dir: str, node_local: bool,
                workload: bool, derived: bool = False) -> dict[str, Any]:
    """How a restart of this job's program from a checkpoint is readied, as plain values:
    what node/ckpt/ready.readiness reads for a launch's restart (jobs/recover.py) and,
    rendered into the batch script, for a requeued ``clusterkit sbatch`` run (its
    ``plan`` step on the batch host). ``ready``: a run on the same nodes is readied too
    (:func:`needs_ready`); the step-0 line names the tag as :data:`CKPT_TAG_TOKEN`;
    ``other_world``: how the batch script continues it on another number of nodes
    (:func:`sbatch_other_world`; ``derived``: the job's DeepSpeed config is clusterkit's
    derived copy), ``other_world_why``/``other_world_fix`` when that is refused for a
    reason other than the layout; ``saves_on_usr1``: :func:`saves_on_usr1`. Empty for the
    bundled workload (it resumes by itself, and saves on USR1)."""
    if choice is None or workload:
        return {}
    top, nested = latest_rules(choice, node_local=node_local)
    own_config = choice.profile.other_world is OtherWorld.UNIVERSAL_INSIDE and not derived
    return {"ready": needs_ready(choice, node_local=node_local, workload=workload),
            "name": choice.name, "resume": list(choice.resume),
            "top_latest": top, "nested_latest": nested, "aside": choice.profile.picks_newest,
            "step0": restart_problem(choice, CKPT_TAG_TOKEN, ckpt_dir, job_id) or "",
            "other_world": sbatch_other_world(choice, derived=derived),
            "other_world_why": OWN_CONFIG_WHY if own_config else "",
            "other_world_fix": OWN_CONFIG_FIX if own_config else "",
            "one_writer": choice.profile.one_writer,
            "layout": choice.profile.layout, "saves_on_usr1": saves_on_usr1(choice)}


def plan_rule(plan: JobPlan, *, node_local: bool | None = None) -> dict[str, Any]:
    """:func:`resume_rule` of a planned job (its profile, checkpoint dir, storage, and
    whether its DeepSpeed config is the derived copy): what submit's check, the batch
    script and a launch's restart read."""
    return resume_rule(plan.profile, job_id=plan.job_id, ckpt_dir=plan.nodes[0].ckpt_dir,
                       node_local=plan.node_local if node_local is None else node_local,
                       workload=plan.options.uses_workload,
                       derived=DERIVED_DS_CONFIG in plan.program_files)


# The conversion step's PROGRAM word (jobs/slurm_reshard.py) for a job without a profile.
NO_PROGRAM = "-"


def sbatch_other_world(choice: ProgramChoice, *, derived: bool) -> str:
    """How the batch script continues this program's node-local checkpoint on another
    number of nodes: the one answer submit's check and the plan step read. A top-level
    DeepSpeed tag is converted; one inside the program's tag dir (HF Trainer, accelerate)
    too, converted there as a launch's reshard does (checkpoints/convert/tagdir.py), when
    the job's DeepSpeed config is clusterkit's derived copy (``derived``: the one file
    that gets ``checkpoint.load_universal``); a snapshot loads on any world size as it is."""
    world = choice.profile.other_world
    if world is OtherWorld.UNIVERSAL or converts_inside(choice, derived=derived):
        return OTHER_WORLD_CONVERT
    if world is OtherWorld.AS_IS:
        return OTHER_WORLD_AS_IS
    return OTHER_WORLD_REFUSE


def converts_inside(choice: ProgramChoice | None, *, derived: bool) -> bool:
    """The batch script converts this program's DeepSpeed tag inside its own tag dir on
    another number of nodes (and turns load_universal on in the derived config, the
    ``derived`` one clusterkit may edit): HF Trainer's and accelerate's."""
    return choice is not None and derived \
        and choice.profile.other_world is OtherWorld.UNIVERSAL_INSIDE


def restart_problem(choice: ProgramChoice, tag: str, where: str, job_id: str) -> str | None:
    """The step-0 rule: a restart or relaunch of a program that can neither be told where
    to resume nor finds its checkpoint itself would begin at step 0 while ``tag`` (in
    ``where``) is complete on every node. One line naming the checkpoint and the fix;
    None when it resumes."""
    if choice.resume or choice.profile.resumes_itself:
        return None
    return (f"job {job_id} would restart at step 0: checkpoint {tag} in {where} is complete "
            f"on every node, but this program ({choice.why}) is not known to resume from it "
            f"-- relaunch with --resume-arg 'FLAG {RESUME_DIR_FIELD}' (its own resume flag) or "
            f"--program NAME ({', '.join(PROGRAM_CHOICES)})")


def began_fresh_line(tag: str, job_id: str) -> str:
    """The one line when a resumed attempt's output shows it began at step 0 anyway."""
    return (f"job {job_id}: the restarted program began at step 0 although checkpoint {tag} "
            f"was complete on every node and passed to it (it logged progress before any "
            f"resume) -- check its resume flag: relaunch with --resume-arg 'FLAG {RESUME_DIR_FIELD}' "
            "or --program NAME (docs/programs.md)")
