"""The node contract: every name the launcher, the node agent and the ranks agree on.

One module, standard library only (Python >= 3.8 on the node), so the node programs
ship it (``ship.py``'s ``PROGRAMS``) and every other layer imports it from here
(no module re-exports it: one door per name). What lives here, each spelled once
(``tests/unit/test_contract_names.py`` fails on a second spelling anywhere in ``clusterkit/``
or ``templates/``):

* every ``CLUSTERKIT_*`` environment name that crosses a process boundary (launcher
  -> agent -> ranks, batch script -> ranks), and the summary line's prefix;
* the user-script contract: one node's view of it (:class:`Contract`), the storage
  kinds and DeepSpeed's config argument;
* the placeholder tokens the launcher writes and something else expands;
* the job-dir layout, as one class (:class:`JobDir`): where logs, rank logs,
  heartbeats, stacks, the run dir, the summary, exits and the stop file live;
* the per-rank progress file rule (``rank<R>.heartbeat``, ``rank<R>.stacks``);
* the checkpoint completion-marker rule (``clusterkit-complete.node<N>.json``);
* DeepSpeed's checkpoint file names (``latest``, model states, optimizer shards);
* the checkpoint replica area's layout, its manifest's name and the replica ports;
* the node-program bundle's header (what the node bootstrap reads on stdin).

The user-script names are documented in docs/launch.md ("Your own training
script"); the job-dir layout in docs/architecture.md ("The job dir").
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

# -- The user-script contract: what every rank of a job finds in its environment, whatever
# the backend, besides RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
ENV_JOB_ID = "CLUSTERKIT_JOB_ID"  # also the tag that makes status and teardown job-scoped
ENV_JOB_DIR = "CLUSTERKIT_JOB_DIR"
ENV_DS_CONFIG = "CLUSTERKIT_DS_CONFIG"
ENV_CKPT_DIR = "CLUSTERKIT_CKPT_DIR"
ENV_STORAGE = "CLUSTERKIT_STORAGE"
CONTRACT_NAMES = (ENV_JOB_ID, ENV_JOB_DIR, ENV_DS_CONFIG, ENV_CKPT_DIR, ENV_STORAGE)
# sbatch: the file that appears when the job is asked to stop (time limit, preemption,
# `clusterkit sbatch cancel JOB --signal USR1 --batch`); the ranks also get SIGUSR1.
ENV_STOP_FILE = "CLUSTERKIT_STOP_FILE"
# A user's script relaunched on fewer nodes (docs/lost-a-node.md): the tag it must load,
# set for that attempt only (its newest complete checkpoint converted: <tag>_universal).
ENV_RESUME_TAG = "CLUSTERKIT_RESUME_TAG"
# Seconds a user script should pass to init_process_group(timeout=...) (issue 14).
ENV_PG_TIMEOUT_S = "CLUSTERKIT_PG_TIMEOUT_S"

# -- The agent's tags on every process it starts (besides ENV_JOB_ID): teardown by node
# and attempt reads them from /proc/<pid>/environ.
ENV_NODE = "CLUSTERKIT_NODE"
ENV_ATTEMPT = "CLUSTERKIT_ATTEMPT"

# -- Hangs (docs/launch.md, "Hangs"): a rank shows progress by writing output or by
# touching its heartbeat file (the workload writes its step there), and registers
# faulthandler on SIGWINCH to write its stacks to its stacks file. A rank without its
# own path uses ``$CLUSTERKIT_HEARTBEAT_DIR/rank<R>.<suffix>`` (:func:`rank_file`).
ENV_HEARTBEAT = "CLUSTERKIT_HEARTBEAT"
ENV_HEARTBEAT_DIR = "CLUSTERKIT_HEARTBEAT_DIR"
ENV_STACKS = "CLUSTERKIT_STACKS"
# `faulthandler`: the agent does not look for py-spy (tests; sites without ptrace).
ENV_STACK_TOOL = "CLUSTERKIT_STACK_TOOL"

# -- The fork server (docs/launch.md, "Fork server"): 0/off/no/false in the launcher's or
# the job's environment switches it off; ..._IMPORTS=a,b names the modules it preloads.
ENV_ZYGOTE = "CLUSTERKIT_ZYGOTE"
ENV_ZYGOTE_IMPORTS = "CLUSTERKIT_ZYGOTE_IMPORTS"
# (The fork server's own CLUSTERKIT_RANK_SLOT stays in node/agent/zygote.py: the zygote runs as
# one source file in its own interpreter and imports nothing, this module included.)

# -- A test hook that crosses to the ranks: the bundled workload's --dump-weights default.
# (The probe's CLUSTERKIT_PROBE_CLOCK_OFFSET_S stays in node/facts/probe.py: the probe also runs
# as one hand-copied file, docs/doctor.md.)
ENV_DUMP_WEIGHTS = "CLUSTERKIT_DUMP_WEIGHTS"
# `clusterkit nodes env`'s facts (node/facts/envfacts.py): KEY=VALUE,... replacing what a test
# node reports (machine=aarch64, glibc=2.17), honoured by nothing else (docs/getting-nodes-ready.md).
ENV_TEST_ENVFACTS = "CLUSTERKIT_TEST_ENVFACTS"
# The launcher's agent streams appended to this file (launch/recording.py): read on the
# launching machine only, by the tests that replay a real launch's console.
ENV_RECORD_AGENTS = "CLUSTERKIT_RECORD_AGENTS"

# Rank 0 of the bundled workload ends with this line + one JSON object; the launcher
# reads it from the rank lines, prints it once and saves it (docs/launch.md).
SUMMARY_PREFIX = "CLUSTERKIT_SUMMARY "

# -- Placeholder tokens. The launcher's NodeTask job dir may name the job by JOB_ID_TOKEN
# (replaced by the job id before anything reaches a node); argv, env values and files
# sent to the agent may name the node's job dir by JOB_DIR_TOKEN (replaced on the node
# by its expanded, absolute job dir: ``~`` is the node's home, not the launcher's).
JOB_ID_TOKEN = "@JOB@"
JOB_DIR_TOKEN = "@JOB_DIR@"
# A program profile's resume template (``--resume_from_checkpoint {dir}``, issue 38) names
# the checkpoint dir by RESUME_DIR_FIELD, filled on the launcher (a launch) or on the
# batch host (sbatch); a line rendered before the tag is known (the batch script's step-0
# refusal) names it by CKPT_TAG_TOKEN, replaced by the batch host's node program.
RESUME_DIR_FIELD = "{dir}"
CKPT_TAG_TOKEN = "@TAG@"
# In a batch run's dir (JobDir.SLURM_RUNS/<id>.<run>/): the tag its plan step told the
# program to resume from (node/slurm/replica.py writes it, node/slurm/end.py reads it).
SLURM_RESUMED_FROM = "resumed_from"
# ... and where one-writer files (a snapshot) wait on their way from their writer to the
# other nodes (node/slurm/replica.py's ready step; the script removes it after).
SLURM_SPREAD_DIR = "spread"
# A batch run that converted a checkpoint turns checkpoint.load_universal on in the job's
# DeepSpeed config for itself only: the plain file kept beside it under this suffix and
# put back when the run ends (jobs/slurm_reshard.py, the batch script); `clusterkit
# sbatch` removes one a killed run left when it writes the job's files again.
SLURM_PLAIN_SUFFIX = ".plain"
# How a user's node-local checkpoint continues on another number of nodes under
# `clusterkit sbatch` (spec/resume.resume_rule's "other_world", from its profile's
# OtherWorld; read by submit's check and the batch host's plan step): its top-level
# DeepSpeed tags converted, loaded as it is (a snapshot: its newest copy put on every
# node), or refused (a conversion the batch script does not make).
OTHER_WORLD_CONVERT = "convert"
OTHER_WORLD_AS_IS = "as-is"
OTHER_WORLD_REFUSE = "refuse"


def with_job_id(job_dir: str, job_id: str) -> str:
    """``job_dir`` with :data:`JOB_ID_TOKEN` replaced by ``job_id``."""
    return job_dir.replace(JOB_ID_TOKEN, job_id)


def expand_job_dir(value: str, job_dir: str) -> str:
    """``value`` with :data:`JOB_DIR_TOKEN` replaced by this node's ``job_dir``."""
    return value.replace(JOB_DIR_TOKEN, job_dir)


