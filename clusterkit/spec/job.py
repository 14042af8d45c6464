"""The job model: what the user asked for and what a plan decided (bottom layer, pure).

Every verb (``launch``, ``render``, ``sbatch``) takes its job flags from the fields of
:class:`JobOptions`: each field that carries :func:`flag` metadata becomes the same
``--flag`` with the same type, default, choices and help everywhere
(:mod:`clusterkit.cli.jobflags`). Adding a job option is one field here.
The bundled workload's own defaults come from the ``DEFAULT_*`` constants below.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from clusterkit.inventory import Host
from clusterkit.node.contract import ENV_DS_CONFIG, ENV_HEARTBEAT, STORAGE_KINDS, JobDir, StorageKind
from clusterkit.node.protocol import DEFAULT_GRACE_S
from clusterkit.spec.programs import PROGRAM_CHOICES, ProgramChoice
from clusterkit.spec.zero import (
    DEFAULT_LR,
    DEFAULT_MICRO_BATCH,
    DEFAULT_STEPS,
    DEFAULT_WARMUP_STEPS,
    DEFAULT_ZERO_STAGE,
    OFFLOAD_CHOICES,
    PRECISION_AUTO_CHOICES,
    ZERO_STAGES,
    ZeroSpec,
)

STORAGE_CHOICES: tuple[str, ...] = ("auto", *STORAGE_KINDS)
RDZV_CHOICES: tuple[str, ...] = ("auto", "static", "c10d")
# DeepSpeed's runner's own --launcher values (how it reaches the other nodes).
DS_LAUNCHERS: tuple[str, ...] = ("pdsh", "openmpi", "slurm")
WORKLOAD_MODULE = "clusterkit.workload"
# The bundled workload's model presets (clusterkit.workload.presets defines their shapes).
MODEL_NAMES: tuple[str, ...] = ("tiny", "small", "medium")
DEFAULT_MODEL = "tiny"
DEFAULT_TIME_LIMIT = "01:00:00"
# A job id names directories and reaches shells: plain words only.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# `sh -c` program that enters a directory and execs the rest: a fixed string, the
# directory and argv arrive as positional parameters, so nothing is re-parsed.
CD_EXEC = 'cd -- "$1" && shift && exec "$@"'
# What a remote node's PATH holds after the interpreter dir. Not the launcher's own PATH:
# that names directories of the machine clusterkit runs on (pyenv shims, ~/.cargo/bin,
# ...), which other nodes may not have. An inventory `env: {PATH: ...}` overrides it all.
SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def default_job_id(cluster: str, now: datetime) -> str:
    """``<cluster>-YYYYmmdd-HHMMSS`` with anything unsafe in the name replaced by ``-``."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", cluster).strip("-.") or "job"
    return f"{name[:40]}-{now:%Y%m%d-%H%M%S}"


def flag(default: Any, help: str, *, name: str | None = None, choices: tuple[Any, ...] = (),
         metavar: str | None = None, group: str = "job", kind: str = "value",
         cli_default: Any = None) -> Any:
    """A :class:`JobOptions` field that is also a CLI job flag (``--field-name``).

    ``kind``: ``value`` (typed by the field's default/annotation), ``switch``
    (store_true), ``repeat`` (append, one value per use), ``negate`` (store_true that
    sets the field to False). ``cli_default``: what every verb defaults to when the
    field's own default means "absent" to code that builds options directly.
    """
    meta = {"flag": name, "help": help, "choices": choices, "metavar": metavar, "group": group,
            "kind": kind, "cli_default": default if cli_default is None else cli_default}
    return field(default=default, metadata=meta)


# One default per runtime timeout (issue 23): launch's flags, the launcher and the
# agents' spec all read these. DEFAULT_GRACE_S is the node protocol's (the agent's
# own default when a spec leaves it out).
DEFAULT_HANG_TIMEOUT_S = 900.0  # --hang-timeout on the command line; JobOptions(): 0 = off
DEFAULT_KEEPALIVE_S = 60.0  # --keepalive-timeout; a JobSpec built in code: 0 = off


