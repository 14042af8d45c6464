"""The values a launch plan is made of (frozen dataclasses, no behaviour beyond formatting)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterkit.inventory import Host
from clusterkit.render.dsconfig import ZeroSpec

BACKENDS: tuple[str, ...] = ("torchrun", "deepspeed", "accelerate", "slurm")
STORAGE_CHOICES: tuple[str, ...] = ("auto", "shared", "node-local")
RDZV_CHOICES: tuple[str, ...] = ("auto", "static", "c10d")
DS_LAUNCHERS: tuple[str, ...] = ("pdsh", "openmpi", "slurm")
WORKLOAD_MODULE = "clusterkit.workload"
# `sh -c` program that enters a directory and execs the rest: a fixed string, the
# directory and argv arrive as positional parameters, so nothing is re-parsed.
CD_EXEC = 'cd -- "$1" && shift && exec "$@"'


@dataclass(frozen=True)
class JobOptions:
    """What the user asked for (CLI flags). Defaults render the bundled workload with torchrun."""

    job_id: str
    backend: str = "torchrun"
    # host selection, DeepSpeed semantics (clusterkit.hostfile.select_hosts)
    nodes: int | None = None
    gpus_per_node: int | None = None
    include: str = ""
    exclude: str = ""
    # the program: a script path or a module; neither = the bundled workload
    script: str | None = None
    module: str | None = None
    script_args: tuple[str, ...] = ()
    deepspeed_config_arg: bool = False  # append --deepspeed_config PATH to the script's args
    # workload and ZeRO
    model: str = "tiny"
    steps: int = 100
    zero_stage: int = 2
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: str | None = None
    precision: str = "auto"  # auto: bf16 when every node has GPUs, else fp32
    micro_batch: int = 1
    grad_accum: int = 1
    clip: float = 1.0
    lr: float = 1e-3
    warmup_steps: int = 10
    save_16bit: bool = False
    tensorboard: bool = False
    save_every: int = 0
    # checkpoints
    storage: str = "auto"  # auto: shared when every node has shared_dir, else node-local
    ckpt_dir: str | None = None  # overrides the inventory's directory
    # environment
    env_allowlist: tuple[str, ...] = ()
    set_env: tuple[tuple[str, str], ...] = ()
    # launcher knobs
    rdzv: str = "auto"  # auto: static per node; c10d under Slurm unless node-local
    max_restarts: int = 0
    local_ranks_filter: str | None = None
    deepspeed_launcher: str = "pdsh"
    accelerate_use_deepspeed: bool = True
    # Slurm
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str = "01:00:00"
    cpus_per_task: int | None = None

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


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch needs, decided up front. Printing it is the dry run."""

    job_id: str
    cluster: str
    backend: str
    nodes: tuple[NodePlan, ...]
    world_size: int
    master_addr: str
    master_port: int
    storage: str
    zero: ZeroSpec
    program: tuple[str, ...]  # interpreter arguments: ("-m", "clusterkit.workload", ...) or (script, ...)
    # backend -> commands; "torchrun", "torchrun-pdsh", "deepspeed", "accelerate", "srun", "sbatch"
    commands: Mapping[str, tuple[NodeCommand, ...]] = field(hash=False)
    skipped: Mapping[str, str] = field(hash=False)  # backend -> why it could not be rendered
    artifacts: Mapping[str, str] = field(hash=False)  # file name -> text
    ds_config: Mapping[str, Any] = field(hash=False)
    # per node (same order as ``nodes``): the interpreter arguments each node's ranks run
    programs: tuple[tuple[str, ...], ...] = ()

    @property
    def job_dir(self) -> str:
        """Node 0's per-job directory (where the head-node artifacts go)."""
        return self.nodes[0].job_dir

    @property
    def launch_commands(self) -> tuple[NodeCommand, ...]:
        """The commands for the chosen backend: what ``clusterkit launch`` runs."""
        key = "sbatch" if self.backend == "slurm" else self.backend
        return self.commands[key]

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)