# -- Per-rank progress files, in a progress dir (the agent's per-node one, or sbatch's
# $CLUSTERKIT_HEARTBEAT_DIR).
HEARTBEAT_SUFFIX = ".heartbeat"
STACKS_SUFFIX = ".stacks"
HEARTBEAT_RE = re.compile(r"rank(\d+)\.heartbeat$")


def progress_file(progress_dir: str, rank: int, suffix: str) -> str:
    """``<progress dir>/rank<R><suffix>``."""
    return os.path.join(progress_dir, f"rank{rank}{suffix}")


def rank_file(env: Mapping[str, str], var: str, rank: int, suffix: str) -> str | None:
    """A rank's own progress file: ``$var`` itself, else
    ``$CLUSTERKIT_HEARTBEAT_DIR/rank<R><suffix>``; None outside clusterkit."""
    if env.get(var):
        return env[var]
    base = env.get(ENV_HEARTBEAT_DIR)
    return progress_file(base, rank, suffix) if base else None


class JobDir:
    """The layout of one job dir (the same on every node; ``root`` as the caller has it:
    absolute on the node, ``~/...`` or rendered in a plan). Every path below it is here.

    Paths are ``root + "/" + name``: rendered files and command lines write them this
    way on the launcher (whose OS need not be the node's), and the node's own root is
    absolute and ends in no slash, where this equals ``os.path.join``.
    """

    DS_CONFIG = "ds_config.json"  # the rendered ds_config, written into every node's job dir
    HOSTFILE = "hostfile"  # DeepSpeed's runner's --hostfile
    DEEPSPEED_ENV = "deepspeed_env"  # DeepSpeed's runner's DS_ENV_FILE
    LOGS = "logs"  # sbatch.sh's --output/--error; torchrun's --log-dir; a rendered job's rank logs
    RANK_LOGS = "ranklogs"  # ranklogs/<run id>: one `clusterkit launch` run's per-rank log files
    RUN = "run"  # the bundled workload's --run-dir (monitor, summary)
    SUMMARY = "summary.json"  # <run dir>/summary.json, and beside a launch's job record
    EXITS = "exits"  # sbatch: each rank that exits non-zero records how (argv.RANK_RUN)
    STOP = "stop"  # sbatch: $CLUSTERKIT_STOP_FILE
    PROGRESS = "progress"  # sbatch: $CLUSTERKIT_HEARTBEAT_DIR; under nodes/<node>/: the agent's
    HANG = "hang"  # sbatch: why the watchdog ended the step
    RUN_STARTED = "run_started"  # sbatch: a program that does not save on USR1: the run's start
    STOP_ENDED = "stop_ended"  # sbatch: the save the step was ended for at USR1 (node/slurm/end.py)
    HANGS = "hangs"  # sbatch: hangs/<slurm id>.<run>/: the watchdog's stacks
    STACKS = "stacks"  # stacks/a<attempt>/rank<R>.txt: the agent's stacks; a launch record's too
    NODES = "nodes"  # nodes/<node>/: one agent's logs, progress and state
    SLURM_NODES = "slurm_nodes"  # sbatch: the node list a node-local job's checkpoint is on
    SLURM_RUNS = "slurm-runs"  # sbatch: slurm-runs/<slurm id>.<run>/: a node-local run's hosts, plan
    SLURM_PROGRAM = "slurmreplica.bundle"  # sbatch, node-local: node/slurm/replica.py's sources
    JITOPS_PROGRAM = "jitops.bundle"  # sbatch: provision.jitbatch's sources (the JIT ops step)
    AGENT_STATE = "agent.json"
    REPLICA_STATE = "replicas.json"  # nodes/<node>/replicas.json: the agent's copies (issue 22)
    LAUNCHER_LOG = "launcher.log"
    CKPT_PREP = "checkpoint-prep"  # checkpoint-prep.<node>.json: ready the node's ckpt dir

    @classmethod
    def ckpt_prep(cls, node: str) -> str:
        """The job file that tells ``node``'s agent how to ready its checkpoint dir before
        the ranks start (issue 38): a name in the job dir, one per node."""
        return f"{cls.CKPT_PREP}.{node}.json"

    def __init__(self, root: str) -> None:
        self.root = root

    def path(self, *names: str) -> str:
        return "/".join((self.root, *names))

    @property
    def ds_config(self) -> str:
        return self.path(self.DS_CONFIG)

    def logs(self, node_rank: int | None = None) -> str:
        """``<job dir>/logs``, or one node's ``logs/node<N>`` (torchrun's --log-dir)."""
        return self.path(self.LOGS) if node_rank is None else self.path(self.LOGS, f"node{node_rank}")

    def rank_logs(self, run_id: str | None) -> str:
        """Where a launcher that writes each rank's output to files puts them:
        ``logs`` for a rendered job a person runs, ``ranklogs/<run id>`` for one
        ``clusterkit launch`` run (a continued job must not re-read an earlier run's)."""
        return self.logs() if run_id is None else self.path(self.RANK_LOGS, run_id)

    @property
    def run_dir(self) -> str:
        return self.path(self.RUN)

    @property
    def summary(self) -> str:
        return self.path(self.RUN, self.SUMMARY)

    @property
    def exits(self) -> str:
        return self.path(self.EXITS)

    @property
    def stop_file(self) -> str:
        return self.path(self.STOP)

    @property
    def progress(self) -> str:
        return self.path(self.PROGRESS)

    @property
    def hang_file(self) -> str:
        return self.path(self.HANG)

    @property
    def hangs(self) -> str:
        return self.path(self.HANGS)

    def stacks(self, attempt: int) -> str:
        return self.path(self.STACKS, f"a{attempt}")

    def node_dir(self, node: str) -> str:
        return self.path(self.NODES, node)

    def node_progress(self, node: str) -> str:
        """The agent's progress dir: its ranks' heartbeat and stacks files."""
        return self.path(self.NODES, node, self.PROGRESS)

    def agent_state(self, node: str) -> str:
        return self.path(self.NODES, node, self.AGENT_STATE)

    def replica_state(self, node: str) -> str:
        """The agent's record of its checkpoint copies: tag -> target -> state."""
        return self.path(self.NODES, node, self.REPLICA_STATE)

    def node_log(self, node: str, rank: int | str | None = None) -> str:
        """The agent's copy of a rank's lines (``rank<R>.log``), or of the launcher's."""
        return self.path(self.NODES, node, node_log_name(rank))


