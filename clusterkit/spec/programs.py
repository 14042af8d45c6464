"""Program profiles: how a training program saves and resumes (issue 38), pure.

The one table of profiles (:data:`PROFILES`) and the decisions read from it: which
profile a program is (:func:`detect`: ``--program`` first, then ``--resume-arg``, then
the program's arguments and its source as the launching machine has it, gathered by
``jobs/here.py``: nothing here probes), what the profile's checkpoint layout on disk
looks like (:func:`from_layout`), the resume argument a restart adds
(:func:`with_resume`), what node-local storage adds to the program's arguments and to
its DeepSpeed config (:func:`node_local_args`, :func:`node_local_config`), and the
step-0 rule (:func:`restart_problem`). docs/programs.md is the user's account.

clusterkit never edits the user's files: a DeepSpeed config of the user's is copied,
with what node-local needs added, into the job dir (:data:`DERIVED_DS_CONFIG`), and
the program's argument is pointed at the copy.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from clusterkit.errors import RenderError
from clusterkit.hostrange import fold
from clusterkit.node.contract import (
    ACCELERATE_DS_SUBDIR,
    ENV_CKPT_DIR,
    ENV_RESUME_TAG,
    ENV_STOP_FILE,
    LATEST_FILE,
    RESUME_DIR_FIELD,
)

# The derived copy of a user's DeepSpeed config, in the job dir (node-local additions).
DERIVED_DS_CONFIG = "ds_config.program.json"
# The startup hook a profile's CPU ranks get (Profile.cpu_hook), in the job dir: Python
# imports it at start from the first PYTHONPATH entry that has one.
CPU_HOOK_FILE = "sitecustomize.py"
# accelerate's DeepSpeedPlugin reads its config from this file when the script gives none.
ACCELERATE_CONFIG_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
# Why a checkpoint converted inside its tag dir (OtherWorld.UNIVERSAL_INSIDE) is not
# continued on another number of nodes when the job's DeepSpeed config is not the derived
# copy, and the fix: one spelling for launch (jobs/reshard.check_inside) and sbatch (the
# rule's `other_world_why`, spec/resume.resume_rule: submit's check and the plan step).
OWN_CONFIG_WHY = ("its DeepSpeed config is your own (a file already node-local, none named, "
                  "or one your script hands accelerate's DeepSpeedPlugin), and clusterkit "
                  "edits no file of yours to turn on checkpoint.load_universal")
OWN_CONFIG_FIX = ("name a config without checkpoint.use_node_local_storage (clusterkit then "
                  "derives one; accelerate: give the plugin none, clusterkit points "
                  f"{ACCELERATE_CONFIG_ENV} at its own)")
# What a library that builds its DeepSpeed config from its own arguments gets on node-local
# storage: every value its arguments fill left "auto", and node-local checkpoints.
LIBRARY_DS_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": "auto"},
    "checkpoint": {"use_node_local_storage": True},
}

HF = "hf-trainer"
ACCELERATE = "accelerate"
DEEPSPEED = "deepspeed"
SNAPSHOT = "torch-snapshot"
CONTRACT = "clusterkit"
CUSTOM = "custom"
UNKNOWN = "unknown"


class OtherWorld(Enum):
    """How a profile's checkpoint continues on another rank->node mapping that is not a
    ``--replace`` (fewer nodes without a spare, ``--exclude``, ``--nodes``): the one
    answer launch/continuation.py (the refusal, the attempt table's ``reshard`` row) and
    jobs/recover.py (what is done before the start) read."""

    # Refused (launch/continuation.check_continue): DeepSpeed's files sit where clusterkit
    # converts none (DeepSpeed's `latest` of the program's own choosing), or nobody knows
    # the layout; converted in the wrong place, the program would begin at step 0 and save
    # over its checkpoints.
    REFUSED = "refused"
    # Its DeepSpeed tags sit at the top of the checkpoint dir and it loads the tag
    # clusterkit names ($CLUSTERKIT_RESUME_TAG): the newest is converted to DeepSpeed's
    # universal checkpoint for it and pushed to every node (jobs/reshard.py).
    UNIVERSAL = "universal"
    # World-size independent (a torch snapshot: the whole model from rank 0): loaded as
    # it is, once it is on every node of the new mapping (jobs/spread.py, newest copy).
    AS_IS = "as-is"
    # DeepSpeed's tag sits inside the program's own tag dir, converted there and pushed
    # with the rest of the tag dir to every node; the attempt gets load_universal in the
    # derived DeepSpeed config, and the profile's resume argument when it has one
    # (jobs/reshard.py). Where the conversion goes is the profile's `ds_tag`: None (HF's
    # checkpoint-N/global_stepN/, loaded through DeepSpeed's `latest`): beside it,
    # checkpoint-N/global_stepN_universal with checkpoint-N/latest_universal, which
    # DeepSpeed reads for a tag when load_universal is on; a name (accelerate's
    # step_N/pytorch_model/, loaded by that explicit tag): in its place, the old world's
    # tag kept beside it as <name>.set-aside (latest_universal names the conversion, for
    # collect-ckpt's and status's one rule, checkpoints/collect/inside.py).
    UNIVERSAL_INSIDE = "universal-inside"


@dataclass(frozen=True)
class Profile:
    """How one kind of program saves and resumes."""

    name: str
    title: str
    layout: str  # what it writes under the checkpoint dir (the dry run, docs/programs.md)
    # The argument that resumes it from one checkpoint dir ({dir}); empty: it resumes by
    # itself (or cannot be told to).
    resume: tuple[str, ...] = ()
    resumes_itself: bool = False  # it finds its checkpoint on disk by itself
    # Its flag for "every node writes its own copy" (node-local storage), when it has one.
    save_each_node_arg: str | None = None
    # Its arguments that name a DeepSpeed config file.
    config_args: tuple[str, ...] = ()
    # DeepSpeed's `latest` sits inside each tag dir (HF's checkpoint-N/latest), written on
    # global rank 0 only: the agents write it on every node before the ranks start.
    nested_latest: bool = False
    # DeepSpeed's top-level `latest` is how it picks its tag: the agents point it at the
    # newest checkpoint complete on every node.
    top_latest: bool = False
    # Why its saves are not complete on every node, and the fix (empty: they are, with
    # what clusterkit adds).
    incomplete: str = ""
    # It writes files at the top of the checkpoint dir on one rank only (a snapshot) and
    # every rank reads them: copied from the writer to every node before a restart.
    one_writer: bool = False
    # It loads the newest checkpoint it finds by itself: before a restart, newer ones that
    # cannot be assembled are moved aside.
    picks_newest: bool = False
    # The variable its library reads a DeepSpeed config file from when the program names
    # none (accelerate's DeepSpeedPlugin): set to a node-local config on node-local storage.
    config_env: str | None = None
    # `incomplete` applies only when the source shows one of these (empty: always).
    incomplete_if: tuple[str, ...] = ()
    # It builds its own optimizer and scheduler (HF's Trainer, accelerate): a DeepSpeed
    # config clusterkit hands it carries neither (accelerate refuses one in both places).
    own_optimizer: bool = False
    # What its library logs when it resumed, and its first progress line (regexes; empty:
    # it logs neither): a resumed attempt whose progress comes first began at step 0.
    resumed_marker: str = ""
    progress_marker: str = ""
    # How a save on one world size continues on another (fewer nodes without a spare):
    # OtherWorld's values say who does what.
    other_world: OtherWorld = OtherWorld.REFUSED
    # The DeepSpeed tag its library loads by name inside each of its tag dirs (accelerate's
    # load_state: load_checkpoint(dir, tag="pytorch_model")); None: DeepSpeed picks it by
    # `latest` (HF). OtherWorld.UNIVERSAL_INSIDE reads it for where the conversion goes.
    ds_tag: str | None = None
    # Its library picks no process group by itself on ranks without a GPU (accelerate
    # 1.15: every rank would be process 0 of 1, node/hooks/accelerate_cpu.py says why): those
    # ranks get the job dir's CPU_HOOK_FILE first on their PYTHONPATH.
    cpu_hook: bool = False
    # It saves a checkpoint and exits 0 on SIGUSR1 (clusterkit's contract, the bundled
    # workload): under `clusterkit sbatch`, USR1 (the time limit's warning, preemption)
    # asks its ranks to save and the job is requeued after that save. Any other program
    # ignores USR1 (its ranks start with it ignored): the batch script ends its step at
    # USR1 instead, when it saved since the run began (node/slurm/end.py, rows
    # stop-end-step and stop-run-on), unless its source handles the stop itself
    # (ProgramChoice.handles_stop).
    saves_on_usr1: bool = False


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile(HF, "Hugging Face Trainer",
            "checkpoint-N/ (trainer_state.json, DeepSpeed's global_stepN/ and latest inside)",
            resume=("--resume_from_checkpoint", RESUME_DIR_FIELD),
            save_each_node_arg="--save_on_each_node", config_args=("--deepspeed",),
            nested_latest=True, own_optimizer=True, other_world=OtherWorld.UNIVERSAL_INSIDE,
            resumed_marker=r"Resuming training from checkpoint|Continuing training from",
            progress_marker=r"\{'loss': "),
    Profile(ACCELERATE, "accelerate save_state/load_state",
            "one folder per save_state call (DeepSpeed's tag inside, random_states_R.pkl)",
            resumes_itself=True, picks_newest=True, config_env=ACCELERATE_CONFIG_ENV,
            own_optimizer=True, cpu_hook=True, other_world=OtherWorld.UNIVERSAL_INSIDE,
            ds_tag=ACCELERATE_DS_SUBDIR,
            incomplete="accelerate writes its scheduler and registered objects on the main "
                       "process only: pass ProjectConfiguration(save_on_each_node=True) to "
                       "Accelerator(...), or use --storage shared",
            incomplete_if=("scheduler", "register_for_checkpointing")),
    Profile(DEEPSPEED, "DeepSpeed engine (save_checkpoint/load_checkpoint)",
            "one dir per tag and a `latest` file naming the newest",
            resumes_itself=True, picks_newest=True, config_args=("--deepspeed_config",),
            top_latest=True),
    Profile(SNAPSHOT, "torch snapshot file",
            "one snapshot file saved by rank 0",
            resumes_itself=True, picks_newest=True, one_writer=True,
            other_world=OtherWorld.AS_IS,
            incomplete="rank 0 saves the snapshot on its own node only: save it on every "
                       "node's local rank 0 (LOCAL_RANK == 0), or use --storage shared"),
    Profile(CONTRACT, "clusterkit's contract",
            f"tags under ${ENV_CKPT_DIR}, loaded by an explicit tag (${ENV_RESUME_TAG})",
            resumes_itself=True, picks_newest=True, config_args=("--deepspeed_config",),
            other_world=OtherWorld.UNIVERSAL, saves_on_usr1=True),
    Profile(CUSTOM, "your --resume-arg", "your program's own", config_args=("--deepspeed",
                                                                            "--deepspeed_config")),
    Profile(UNKNOWN, "not recognised", "not known", config_args=("--deepspeed_config",)),
)}
PROGRAM_CHOICES: tuple[str, ...] = tuple(n for n in PROFILES if n not in (CUSTOM, UNKNOWN))


@dataclass(frozen=True)
class ProgramChoice:
    """The profile a job's program was given, why, and its resume template."""

    profile: Profile
    why: str
    resume: tuple[str, ...] = ()
    note: str = ""  # what the launch adds for it beyond the table's columns (cpu_hook_note)
    # Its source handles the stop request (SIGUSR1 or $CLUSTERKIT_STOP_FILE), whatever
    # its profile: it saves and exits on it, as the contract says (docs/sbatch.md).
    handles_stop: bool = False

    @property
    def name(self) -> str:
        return self.profile.name

    def line(self) -> str:
        """``program profile: hf-trainer (its source builds transformers' Trainer)``."""
        how = f"; resumes with {' '.join(self.resume)}" if self.resume else (
            "; resumes by itself" if self.profile.resumes_itself else "; no way to resume known")
        return f"program profile: {self.name} ({self.why}){how}" + (
            f"; {self.note}" if self.note else "")


# What a program's source shows, first match wins: a Trainer script is HF's whatever else
# it does; the contract's resume tag before DeepSpeed (a contract script calls
# save_checkpoint too); a script that only saves into $CLUSTERKIT_CKPT_DIR by its own
# means is taken to follow the contract.
_SOURCE_RULES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    # transformers' arguments, not the name Trainer: pytorch's DDP tutorial has a class
    # Trainer of its own.
    (HF, re.compile(r"TrainingArguments\b|from transformers import[^\n]*\bTrainer\b"),
     "its source builds transformers' Trainer"),
    (CONTRACT, re.compile(re.escape(ENV_RESUME_TAG)), f"its source reads ${ENV_RESUME_TAG}"),
    (ACCELERATE, re.compile(r"\.save_state\("), "its source calls accelerate's save_state"),
    (DEEPSPEED, re.compile(r"\.save_checkpoint\("), "its source calls DeepSpeed's save_checkpoint"),
    (SNAPSHOT, re.compile(r"torch\.save\("), "its source saves with torch.save"),
    (CONTRACT, re.compile(re.escape(ENV_CKPT_DIR)), f"its source reads ${ENV_CKPT_DIR}"),
)