@dataclass(frozen=True)
class RunOptions:
    """How ``clusterkit launch`` runs a job, beside what it runs (:class:`JobOptions`).

    Each field declared with :func:`flag` is one of ``launch``'s runtime flags, made by
    ``cli/jobflags.add_run_flags`` with this field's default, type and help (durations
    end in ``_s``); ``launch.run`` reads the record (tests/unit/test_jobflags.py)."""

    skip_checks: bool = flag(False, "skip the pre-launch gate", group="running", kind="switch")
    build_ops: bool = flag(
        True, "do not build the DeepSpeed JIT ops the job needs on the nodes that miss them "
        "before its ranks start (ops carried with the environment; docs/launch.md)",
        name="--no-build-ops", group="running", kind="negate")
    grace_s: float = flag(DEFAULT_GRACE_S, "seconds between SIGTERM and SIGKILL on teardown",
                          name="--grace", metavar="S", group="running")
    keepalive_s: float = flag(
        DEFAULT_KEEPALIVE_S, "a node agent that hears nothing from this launcher for S "
        "seconds (network partition) stops its ranks by itself (0: off)",
        name="--keepalive-timeout", metavar="S", group="running")
    drop_failed_nodes: bool = flag(
        False, "on restart, leave out nodes that now fail the pre-launch check",
        group="restarts", kind="switch")