def node_log_name(rank: int | str | None) -> str:
    """The file name of a rank's lines in the agent's node dir (None: the launcher's;
    a str: a pattern such as ``<N>`` for a message)."""
    return JobDir.LAUNCHER_LOG if rank is None else f"rank{rank}.log"


def exits_dir(job_dir: str) -> str:
    return JobDir(job_dir).exits


# -- One node's view of the user-script contract (docs/launch.md, "Your own training
# script"): the plan builds one per node and puts its variables into the node's env.
# DeepSpeed's own convention (deepspeed.add_config_arguments): the script reads its config
# path from this argument. `--deepspeed-config-arg` appends it to the script's arguments.
DEEPSPEED_CONFIG_ARG = "--deepspeed_config"


class StorageKind(str, Enum):  # noqa: UP042 (no StrEnum on the node's Python 3.8)
    """Where a job's checkpoints live: the one spelling of each kind. A str, so JSON,
    YAML, env values and CLI choices keep the same text (``.value`` in f-strings:
    their format differs across Pythons)."""

    SHARED = "shared"  # one directory every node sees
    NODE_LOCAL = "node-local"  # each node's own disk: shards stay where their ranks ran


STORAGE_KINDS: tuple[str, ...] = tuple(k.value for k in StorageKind)


@dataclass(frozen=True)
class Contract:
    """One node's view of the job, as its ranks see it."""

    job_id: str
    job_dir: str  # this node's job dir (absolute)
    ckpt_dir: str  # this job's checkpoint dir on this node (absolute)
    storage: str  # a StorageKind value

    @property
    def ds_config(self) -> str:
        return JobDir(self.job_dir).ds_config

    def env(self) -> dict[str, str]:
        """The contract's variables, in their documented order."""
        if self.storage not in STORAGE_KINDS:
            # The plan resolves "auto" before it builds a node; anything else is a bug.
            raise ValueError(f"storage must be one of {STORAGE_KINDS}, got {self.storage!r}")
        return {ENV_JOB_ID: self.job_id, ENV_JOB_DIR: self.job_dir,
                ENV_DS_CONFIG: self.ds_config, ENV_CKPT_DIR: self.ckpt_dir,
                ENV_STORAGE: self.storage}

    def deepspeed_args(self) -> tuple[str, ...]:
        """``--deepspeed_config PATH``: what DeepSpeed scripts expect after their own args."""
        return (DEEPSPEED_CONFIG_ARG, self.ds_config)


