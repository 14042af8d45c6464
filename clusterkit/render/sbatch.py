"""The Slurm batch script, from ``templates/sbatch.sh.j2`` (jinja2, StrictUndefined).

Every value is quoted once with :func:`shlex.quote` (the ``q`` filter, or
``shlex.join`` for whole command lines); the only shell expansions in the script
are the fixed ``$MASTER_ADDR``/``$MASTER_PORT``/``$SLURM_*``/``$PATH`` references
written into the template and the launch-line placeholders below.

Site settings that only the batch script has (``--exclusive``, ``--mem``, extra
``#SBATCH`` lines, a site's own template, ...) are a :class:`SlurmSite`, an input of
``render_all`` (``clusterkit sbatch`` passes the user's; the defaults otherwise). The
launch line comes from the plan backend's registry entry (``Backend.sbatch_line``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit import ship
from clusterkit.errors import RenderError
from clusterkit.launchers import BACKENDS
from clusterkit.node import hangrule
from clusterkit.node.contract import (
    CKPT_TAG_TOKEN,
    ENV_CKPT_DIR,
    ENV_HEARTBEAT_DIR,
    ENV_RESUME_TAG,
    ENV_STOP_FILE,
    LATEST_UNIVERSAL_FILE,
    SLURM_PLAIN_SUFFIX,
    SLURM_RESUMED_FROM,
    SLURM_SPREAD_DIR,
    JobDir,
    exits_dir,
)
from clusterkit.node.slurm.end import USR1_VERB
from clusterkit.render.jobops import accelerator, job_ops
from clusterkit.spec.job import SYSTEM_PATH, JobPlan, launcher_log_dir
from clusterkit.spec.ports import PORT_BASE, PORT_SPAN
from clusterkit.spec.programs import DERIVED_DS_CONFIG
from clusterkit.spec.resume import (
    NO_PROGRAM,
    began_fresh_line,
    converts_inside,
    plan_rule,
    program_without_resume,
    saves_on_usr1,
)

if TYPE_CHECKING:
    import jinja2

TEMPLATE = "sbatch.sh.j2"
WATCHDOG_EOF = "CLUSTERKIT_SLURMWATCH_EOF"
END_EOF = "CK_SLURMEND_EOF"  # the end program's heredoc (node/slurm/end.py)
HANG_RESTARTS = "hang_restarts"  # <job dir>/hang_restarts: this job's hang requeues so far
PROGRESS_SUBDIR = JobDir.PROGRESS  # <job dir>/progress: $CLUSTERKIT_HEARTBEAT_DIR under sbatch
# The contract's names the script spells (`{{ env.stop_file }}`, `{{ layout.HANG }}`).
ENV_NAMES = {"stop_file": ENV_STOP_FILE, "heartbeat_dir": ENV_HEARTBEAT_DIR, "ckpt_dir": ENV_CKPT_DIR,
             "resume_tag": ENV_RESUME_TAG}
# spec.ports' range (20000-32767, below Linux's ephemeral range 32768-60999): what a
# site template that derives its own port needs; the bundled one uses the plan's port.
SLURM_PORT_BASE = PORT_BASE
SLURM_PORT_SPAN = PORT_SPAN
DEFAULT_SIGNAL_LEAD_S = 90
_SLURM_VALUE = re.compile(r"[A-Za-z0-9_.,:@+-]+")
_MEM = re.compile(r"[0-9]+[KMGT]?")
# Slurm's --time forms (sbatch(1)), minutes and seconds below 60 (Slurm silently carries
# 99:99 into 1:40:39) and hours below 24 after days; 48:00:00 is two days, as for Slurm.
TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"
_MS = r"[0-5]?[0-9]"
_HOURS = r"(?:[01]?[0-9]|2[0-3])"
_TIME = re.compile(rf"[0-9]+|[0-9]+:{_MS}|[0-9]+:{_MS}:{_MS}"
                   rf"|[0-9]+-{_HOURS}(?::{_MS}(?::{_MS})?)?|UNLIMITED|INFINITE")


def check_time(value: str) -> str:
    """A Slurm ``--time`` value, refused unless it is one of Slurm's own forms with
    minutes/seconds below 60 and hours below 24 (``99:99``, ``25:99:99`` are typos
    that Slurm would turn into some other limit)."""
    if not _TIME.fullmatch(value.strip()):
        raise RenderError(f"{value!r} is not a Slurm time limit", key="--time",
                          hint=f"use {TIME_FORMS} (e.g. 2:00:00 or 1-12:00:00)")
    return value.strip()


@dataclass(frozen=True)
class SlurmSite:
    """What only the batch script knows: a site's #SBATCH needs and its own template.

    ``extra_lines`` are whole ``#SBATCH`` option words (``--reservation=r1``), written
    after clusterkit's own; ``template_dir`` holds a ``sbatch.sh.j2`` that replaces
    the bundled one (same variables, docs/sbatch.md)."""

    exclusive: bool = False
    mem: str | None = None  # --mem, e.g. 64G or 0 (all of the node's memory)
    constraint: str | None = None
    gpu_type: str | None = None  # --gpus-per-node=TYPE:N
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S
    extra_lines: tuple[str, ...] = ()
    template_dir: str | None = None
    # Checkpoint replicas of a node-local job (issue 31): K copies of each node's part,
    # made by node/slurm/replica.py steps the script starts (launch's replication service).
    replicas: int = 0


@cache
def _environment(template_dir: str | None = None) -> jinja2.Environment:
    # Imported here: jinja2 costs ~0.1-0.5 s to import and only this renderer needs it,
    # while every `clusterkit` invocation imports the plan package.
    import jinja2

    loader: jinja2.BaseLoader = (jinja2.FunctionLoader(_load_template) if template_dir is None
                                 else jinja2.FileSystemLoader(template_dir))
    env = jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # shell, not HTML: values are quoted with the q filter instead
        keep_trailing_newline=True,
    )
    env.filters["q"] = shlex.quote
    return env


def _load_template(name: str) -> str:
    # templates/ is installed as the package clusterkit.templates (see pyproject.toml).
    return resources.files("clusterkit.templates").joinpath(name).read_text(encoding="utf-8")


def _slurm_value(value: str | None, key: str) -> str | None:
    """#SBATCH lines are not shell: a value must be one plain word."""
    if value is not None and not _SLURM_VALUE.fullmatch(value):
        raise RenderError(f"Slurm option {key} {value!r} is not a plain word", key=key,
                          hint="use letters, digits and _.,:@+- only")
    return value