@dataclass(frozen=True)
class JobOptions:
    """What the user asked for (the job flags). Defaults: the bundled workload, torchrun plan."""

    job_id: str
    backend: str = "torchrun"  # the plan backend (clusterkit.launchers: Backend.plan_backend)
    # host selection, DeepSpeed semantics (clusterkit.hostfile.select_hosts; cli.common flags)
    nodes: int | None = None
    gpus_per_node: int | None = None
    include: str = ""
    exclude: str = ""
    # the program: a script path or a module; neither = the bundled workload (per-verb syntax)
    script: str | None = None
    module: str | None = None
    script_args: tuple[str, ...] = ()
    deepspeed_config_arg: bool = flag(
        False, "append --deepspeed_config <job dir>/ds_config.json to your script's arguments "
        f"(DeepSpeed's convention; the path is also in ${ENV_DS_CONFIG})", kind="switch")
    # workload and ZeRO
    model: str = flag(DEFAULT_MODEL, "bundled workload: model preset", choices=MODEL_NAMES,
                      group="workload and ZeRO")
    steps: int = flag(DEFAULT_STEPS, "total optimizer steps (the LR schedule spans them)",
                      group="workload and ZeRO")
    zero_stage: int = flag(DEFAULT_ZERO_STAGE, "ZeRO stage", choices=ZERO_STAGES,
                           group="workload and ZeRO")
    offload_optimizer: str = flag("none", "optimizer state offload", choices=OFFLOAD_CHOICES,
                                  group="workload and ZeRO")
    offload_param: str = flag("none", "parameter offload (ZeRO-3)", choices=OFFLOAD_CHOICES,
                              group="workload and ZeRO")
    nvme_path: str | None = flag(None, "NVMe offload directory (default: <local_dir>/nvme-offload)",
                                 metavar="DIR", group="workload and ZeRO")
    precision: str = flag("auto", "auto: bf16 when every node has GPUs, else fp32",
                          choices=PRECISION_AUTO_CHOICES, group="workload and ZeRO")
    micro_batch: int = flag(DEFAULT_MICRO_BATCH, "sequences per rank per micro step",
                            group="workload and ZeRO")
    grad_accum: int = flag(1, "micro steps per optimizer step", group="workload and ZeRO")
    clip: float = flag(1.0, "gradient clipping norm (0: off)", group="workload and ZeRO")
    lr: float = flag(DEFAULT_LR, "peak learning rate (AdamW, warmup then cosine)",
                     group="workload and ZeRO")
    warmup_steps: int = flag(DEFAULT_WARMUP_STEPS, "linear warmup steps",
                             group="workload and ZeRO")
    save_16bit: bool = flag(False, "ZeRO-3: also save consolidated 16-bit weights",
                            kind="switch", group="workload and ZeRO")
    tensorboard: bool = flag(False, "also write TensorBoard events", kind="switch",
                             group="workload and ZeRO")
    save_every: int = flag(0, "checkpoint every N steps (0: only at the end)", metavar="N",
                           group="workload and ZeRO")
    # checkpoints
    storage: str = flag("auto", "auto: shared when every node has checkpoint.shared_dir, "
                        "else node-local", choices=STORAGE_CHOICES,
                        group="checkpoints and environment")
    ckpt_dir: str | None = flag(None, "checkpoint root (overrides the inventory's directory)",
                                metavar="DIR", group="checkpoints and environment")
    # Checkpoint replicas (issue 22, docs/lost-a-node.md): node-local checkpoints copied by
    # the launch agents to K other nodes. None: the inventory's checkpoint.replicas, else 1
    # with node-local storage and 0 with shared storage; 0: off.
    replicas: int | None = flag(
        None, "copy each node's node-local checkpoints to K other nodes (a ring in plan "
        "order; default: the inventory's checkpoint.replicas, else 1 with node-local "
        "storage; 0: off; clusterkit launch only)", metavar="K",
        group="checkpoints and environment")
    # How the program saves and resumes (issue 38, docs/programs.md): detected from its
    # arguments and source unless named; --resume-arg serves any other program.
    program_profile: str | None = flag(
        None, "how your program saves and resumes (default: detected from its arguments "
        "and source; docs/programs.md)", name="--program", choices=PROGRAM_CHOICES,
        metavar="NAME", group="checkpoints and environment")
    resume_arg: str | None = flag(
        None, "the argument that resumes your program from a checkpoint dir, {dir} standing "
        "for it (e.g. '--resume_from_checkpoint {dir}'): added on every restart and relaunch",
        metavar="TEMPLATE", group="checkpoints and environment")
    # environment
    env_allowlist: tuple[str, ...] = flag(
        (), "also pass this variable (or glob) from your environment (repeatable)",
        name="--env", metavar="NAME", kind="repeat", group="checkpoints and environment")
    set_env: tuple[tuple[str, str], ...] = flag(
        (), "set NAME=VALUE in every rank's environment (repeatable)", metavar="NAME=VALUE",
        kind="repeat", group="checkpoints and environment")
    # A lost node's part on a spare (issue 22, docs/lost-a-node.md): OLD's node index,
    # ranks and slots run on NEW (hostfile.apply_replace).
    replace: tuple[str, ...] = flag(
        (), "run OLD's ranks on the spare host NEW, same node index and slots; continuing a "
        "node-local job restores OLD's checkpoint part onto NEW from its replica (repeatable)",
        metavar="OLD=NEW", kind="repeat", group="checkpoints and environment")
    # launcher knobs
    rdzv: str = flag("auto", "auto: static per node; c10d under Slurm unless node-local",
                     choices=RDZV_CHOICES, group="launcher details")
    max_restarts: int = flag(0, "relaunch up to K times after a failure", metavar="K",
                             group="launcher details")
    local_ranks_filter: str | None = flag(None, "torchrun: only these local ranks' output",
                                          metavar="RANKS", group="launcher details")
    deepspeed_launcher: str = flag("pdsh", "how DeepSpeed's runner reaches the nodes",
                                   choices=DS_LAUNCHERS, group="launcher details")
    accelerate_use_deepspeed: bool = flag(
        True, "accelerate with MULTI_GPU/MULTI_CPU instead of DEEPSPEED",
        name="--accelerate-no-deepspeed", kind="negate", group="launcher details")
    strict: bool = flag(False, "a plan warning (more ranks than GPUs on a node, GPU ranks on "
                        "a gpus: 0 host) is an error", kind="switch", group="job")
    # Progress watchdog (issue 14): launch's watchdog fires after this long without progress;
    # every verb renders the ranks' backend timeouts from it (clusterkit.backend_timeouts).
    # 0 (the field default, for options built in code): off, no timeouts rendered.
    hang_timeout_s: float = flag(
        0.0, f"no progress on any rank for S seconds (output or {ENV_HEARTBEAT}): launch "
        "dumps every rank's stacks, stops the job, restarts per --max-restarts; every verb "
        "sets the ranks' backend timeouts to match (0 turns both off)", name="--hang-timeout",
        metavar="S", group="launcher details", cli_default=DEFAULT_HANG_TIMEOUT_S)
    # Slurm
    partition: str | None = flag(None, "Slurm partition", group="Slurm")
    account: str | None = flag(None, "Slurm account", group="Slurm")
    qos: str | None = flag(None, "Slurm QOS", group="Slurm")
    time_limit: str = flag(DEFAULT_TIME_LIMIT, "Slurm time limit", name="--time", group="Slurm")
    cpus_per_task: int | None = flag(None, "Slurm --cpus-per-task", group="Slurm")

    @property
    def uses_workload(self) -> bool:
        return self.script is None and self.module is None