def _words(args: Sequence[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("-")}


def detect(*, workload: bool, args: Sequence[str], script_text: str | None,
           program: str | None = None, resume_arg: str | None = None) -> ProgramChoice:
    """The profile of a job's program (see the module doc for the order)."""
    choice = _detect(workload=workload, args=args, script_text=script_text, program=program,
                     resume_arg=resume_arg)
    if script_text is not None and _STOP_SIGNS.search(script_text):
        return dataclasses.replace(choice, handles_stop=True)
    return choice


# A program that handles the stop request itself (a SIGUSR1 handler, the stop file).
_STOP_SIGNS = re.compile(r"\bSIGUSR1\b|" + re.escape(ENV_STOP_FILE))


def _detect(*, workload: bool, args: Sequence[str], script_text: str | None,
            program: str | None, resume_arg: str | None) -> ProgramChoice:
    template = parse_template(resume_arg) if resume_arg else ()
    if program is not None:
        if program not in PROFILES:
            raise RenderError(f"--program {program!r} is not a known profile", key="--program",
                              hint=f"one of {', '.join(PROGRAM_CHOICES)}, or --resume-arg "
                                   "TEMPLATE for any other program (docs/programs.md)")
        prof = PROFILES[program]
        return ProgramChoice(prof, f"--program {program}", template or prof.resume)
    if workload:
        return ProgramChoice(PROFILES[CONTRACT], "the bundled workload")
    if template:
        return ProgramChoice(PROFILES[CUSTOM], f"--resume-arg {resume_arg!r}", template)
    name, why = _from_program(args, script_text)
    return ProgramChoice(PROFILES[name], why, PROFILES[name].resume)


def _from_program(args: Sequence[str], text: str | None) -> tuple[str, str]:
    words = _words(args)
    if text is not None:
        for name, pattern, why in _SOURCE_RULES:
            if pattern.search(text):
                return name, why
    if {"--output_dir", "--deepspeed"} <= words or "--resume_from_checkpoint" in words:
        return HF, "HF Trainer's --output_dir/--deepspeed in its arguments"
    if text is None:
        # A node-only path or a module: the launch behaves as before issue 38.
        return CONTRACT, "its source is not readable here: taken to follow clusterkit's contract"
    return UNKNOWN, "nothing in its arguments or source says how it saves"


def from_layout(names: Iterable[str]) -> str | None:
    """The profile a checkpoint dir's layout shows (relative paths of its files), or None."""
    paths = [n.replace("\\", "/") for n in names]
    tops = {p.split("/", 1)[0] for p in paths if "/" in p}
    if any(re.fullmatch(r"checkpoint-\d+", t) and f"{t}/trainer_state.json" in paths
           for t in tops):
        return HF
    if any(p.split("/")[-1].startswith("random_states_") for p in paths):
        return ACCELERATE
    if LATEST_FILE in paths and tops:
        return DEEPSPEED
    if any("/" not in p and p.endswith((".pt", ".pth")) for p in paths) and not tops:
        return SNAPSHOT
    return None


def parse_template(text: str) -> tuple[str, ...]:
    """``--resume_from_checkpoint {dir}`` -> its words; refused without ``{dir}``."""
    words = tuple(text.split())
    if not words or not any(RESUME_DIR_FIELD in w for w in words):
        raise RenderError(f"--resume-arg {text!r} does not name the checkpoint as {RESUME_DIR_FIELD}",
                          key="--resume-arg",
                          hint="e.g. --resume-arg '--resume_from_checkpoint {dir}'")
    # Any other {name} would reach the program literally: a typo of {dir} ({ckpt}, {path}).
    other = sorted({f for w in words for f in re.findall(r"\{[^{}]*\}", w)} - {RESUME_DIR_FIELD})
    if other:
        raise RenderError(f"--resume-arg {text!r}: {', '.join(other)} is not a field "
                          f"(the only one is {RESUME_DIR_FIELD}, the checkpoint directory)",
                          key="--resume-arg",
                          hint="e.g. --resume-arg '--resume_from_checkpoint {dir}'")
    return words


def config_arg(profile: Profile, args: Sequence[str]) -> tuple[int, str] | None:
    """Where ``args`` name a DeepSpeed config file by one of the profile's flags: the
    index of the path word and the path (``--deepspeed ds.json`` or ``--deepspeed=ds.json``:
    the index of that word, the path after ``=``)."""
    for i, a in enumerate(args):
        for flag in profile.config_args:
            if a == flag and i + 1 < len(args) and not args[i + 1].startswith("-"):
                return i + 1, args[i + 1]
            if a.startswith(flag + "="):
                return i, a.split("=", 1)[1]
    return None


def node_local_args(profile: Profile, args: Sequence[str], *, config_path: str | None
                    ) -> tuple[str, ...]:
    """The program's arguments on node-local storage: its save-on-each-node flag added
    when missing, and its DeepSpeed config argument pointed at ``config_path`` (the
    derived copy) when given."""
    out = list(args)
    where = config_arg(profile, out)
    if config_path is not None and where is not None:
        i, _ = where
        out[i] = config_path if out[i] == where[1] else out[i].split("=", 1)[0] + "=" + config_path
    flag = profile.save_each_node_arg
    if flag is not None and flag not in _words(out):
        out.append(flag)
    return tuple(out)


def node_local_config(text: str, source: str) -> str:
    """The user's DeepSpeed config (JSON text) with ``checkpoint.use_node_local_storage``
    on (every node then writes its model states: a part complete per node); everything
    else as the user wrote it, ``"auto"`` values included."""
    try:
        doc: Any = json.loads(text)
    except ValueError as exc:
        raise RenderError(f"{source} is not JSON ({exc})", path=source, key="--deepspeed",
                          hint="give a DeepSpeed config file (JSON)") from None
    if not isinstance(doc, dict):
        raise RenderError(f"{source} is not a JSON object", path=source, key="--deepspeed")
    ckpt = doc.get("checkpoint")
    doc["checkpoint"] = {**(ckpt if isinstance(ckpt, dict) else {}),
                         "use_node_local_storage": True}
    return json.dumps(doc, indent=2) + "\n"


def save_problem(choice: ProgramChoice, script_text: str | None) -> str | None:
    """Why this program's saves are not complete on every node (node-local storage), with
    the fix; None when they are (or clusterkit makes them so)."""
    prof = choice.profile
    if not prof.incomplete or (script_text is not None and "save_on_each_node=True" in script_text):
        return None
    if prof.incomplete_if and not (script_text is not None
                                   and any(w in script_text for w in prof.incomplete_if)):
        return None
    return prof.incomplete


def program_ds_config(profile: Profile, ds_config: dict[str, Any]) -> dict[str, Any]:
    """The job's ds_config.json as this program gets it (accelerate's launcher hands it to
    ``accelerate launch``): without clusterkit's optimizer and scheduler for a program
    that builds its own (tried as a user: an ordinary accelerate script under --launcher
    accelerate died of "You cannot specify an optimizer in the config file and in the
    code at the same time"); unchanged for the others. The batch sizes stay clusterkit's
    numbers: filled as "auto" by accelerate on CPU they came out for a world of one
    (DeepSpeed's "train_batch_size ... 4 != 4 * 1 * 2")."""
    if not profile.own_optimizer:
        return ds_config
    return {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}


def library_config_env(choice: ProgramChoice, script_text: str | None, config_path: str
                       ) -> dict[str, str]:
    """The environment that points the program's library at a node-local DeepSpeed config
    (:data:`LIBRARY_DS_CONFIG` at ``config_path``), when the profile has such a variable
    and the script gives its library no config of its own."""
    var = choice.profile.config_env
    if var is None or (script_text is not None and ("hf_ds_config" in script_text
                                                    or "config_file" in script_text)):
        return {}
    return {var: config_path}


def cpu_hook_env(profile: Profile, *, cpu: bool, job_dir: str, pythonpath: str | None
                 ) -> dict[str, str]:
    """The environment of a node's ranks for the profile's CPU hook: the job dir (which
    holds :data:`CPU_HOOK_FILE`) first on ``PYTHONPATH``, the node's own entries after it;
    nothing for a node whose ranks have GPUs (accelerate finds its backend there) or a
    profile without the hook."""
    if not (profile.cpu_hook and cpu):
        return {}
    rest = [p for p in (pythonpath or "").split(":") if p and p != job_dir]
    return {"PYTHONPATH": ":".join([job_dir, *rest])}


def cpu_hook_note(profile: Profile, cpu_nodes: Sequence[str]) -> str:
    """What the profile line says of the hook (launch, --dry-run); empty without one."""
    if not (profile.cpu_hook and cpu_nodes):
        return ""
    return (f"on CPU ranks ({fold(cpu_nodes)}) accelerate picks no process group by "
            f"itself: their PYTHONPATH starts with the job dir, whose {CPU_HOOK_FILE} makes "
            "it pick gloo as with cpu=True, its DeepSpeed plugin kept")