# sbatch reads #SBATCH lines itself, without a shell: host lists (node[3-4]), output
# patterns (%x-%j) and paths are fine there; white space, quotes and shell syntax are not.
_EXTRA_VALUE = re.compile(r"[A-Za-z0-9_.,:@+\-\[\]%/=]+")


def _extra_line(line: str) -> str:
    """One --sbatch-arg: ``--opt`` or ``--opt=value``, which sbatch reads without a shell."""
    word = line.strip()
    if word.startswith("#SBATCH"):
        word = word[len("#SBATCH"):].strip()
    name, _, value = word.partition("=")
    if not re.fullmatch(r"--[a-z][a-z0-9-]*", name) or (value and not _EXTRA_VALUE.fullmatch(value)):
        raise RenderError(f"--sbatch-arg {line!r} is not one #SBATCH option", key="--sbatch-arg",
                          hint="write it as --option or --option=value (plain word, no spaces)")
    return word


def launch_line(plan: JobPlan, log_dir: str) -> tuple[str, str]:
    """(variant, the srun line) of the plan backend: the registry's ``sbatch_line``."""
    line = BACKENDS[plan.backend].sbatch_line
    if line is None:
        raise RenderError(f"the {plan.backend!r} backend has no batch-script launch line",
                          key="--launcher")
    return line(plan, log_dir)


def _program_rule(plan: JobPlan) -> dict[str, Any]:
    """How a run of a node-local job's own program is readied (spec/resume.resume_rule):
    what the batch host's plan step reads, and what decides the script's resume lines;
    empty for the bundled workload and for shared storage."""
    return plan_rule(plan, node_local=True) if plan.node_local else {}


def _resumed_line(plan: JobPlan, log_dir: str, rule: dict[str, Any]) -> str:
    """The launch line of a run that resumes (a profile with a resume template) when the
    program's own arguments name the template's flag: without it, so the resume words
    the batch host decides are the only ones; empty otherwise (the words are appended to
    the launch line itself)."""
    template = rule.get("resume") or ()
    if not template:
        return ""
    bare = tuple(program_without_resume(p, template) for p in plan.programs)
    if bare == plan.programs:
        return ""
    return launch_line(dataclasses.replace(plan, programs=bare), log_dir)[1]


def path_prefix(path: str) -> str:
    """The plan's PATH minus the standard system directories: what the script puts in
    front of the site's own PATH (which keeps /opt/slurm/bin, module paths, ...)."""
    return ":".join(d for d in path.split(":") if d and d not in SYSTEM_PATH)