@dataclass(frozen=True)
class LaunchFacts:
    """Facts about the launching machine, gathered by the caller (the plan never probes).

    ``python``/``cwd`` stand in for hosts whose inventory leaves ``python``/``workdir``
    unset; ``environ`` is the snapshot the env allowlist draws from; ``master_addr`` is
    node 0's address on the interface the other nodes reach (None: its inventory address).
    """

    python: str
    cwd: str
    environ: Mapping[str, str] = field(default_factory=dict, hash=False)
    master_addr: str | None = None
    cuda_lib_dirs: tuple[str, ...] = ()
    # The user's script as the launching machine has it (None: no script, or not
    # readable here): the plan warns when it takes its DeepSpeed config DeepSpeed's way
    # and would get none.
    script_text: str | None = field(default=None, hash=False, repr=False)
    # host -> the interface the last ``clusterkit doctor`` saved for it (reaches every
    # peer; checks/netpick.py): the plan sets NCCL/GLOO_SOCKET_IFNAME from it
    # (plan/ifaces.py) where neither the inventory nor the shell sets them.
    doctor_ifaces: Mapping[str, str] = field(default_factory=dict, hash=False)
    # The DeepSpeed config files the program's arguments name, as the launching machine
    # has them (path as written -> text): the plan derives a node-local copy (issue 38).
    program_files: Mapping[str, str] = field(default_factory=dict, hash=False, repr=False)


@dataclass(frozen=True)
class NodePlan:
    """One selected host and everything decided for it."""

    node_rank: int
    host: Host
    slots: tuple[int, ...]  # slot (GPU) ids used on this host
    first_rank: int
    python: str
    workdir: str
    job_dir: str
    ckpt_dir: str
    env: Mapping[str, str] = field(hash=False)

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def nproc(self) -> int:
        return len(self.slots)

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)


@dataclass(frozen=True)
class NodeCommand:
    """A command for one machine: ``argv`` run in ``cwd`` with ``env`` added to its environment.

    ``host`` is an inventory host name, or None for "the machine you launch from"
    (``sbatch`` on a login node).
    """

    label: str
    host: str | None
    node_rank: int | None
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    cwd: str | None = None

    def env_argv(self) -> list[str]:
        """``env K=V ... argv`` (or argv alone): one list, no shell involved."""
        if not self.env:
            return list(self.argv)
        return ["env", *(f"{k}={v}" for k, v in self.env.items()), *self.argv]

    def full_argv(self) -> list[str]:
        """The argv to exec on ``host`` (``sh -c 'cd -- "$1" && ...'`` enters ``cwd``)."""
        words = self.env_argv()
        if self.cwd is None:
            return words
        return ["sh", "-c", CD_EXEC, "sh", self.cwd, *words]

    def shell_line(self) -> str:
        """The same command as one shell line for people and scripts, quoted once."""
        line = shlex.join(self.env_argv())
        return line if self.cwd is None else f"cd -- {shlex.quote(self.cwd)} && {line}"


def launcher_log_dir(job_dir: str, node_rank: int | None = None) -> str:
    """``<job dir>/logs`` (sbatch.sh's ``--output`` dir too), or one node's subdirectory:
    where torchrun (``--log-dir``, also under ``accelerate launch``) keeps each rank's
    output, instead of a ``/tmp/torchelastic_*`` it never removes."""
    return JobDir(job_dir).logs(node_rank)


def rank_log_dir(job_dir: str, run_id: str | None) -> str:
    """Where a launcher that writes each rank's output to files (DeepSpeed's
    ``--enable_each_rank_log``) writes them: ``<job dir>/logs`` for a rendered job that a
    person runs, ``<job dir>/ranklogs/<run id>`` for one ``clusterkit launch`` run (a
    fresh directory per run: a continued job must not re-read an earlier run's files)."""
    return JobDir(job_dir).rank_logs(run_id)