# -- The step a checkpoint tag names, to order tags oldest to newest: DeepSpeed's
# ``global_step<N>`` and a user's ``step8`` or ``ckpt_0016`` alike, by their trailing
# number (step16 after step8, which a sort by name gets wrong); -1 for none.
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def tag_step(tag: str) -> int:
    m = _TRAILING_NUMBER.search(tag)
    return int(m.group(1)) if m else -1


# -- Checkpoint completion markers: each node writes ``clusterkit-complete.node<N>.json``
# into the tag dir once every rank of it saved; a checkpoint is complete when the markers
# of nodes 0 .. num_nodes-1 all exist (docs/collect-ckpt.md).
MARKER_PREFIX = "clusterkit-complete.node"
MARKER_SUFFIX = ".json"
MARKER_GLOB = f"{MARKER_PREFIX}*{MARKER_SUFFIX}"
_MARKER_RE = re.compile(r"^" + re.escape(MARKER_PREFIX) + r"(\d+)" + re.escape(MARKER_SUFFIX) + "$")


def marker_name(node_index: int) -> str:
    return f"{MARKER_PREFIX}{node_index}{MARKER_SUFFIX}"


def parse_marker_name(name: str) -> int | None:
    """The node index of a marker's file name; None for any other name."""
    m = _MARKER_RE.match(name)
    return int(m.group(1)) if m else None