def _gpus(plan: JobPlan, site: SlurmSite) -> str | None:
    node = plan.nodes[0]
    if node.host.gpus <= 0:
        return None
    gpu_type = _slurm_value(site.gpu_type, "--gpu-type")
    return f"{gpu_type}:{node.nproc}" if gpu_type else str(node.nproc)


def _site_context(plan: JobPlan, site: SlurmSite) -> dict[str, object]:
    if site.mem is not None and not _MEM.fullmatch(site.mem):
        raise RenderError(f"--mem {site.mem!r} is not a Slurm memory size", key="--mem",
                          hint="use a number with an optional K/M/G/T suffix (0: all of it)")
    if site.signal_lead_s < 1:
        raise RenderError(f"--signal-lead {site.signal_lead_s} must be at least 1 second",
                          key="--signal-lead")
    return {
        "gpus_per_node": _gpus(plan, site),
        "exclusive": site.exclusive,
        "mem": site.mem,
        "constraint": _slurm_value(site.constraint, "--constraint"),
        "signal_lead": site.signal_lead_s,
        "extra_lines": [_extra_line(line) for line in site.extra_lines],
    }


def render_sbatch(plan: JobPlan, site: SlurmSite | None = None) -> str:
    site = site or SlurmSite()
    o = plan.options
    node = plan.nodes[0]
    log_dir = launcher_log_dir(node.job_dir)
    variant, line = launch_line(plan, log_dir)
    rule = _program_rule(plan)
    resumed = _resumed_line(plan, log_dir, rule)
    per_rank = BACKENDS[plan.backend].slurm_task_per_rank
    context = {
        "job_id": plan.job_id,
        "cluster": plan.cluster,
        "job_name": _slurm_value(f"ck-{plan.job_id}", "--job-name"),
        "nodes": len(plan.nodes),
        # The allocation must hold every task of the launch step: srun inside a job
        # silently starts fewer tasks than asked for when the allocation has fewer
        # (measured: --ntasks-per-node=2 in a 1-task-per-node job ran world size 2, not 4).
        "ntasks_per_node": node.nproc if per_rank else 1,
        "ranks_per_task": 1 if per_rank else node.nproc,
        "cpus_per_task": o.cpus_per_task,
        "time_limit": check_time(o.time_limit),
        "partition": _slurm_value(o.partition, "--partition"),
        "account": _slurm_value(o.account, "--account"),
        "qos": _slurm_value(o.qos, "--qos"),
        "output": _path_word(f"{log_dir}/slurm-%j.out", "--output"),
        "error": _path_word(f"{log_dir}/slurm-%j.err", "--error"),
        "master_port": plan.master_port,
        "port_base": SLURM_PORT_BASE,
        "port_span": SLURM_PORT_SPAN,
        "path_prefix": path_prefix(node.env.get("PATH", "")),
        "exports": [f"{k}={shlex.quote(v)}" for k, v in node.env.items() if k != "PATH"],
        "omp_from_env": "OMP_NUM_THREADS" in node.env,
        "job_dir": node.job_dir,
        "ds_config": JobDir(node.job_dir).ds_config,
        "log_dir": log_dir,
        "node_local": plan.node_local,
        "node_local_dirs": [node.ckpt_dir] if plan.node_local else [],
        "exits_dir": exits_dir(node.job_dir),
        **_watchdog_context(plan),
        **_ops_context(plan),
        **_replica_context(plan, site, rule),
        **_end_context(plan, site, variant, log_dir, rule),
        "stop_file": JobDir(node.job_dir).stop_file,
        "env": ENV_NAMES,
        "layout": JobDir,
        "variant": variant,
        "launch_line": line,
        "resumed_line": resumed,
        **_site_context(plan, site),
    }
    return _render(site.template_dir, context)


def _watchdog_context(plan: JobPlan) -> dict[str, object]:
    """The progress watchdog (--hang-timeout S > 0): node/slurm/watch.py, started the one
    way node programs are (ship.node_command: the bootstrap, its sources on stdin, here
    a heredoc of the script, so the script stays the one file Slurm needs)."""
    node = plan.nodes[0]
    hang = plan.options.hang_timeout_s
    if hang <= 0:
        return {"hang_timeout": 0, "watchdog_cmd": "", "watchdog_bundle": "",
                "progress_dir": "", "max_restarts": plan.options.max_restarts}
    cmd = ship.node_command(node.python, "slurm.watch", ["watch", plan.job_id, node.job_dir])
    bundle = cmd.stdin.decode("utf-8")
    if WATCHDOG_EOF in bundle:
        raise RenderError(f"the watchdog's sources contain {WATCHDOG_EOF}")
    return {"hang_timeout": f"{hang:g}", "startup_allowance": f"{hangrule.allowance(hang):g}",
            "watchdog_cmd": shlex.join(cmd.argv),
            "watchdog_bundle": bundle.rstrip("\n"), "watchdog_eof": WATCHDOG_EOF,
            "progress_dir": f"{node.job_dir}/{PROGRESS_SUBDIR}",
            "max_restarts": plan.options.max_restarts}