@dataclass(frozen=True)
class JobPlan:
    """The decisions about one job (``plan.build.plan_job``): nothing rendered yet.

    ``render.artifacts.render_all(plan)`` turns it into a :class:`LaunchPlan`.
    """

    options: JobOptions
    cluster: str
    nodes: tuple[NodePlan, ...]
    world_size: int
    master_addr: str
    master_port: int
    storage: str
    zero: ZeroSpec
    ds_config: Mapping[str, Any] = field(hash=False)
    # per node (same order as ``nodes``): the interpreter arguments its ranks run,
    # ("-m", "clusterkit.workload", ...) or (script, ...)
    programs: tuple[tuple[str, ...], ...]
    # What is legal but probably not meant (printed by every verb; --strict refuses them).
    warnings: tuple[str, ...] = ()
    # node -> the NCCL/GLOO_SOCKET_IFNAME settings doctor's saved interface pick added
    # to its env (plan/ifaces.py; plan.json and the dry run show them)
    doctor_ifaces: Mapping[str, Mapping[str, str]] = field(default_factory=dict, hash=False)
    # Checkpoint replicas (issue 22): per node (same order as ``nodes``), the node indexes
    # that hold copies of its node-local checkpoints. Empty: no replication.
    replica_targets: tuple[tuple[int, ...], ...] = ()
    # The program's profile (spec/programs.py: how it saves and resumes, and why), and
    # the files derived for it in the job dir (a user's DeepSpeed config made node-local).
    profile: ProgramChoice | None = None
    program_files: Mapping[str, str] = field(default_factory=dict, hash=False)
    # One attempt's checkpoint (issue 38, set by jobs/recover.py for a restart or a
    # relaunch): the tag it resumes from (the newest complete on every node, in the
    # programs' resume argument) and the newer tags moved aside on its nodes.
    resume_from: str | None = None
    set_aside: tuple[str, ...] = ()

    @property
    def job_id(self) -> str:
        return self.options.job_id

    @property
    def backend(self) -> str:
        """The plan backend (a registry ``plan_backend``)."""
        return self.options.backend

    @property
    def program(self) -> tuple[str, ...]:
        """Node 0's program (every node's, except under per-node workdirs)."""
        return self.programs[0]

    @property
    def node_local(self) -> bool:
        return self.storage == StorageKind.NODE_LOCAL

    @property
    def job_dir(self) -> str:
        """Node 0's per-job directory (where the head-node artifacts go)."""
        return self.nodes[0].job_dir

    def replica_placement(self) -> dict[str, list[str]]:
        """node -> the nodes holding copies of its checkpoints (plan.json, the dry run)."""
        return {n.name: [self.nodes[j].name for j in ts]
                for n, ts in zip(self.nodes, self.replica_targets, strict=True) if ts}

    def replica_sources(self, index: int) -> tuple[int, ...]:
        """The node indexes whose copies node ``index`` holds."""
        return tuple(i for i, ts in enumerate(self.replica_targets) if index in ts)

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


@dataclass(frozen=True, kw_only=True)
class LaunchPlan(JobPlan):
    """A job's decisions and everything rendered from them: what ``launch`` runs, what
    ``render``/``sbatch`` write and every dry run prints (``render_all`` makes it)."""

    # command set -> commands; "torchrun", "torchrun-pdsh", "deepspeed", "accelerate", ...
    commands: Mapping[str, tuple[NodeCommand, ...]] = field(hash=False)
    skipped: Mapping[str, str] = field(hash=False)  # command set or file -> why not rendered
    artifacts: Mapping[str, str] = field(hash=False)  # file name -> text
    # The chosen backend's command sets (the registry's ``command_sets``); the first runs.
    chosen: tuple[str, ...]
    # The run these commands were rendered for (None: for a person to run), and where its
    # launcher writes per-rank log files (None: this backend writes none).
    run_id: str | None = None
    rank_log_dir: str | None = None

    @property
    def launch_commands(self) -> tuple[NodeCommand, ...]:
        """The commands for the chosen backend: what ``clusterkit launch`` runs."""
        return self.commands[self.chosen[0]]

    @property
    def job_files(self) -> dict[str, str]:
        """Every file the job dir holds, name -> text: the rendered artifacts and the
        program's own files (a derived ds_config, the CPU hook), written by the launch's
        agents, ``clusterkit sbatch`` and ``render --out`` alike."""
        return {**self.artifacts, **self.program_files}