def looks_like_marker(name: str) -> bool:
    """A name the node listing ships the text of: the launcher's reader then judges it
    (a malformed marker is reported there, not silently left out on the node)."""
    return name.startswith(MARKER_PREFIX) and name.endswith(MARKER_SUFFIX)


# `clusterkit sync`'s own state at the top of a synced directory (its manifest, partial
# files): the launcher's source walk and every node leave it out of what they compare.
SYNC_STATE_DIR = ".clusterkit-sync"


# -- DeepSpeed's checkpoint file names (checkpoints/layout.py parses them; the replica
# agents judge a tag dir with them on the node): the top-level ``latest`` and recovery
# scripts (global rank 0 only), the ZeRO 0-2 model states, ZeRO-3's per-rank model
# states and the per-rank optimizer shards.
LATEST_FILE = "latest"
# The DeepSpeed tag accelerate's save_state writes inside each of its folders and its
# load_state loads by that name (``load_checkpoint(dir, tag="pytorch_model")``, its
# MODEL_NAME): a reshard puts the universal conversion in its place (jobs/reshard.py).
ACCELERATE_DS_SUBDIR = "pytorch_model"
# A checkpoint that cannot be assembled on a restart's node set, kept beside the others
# under a name no program takes for a tag (issue 38): <tag>.set-aside[N]; inside
# accelerate's step_N after a reshard, the old world's DeepSpeed tag, kept as
# pytorch_model.set-aside where the conversion took its name (jobs/reshard.py).
ASIDE_SUFFIX = ".set-aside"
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
# DeepSpeed's universal checkpoint inside a program's tag dir (HF's checkpoint-N after a
# reshard: global_stepN_universal/ with latest_universal naming it, which DeepSpeed reads
# with checkpoint.load_universal on; accelerate's step_N/pytorch_model/, latest_universal
# naming it for collect's rule) and clusterkit's marker in such a dir (the save it was
# converted from: its world size, its files). The node listing ships the text of both, so
# that collect-ckpt and status judge the conversion with the rest of the tag.
LATEST_UNIVERSAL_FILE = "latest_universal"
# The name a universal conversion of tag T gets (T + UNIVERSAL_SUFFIX): a top-level tag of
# its own, or inside a program's tag dir beside T (HF's checkpoint-N after a reshard), where
# its files (every rank's, of another world) are no part of T's save.
UNIVERSAL_SUFFIX = "_universal"
UNIVERSAL_MARKER = "clusterkit-universal.json"
MODEL_STATES_RE = re.compile(r"^mp_rank_(\d{2})_model_states\.pt$")
ZERO3_MODEL_STATES_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d{2})_model_states\.pt$")
OPTIM_STATES_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2})_optim_states\.pt$")