def _ops_context(plan: JobPlan) -> dict[str, object]:
    """DeepSpeed's JIT ops the ranks would build at start (render/jobops.py, the rule
    ``launch`` builds by), built by one task per node before the launch step: the node
    program ``provision.jitbatch`` (node/provision/jitbatch.py), its sources the job file
    ``JobDir.JITOPS_PROGRAM`` (slurm/submit.write_node_program) and the request line after
    them on stdin."""
    node = plan.nodes[0]
    ops = sorted({op for node_ops in job_ops(plan).values() for op in node_ops})
    if not ops:
        return {"ops": "", "ops_cmd": "", "ops_request": ""}
    # The accelerator the plan assumed: a node whose own differs builds its own ops instead.
    request = {"ops": ops, "ds_config": {}, "accelerator": accelerator(node)}
    return {"ops": " ".join(ops),
            "ops_cmd": shlex.join(ship.node_command(node.python, "provision.jitbatch").argv),
            "ops_request": json.dumps(request, sort_keys=True)}


def _replica_context(plan: JobPlan, site: SlurmSite, program: dict[str, Any]
                     ) -> dict[str, object]:
    """A node-local job's node program (node/slurm/replica.py; its sources are the job
    file ``JobDir.SLURM_PROGRAM``): replicas while it runs (``replicas`` > 0), its parts
    moved before the ranks start on another node set."""
    node = plan.nodes[0]
    k = site.replicas if plan.node_local and len(plan.nodes) > 1 else 0
    if not plan.node_local:
        return {"replicas": 0, "replica_cmd": "", "replica_conf": "", "markers": False,
                "ready": False, "program_name": "", "spread_dir": SLURM_SPREAD_DIR,
                "reshard_config": "", "reshard_program": NO_PROGRAM, "convert_inside": False,
                "latest_universal": LATEST_UNIVERSAL_FILE, "plain_suffix": SLURM_PLAIN_SUFFIX}
    conf = {"job_id": plan.job_id, "job_dir": node.job_dir, "ckpt_dir": node.ckpt_dir,
            "rpn": node.nproc, "markers": plan.options.uses_workload, "replicas": k,
            "program": program}
    return {"replicas": k, "markers": plan.options.uses_workload, "ready": bool(program.get("ready")),
            "program_name": program.get("name", ""), "spread_dir": SLURM_SPREAD_DIR,
            **_reshard_context(plan),
            "replica_cmd": shlex.join(ship.node_command(node.python, "slurm.replica").argv),
            "replica_conf": json.dumps(conf, sort_keys=True, separators=(",", ":"))}


def _reshard_context(plan: JobPlan) -> dict[str, object]:
    """The conversion step on another number of nodes (jobs/slurm_reshard.py): the profile
    it converts for, and the DeepSpeed config it turns ``checkpoint.load_universal`` on in
    for that run (the ``.plain`` copy put back at the end): the derived copy of a program
    whose tag is converted inside its tag dir (``convert_inside``,
    spec/resume.sbatch_other_world; a later run resumes from such a tag again, its
    ``again`` step), else the job's ds_config.json (a user's script of the contract)."""
    node = plan.nodes[0]
    inside = converts_inside(plan.profile, derived=DERIVED_DS_CONFIG in plan.program_files)
    return {"convert_inside": inside, "latest_universal": LATEST_UNIVERSAL_FILE,
            "plain_suffix": SLURM_PLAIN_SUFFIX,
            "reshard_config": f"{node.job_dir}/{DERIVED_DS_CONFIG}" if inside
            else JobDir(node.job_dir).ds_config,
            "reshard_program": plan.profile.name if plan.profile is not None else NO_PROGRAM}


def _end_context(plan: JobPlan, site: SlurmSite, variant: str, log_dir: str,
                 rule: dict[str, Any]) -> dict[str, object]:
    """What the end of a run means (node/slurm/end.py: exit status, requeue, the lines),
    started the one way node programs are, its sources a heredoc of the script (as the
    watchdog's): ``end_conf`` is its CONF word, the job's settings and paths."""
    node = plan.nodes[0]
    job = JobDir(node.job_dir)
    cmd = ship.node_command(node.python, "slurm.end")
    bundle = cmd.stdin.decode("utf-8")
    if END_EOF in bundle:
        raise RenderError(f"the end program's sources contain {END_EOF}")
    conf = {"max_restarts": plan.options.max_restarts, "signal_lead": site.signal_lead_s,
            "replicas": site.replicas if plan.node_local and len(plan.nodes) > 1 else 0,
            "node_local": plan.node_local, "log_dir": log_dir, "job_name": f"ck-{plan.job_id}",
            "per_rank_files": BACKENDS[plan.backend].slurm_task_per_rank,
            "stop_var": ENV_STOP_FILE, "ckpt_var": ENV_CKPT_DIR, "stop_file": job.stop_file,
            "exits_dir": exits_dir(node.job_dir),
            "hang_file": job.hang_file if plan.options.hang_timeout_s > 0 else "",
            "count_file": f"{node.job_dir}/{HANG_RESTARTS}", **_resume_watch(plan, rule),
            **_usr1_rule(plan)}
    return {"end_cmd": shlex.join(cmd.argv), "end_bundle": bundle.rstrip("\n"), "end_eof": END_EOF,
            "end_conf": json.dumps(conf, sort_keys=True, separators=(",", ":")),
            "saves_on_usr1": conf.get("saves_on_usr1", True), "usr1_verb": USR1_VERB,
            "started_file": conf.get("started_file", ""), "ended_file": conf.get("ended_file", "")}


def _usr1_rule(plan: JobPlan) -> dict[str, Any]:
    """A program that does not save on SIGUSR1 (spec/resume.saves_on_usr1): what
    node/slurm/end.py needs at USR1 and at the end (rows stop-end-step, stop-run-on): the
    run's start stamp and the file that records the save the step was ended for; nothing
    for a program that saves on it (the contract's, the bundled workload)."""
    if saves_on_usr1(plan.profile):
        return {}
    job = JobDir(plan.nodes[0].job_dir)
    return {"saves_on_usr1": False, "program": plan.profile.name if plan.profile else "",
            "job_id": plan.job_id, "started_file": job.path(JobDir.RUN_STARTED),
            "ended_file": job.path(JobDir.STOP_ENDED)}


def _resume_watch(plan: JobPlan, rule: dict[str, Any]) -> dict[str, str]:
    """What node/slurm/end.py needs to tell a run that was told where to resume, but began
    at step 0 (the profile's lines, the step-0 line with the tag as a token; a run whose
    plan step gives the resume words, ``rule``); nothing for other jobs."""
    node = plan.nodes[0]
    prof = plan.profile
    if not rule.get("resume") or prof is None \
            or not (prof.profile.resumed_marker and prof.profile.progress_marker):
        return {}
    return {"resumed_marker": prof.profile.resumed_marker,
            "progress_marker": prof.profile.progress_marker,
            "began_fresh": began_fresh_line(CKPT_TAG_TOKEN, plan.job_id),
            "tag_token": CKPT_TAG_TOKEN, "runs_dir": f"{node.job_dir}/{JobDir.SLURM_RUNS}",
            "resumed_from_file": SLURM_RESUMED_FROM}


def _render(template_dir: str | None, context: dict[str, object]) -> str:
    import jinja2

    if template_dir is not None and not (Path(template_dir) / TEMPLATE).is_file():
        raise RenderError(f"no {TEMPLATE} in the template directory", path=template_dir,
                          key="--template-dir", hint="copy clusterkit's templates/sbatch.sh.j2 "
                          "there and edit it (variables: docs/sbatch.md)")
    try:
        return _environment(template_dir).get_template(TEMPLATE).render(context)
    except jinja2.TemplateError as exc:
        where = template_dir or "templates"
        raise RenderError(f"{TEMPLATE} does not render: {exc}", path=f"{where}/{TEMPLATE}",
                          key="--template-dir",
                          hint="the variables are listed in docs/sbatch.md") from None


def _path_word(path: str, key: str) -> str:
    # `#SBATCH --output=PATH` is read by sbatch, not a shell: no quoting exists there.
    if re.search(r"[\s'\"\\$`]", path):
        raise RenderError(f"{key} path {path!r} cannot be written on an #SBATCH line", key=key,
                          hint="use a workdir without spaces, quotes or $")
    return path