def goes_last(rel: str) -> bool:
    """A file (relative to a checkpoint dir) that makes a checkpoint look complete on its
    node: written after the rest of what is put there (a launch's restore and reshard push,
    the batch script's spread), so a node that did not get everything never looks whole."""
    name = rel.rsplit("/", 1)[-1]
    return rel == LATEST_FILE or parse_marker_name(name) is not None or name == UNIVERSAL_MARKER


# -- Checkpoint replicas (issue 22, docs/lost-a-node.md). With node-local storage each
# node's agent copies every checkpoint its node completed to K other nodes' agents. A
# node's copies of node N's files live in the replica area beside the checkpoint dir:
# ``<ckpt dir>.replicas/node<N>/<tag>/``, a small checkpoint root of its own (the tag's
# files under ``<tag>/``, and for node 0 the top-level ``latest`` and recovery scripts),
# with ``clusterkit-replica.json`` (the manifest: every file's size, sha256 and mtime,
# as the source had them while sending) written last. A copy in progress is
# ``node<N>/.partial-<tag>-<nonce>/`` and is never read; only a dir with its manifest
# counts, and its files count only while their sha256 still equals the manifest's.
REPLICA_AREA_SUFFIX = ".replicas"
REPLICA_MANIFEST = "clusterkit-replica.json"
REPLICA_PARTIAL_PREFIX = ".partial-"
REPLICA_SCHEMA = "clusterkit.replica"
REPLICA_SCHEMA_VERSION = 1
_REPLICA_NODE_RE = re.compile(r"^node(\d+)$")
# The agents' replica servers listen on ports derived from the job id and node index (no
# launcher round trip, no port file): 10000-19999, below Linux's ephemeral range, with
# REPLICA_PORT_TRIES candidates each when one is taken.
REPLICA_PORT_BASE = 10000
REPLICA_PORT_SPAN = 10000
REPLICA_PORT_TRIES = 4


def replica_area(ckpt_dir: str) -> str:
    """``<ckpt dir>.replicas``: every copy this node holds of other nodes' checkpoints."""
    return ckpt_dir.rstrip("/") + REPLICA_AREA_SUFFIX


def replica_source_dir(ckpt_dir: str, source_index: int) -> str:
    """``<ckpt dir>.replicas/node<N>``: this node's copies of node index N's files."""
    return replica_area(ckpt_dir) + f"/node{source_index}"


def replica_dir(ckpt_dir: str, source_index: int, tag: str) -> str:
    """``<ckpt dir>.replicas/node<N>/<tag>``: one complete copy (once its manifest exists)."""
    return replica_source_dir(ckpt_dir, source_index) + "/" + tag


def parse_replica_source(name: str) -> int | None:
    """The node index of a ``node<N>`` dir in the replica area; None for any other name."""
    m = _REPLICA_NODE_RE.match(name)
    return int(m.group(1)) if m else None


def replica_ports(job_id: str, node_index: int) -> list[int]:
    """The ports node index ``node_index``'s replica server tries, in order (its peers
    try the same list; the handshake tells them which answers for this job)."""
    h = int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16)
    return [REPLICA_PORT_BASE + (h + node_index + 1009 * k) % REPLICA_PORT_SPAN
            for k in range(REPLICA_PORT_TRIES)]


# -- The bundle a node program is started with: one header line naming each module (its
# dotted name below clusterkit.node: ``agent.core``) and its size, then the sources
# (ship.py writes it, the bootstrap reads it; slurm/watch.py re-sends its own to the
# other nodes of its job, replicas/proc.py its own to its copy process).
BUNDLE_MAGIC = "clusterkit-node"
BUNDLE_VERSION = 2  # 2: dotted module names, subpackages made by the bootstrap


# The node bootstrap (``python -c BOOTSTRAP <program> <args>``): the header and the
# sources on stdin, each registered as ``clusterkit.node.<module>`` (the packages above
# it made empty, ``__path__ = []``, each set as its parent's attribute), then
# ``<program>.main(args)``. The launcher starts every node program so (ship.py); the
# agent starts its copy process so (node/replicas/proc.py), handing on its own sources.
BOOTSTRAP = (
    "import linecache,sys,types\n"
    "r=sys.stdin.buffer\n"
    "h=r.readline().split()\n"
    f"if h[:2]!=[b'{BUNDLE_MAGIC}',b'{BUNDLE_VERSION}']:"
    f"sys.exit('clusterkit node bootstrap: expected a {BUNDLE_MAGIC} {BUNDLE_VERSION} header "
    "on stdin, got %r'%h[:2])\n"
    "def P(f,a=None):\n"
    " m=types.ModuleType(f);m.__path__=[];sys.modules[f]=m\n"
    " if a:setattr(a,f.rsplit('.',1)[1],m)\n"
    " return m\n"
    "N=P('clusterkit.node',P('clusterkit'))\n"
    "for e in h[2:]:\n"
    " n,z=e.decode().split(':');s=r.read(int(z))\n"
    " if len(s)!=int(z):sys.exit('clusterkit node bootstrap: stdin ended inside '+n)\n"
    " *q,b=n.split('.');a=N\n"
    " for w in q:a=getattr(a,w,None) or P(a.__name__+'.'+w,a)\n"
    " f='clusterkit.node.'+n;m=types.ModuleType(f);m.__file__='<'+f+'>'\n"
    " t=s.decode('utf-8');linecache.cache[m.__file__]=(len(t),None,t.splitlines(True),m.__file__)\n"
    " sys.modules[f]=m;setattr(a,b,m)\n"
    " exec(compile(t,m.__file__,'exec'),m.__dict__)\n"
    "sys.argv=['clusterkit.node.'+sys.argv[1]]+sys.argv[2:]\n"
    "sys.exit(sys.modules[sys.argv[0]].main(sys.argv[1:]))\n"
)


def encode_bundle(modules: list[tuple[str, bytes]]) -> bytes:
    """``clusterkit-node 2 name:len ...\\n`` and the sources, dependencies first."""
    header = " ".join([BUNDLE_MAGIC, str(BUNDLE_VERSION),
                       *(f"{name}:{len(data)}" for name, data in modules)])
    return header.encode() + b"\n" + b"".join(data for _, data in modules)
