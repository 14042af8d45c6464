"""Command lines for every backend, as argv lists (pure).

Each builder returns :class:`NodeCommand` values: ``argv`` + ``env`` + ``cwd``,
quoted once at the boundary (``NodeCommand.shell_line`` / ``full_argv``). Which
launcher passes ``--local_rank``: DeepSpeed's ``deepspeed.launcher.launch`` appends
``--local_rank=N`` (we leave that on: the workload accepts both spellings);
torchrun, ``accelerate launch`` and plain ``srun`` pass nothing and set
``LOCAL_RANK`` (or ``SLURM_LOCALID``) in the environment instead.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from clusterkit.errors import RenderError
from clusterkit.render.shellsafe import NODE_RANK_PLACEHOLDER, bare_word, ds_user_arg, pdsh_remote
from clusterkit.spec.job import JobOptions, NodeCommand, NodePlan

TORCHRUN = ("-m", "torch.distributed.run")
DS_RUNNER = ("-u", "-m", "deepspeed.launcher.runner")
ACCELERATE = ("-m", "accelerate.commands.launch")
# Run torchrun with --node-rank taken from the Slurm task's own environment: a fixed
# script, the interpreter and the remaining words arrive as "$0" "$@", nothing is re-parsed.
# Slurm's --signal=USR1@90 signals every process of the step. torchrun has no USR1
# handler, so the default action would kill it (and then srun kills the saving ranks);
# ignoring USR1 in torchrun is safe because the workload installs its own handler,
# which replaces the inherited "ignore".
IGNORE_USR1 = 'trap "" USR1; '
SLURM_NODE_RANK_EXEC = IGNORE_USR1 + 'exec "$0" -m torch.distributed.run --node-rank="$SLURM_NODEID" "$@"'
SLURM_EXEC = IGNORE_USR1 + 'exec "$@"'


@dataclass(frozen=True)
class JobLayout:
    """The decided job shape the command builders read (a slice of the plan)."""

    job_id: str
    nodes: tuple[NodePlan, ...]
    programs: tuple[tuple[str, ...], ...]  # per node: interpreter args ("-m", mod, ...) or (script, ...)
    world_size: int
    master_addr: str
    master_port: int
    options: JobOptions
    node_local: bool


def launcher_program(program: Sequence[str], module_flag: str) -> list[str]:
    """``("-m", mod, *args)`` as a launcher wants it (``--module mod ...``)."""
    if program and program[0] == "-m":
        return [module_flag, *program[1:]]
    return list(program)


def uniform(layout: JobLayout, backend: str) -> None:
    """Backends that run one command line for every node need identical nodes."""
    first = layout.nodes[0]
    for node in layout.nodes[1:]:
        for what, a, b in (("python", first.python, node.python),
                           ("workdir", first.workdir, node.workdir),
                           ("program", layout.programs[0], layout.programs[node.node_rank]),
                           ("environment", dict(first.env), dict(node.env))):
            if a != b:
                raise RenderError(
                    f"{backend} runs the same command on every node, but {what} differs between "
                    f"{first.name} and {node.name}", key=what,
                    hint="make it the same in the inventory (defaults:) or use --launcher torchrun")


def _same_nproc(layout: JobLayout, backend: str) -> int:
    counts = {n.nproc for n in layout.nodes}
    if len(counts) != 1:
        raise RenderError(f"{backend} needs the same number of ranks on every node, got "
                          + ", ".join(f"{n.name}={n.nproc}" for n in layout.nodes),
                          key="--gpus-per-node", hint="select whole hosts with equal slots")
    return counts.pop()


def _rendezvous(layout: JobLayout, node_rank: str | None) -> list[str]:
    o = layout.options
    if o.rdzv == "c10d":
        if layout.node_local:
            raise RenderError("c10d rendezvous assigns node ranks in arrival order, so node-local "
                              "checkpoints could be resumed on the wrong node", key="--rdzv",
                              hint="use --rdzv static with --storage node-local")
        return ["--rdzv-backend=c10d", f"--rdzv-endpoint={layout.master_addr}:{layout.master_port}",
                f"--rdzv-id={layout.job_id}"]
    words = [f"--node-rank={node_rank}"] if node_rank is not None else []
    return [*words, f"--master-addr={layout.master_addr}", f"--master-port={layout.master_port}"]


def _torchrun_flags(layout: JobLayout, node: NodePlan, node_rank: str | None,
                    log_dir: str) -> list[str]:
    o = layout.options
    # --log-dir: per-rank stdout/stderr files (torchrun makes a fresh subdirectory per run);
    # --tee: and still on the console.
    flags = [f"--nnodes={len(layout.nodes)}", f"--nproc-per-node={node.nproc}",
             *_rendezvous(layout, node_rank), f"--max-restarts={o.max_restarts}",
             f"--log-dir={log_dir}", "--tee=3"]
    if o.local_ranks_filter is not None:
        flags.append(f"--local-ranks-filter={o.local_ranks_filter}")
    return flags


def torchrun_commands(layout: JobLayout) -> tuple[NodeCommand, ...]:
    """One ``python -m torch.distributed.run`` per node, each with its own node rank."""
    out = []
    for node in layout.nodes:
        argv = [node.python, *TORCHRUN, *_torchrun_flags(layout, node, str(node.node_rank),
                                                         f"{node.job_dir}/logs/node{node.node_rank}"),
                *launcher_program(layout.programs[node.node_rank], "-m")]
        out.append(NodeCommand(label=f"torchrun node {node.node_rank}", host=node.name,
                               node_rank=node.node_rank, argv=tuple(argv), env=node.env,
                               cwd=node.workdir))
    return tuple(out)


def pdsh_ssh_args(layout: JobLayout) -> str:
    """PDSH_SSH_ARGS_APPEND: our ssh_config (host names -> addresses, users, ports, keys)."""
    path = bare_word(f"{layout.nodes[0].job_dir}/ssh_config", "job directory")
    return f"-F {path}"


def torchrun_pdsh_command(layout: JobLayout) -> tuple[NodeCommand, ...]:
    """The same torchrun on every node from node 0 in one ``pdsh`` fan-out (``%n`` = node rank)."""
    uniform(layout, "the pdsh fan-out")
    node = layout.nodes[0]
    _same_nproc(layout, "the pdsh fan-out")
    inner = [node.python, *TORCHRUN, *_torchrun_flags(layout, node, NODE_RANK_PLACEHOLDER,
                                                    f"{node.job_dir}/logs"),
             *launcher_program(layout.programs[0], "-m")]
    env_words = [f"{k}={v}" for k, v in node.env.items()]
    line = f"cd -- {shlex.quote(node.workdir)} && {shlex.join(['env', *env_words, *inner])}"
    hosts = ",".join(n.name for n in layout.nodes)
    argv = ["pdsh", "-R", "ssh", "-S", "-f", str(len(layout.nodes)), "-w", hosts, pdsh_remote(line)]
    return (NodeCommand(label="torchrun on every node via pdsh", host=node.name, node_rank=None,
                        argv=tuple(argv), env={"PDSH_SSH_ARGS_APPEND": pdsh_ssh_args(layout)},
                        cwd=node.workdir),)


def deepspeed_command(layout: JobLayout) -> tuple[NodeCommand, ...]:
    """DeepSpeed's runner on node 0; it starts every node itself (pdsh, openmpi or slurm)."""
    uniform(layout, "the deepspeed launcher")
    node = layout.nodes[0]
    # The runner pastes these into the pdsh command line without quoting.
    for what, value in (("workdir", node.workdir), ("python", node.python),
                        ("master address", layout.master_addr), ("job directory", node.job_dir)):
        bare_word(value, what)
    program = launcher_program(layout.programs[0], "--module")
    for arg in program:
        ds_user_arg(arg)
    argv = [node.python, *DS_RUNNER, f"--hostfile={node.job_dir}/hostfile",
            f"--launcher={layout.options.deepspeed_launcher}",
            f"--master_addr={layout.master_addr}", f"--master_port={layout.master_port}",
            # clusterkit doctor checks ssh with the settings pdsh uses; DeepSpeed's own check
            # runs plain `ssh HOST hostname` without them.
            "--no_ssh_check", f"--enable_each_rank_log={node.job_dir}/logs", *program]
    env = {"PATH": node.env["PATH"], "DS_ENV_FILE": f"{node.job_dir}/deepspeed_env",
           "PDSH_SSH_ARGS_APPEND": pdsh_ssh_args(layout),
           "CLUSTERKIT_JOB_ID": layout.job_id}
    return (NodeCommand(label="deepspeed runner on node 0", host=node.name, node_rank=None,
                        argv=tuple(argv), env=env, cwd=node.workdir),)


def accelerate_config_name(node_rank: int) -> str:
    return f"accelerate_config.rank{node_rank}.yaml"


def accelerate_commands(layout: JobLayout) -> tuple[NodeCommand, ...]:
    """``accelerate launch --config_file`` per node, each with its machine_rank's YAML."""
    out = []
    for node in layout.nodes:
        # --tee 3: accelerate hands it to torchrun, whose "[default<r>]:" line prefix
        # names each rank (the node agent reads it as the rank label).
        argv = [node.python, *ACCELERATE, "--tee", "3",
                f"--config_file={node.job_dir}/{accelerate_config_name(node.node_rank)}",
                *launcher_program(layout.programs[node.node_rank], "--module")]
        out.append(NodeCommand(label=f"accelerate node {node.node_rank}", host=node.name,
                               node_rank=node.node_rank, argv=tuple(argv), env=node.env,
                               cwd=node.workdir))
    return tuple(out)


def srun_torchrun_argv(layout: JobLayout, master_addr: str, master_port: str) -> list[str]:
    """``srun ... torchrun`` words; the address/port may be shell variables (sbatch)."""
    uniform(layout, "srun")
    node = layout.nodes[0]
    nproc = _same_nproc(layout, "srun")
    o = layout.options
    head = ["srun", f"--nodes={len(layout.nodes)}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            f"--chdir={node.workdir}", "env", *(f"{k}={v}" for k, v in node.env.items())]
    common = [f"--nnodes={len(layout.nodes)}", f"--nproc-per-node={nproc}",
              f"--max-restarts={o.max_restarts}", "--tee=3"]
    program = launcher_program(layout.programs[0], "-m")
    if o.rdzv == "c10d" and layout.node_local:
        _rendezvous(layout, None)  # raises: c10d cannot keep rank -> node fixed
    if layout.node_local or o.rdzv == "static":
        # Static rendezvous keeps rank -> node fixed (node-local checkpoints depend on it).
        return [*head, "sh", "-c", SLURM_NODE_RANK_EXEC, node.python, *common,
                f"--master-addr={master_addr}", f"--master-port={master_port}", *program]
    return [*head, "sh", "-c", SLURM_EXEC, "sh", node.python, *TORCHRUN, *common, "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master_addr}:{master_port}", f"--rdzv-id={layout.job_id}", *program]


def srun_command(layout: JobLayout) -> tuple[NodeCommand, ...]:
    """The srun line to run inside an allocation (``salloc``), from the login node."""
    argv = srun_torchrun_argv(layout, layout.master_addr, str(layout.master_port))
    return (NodeCommand(label="srun inside an allocation", host=None, node_rank=None,
                        argv=tuple(argv)),)


def sbatch_command(layout: JobLayout) -> tuple[NodeCommand, ...]:
    return (NodeCommand(label="submit the batch script", host=None, node_rank=None,
                        argv=("sbatch", f"{layout.nodes[0].job_dir}/sbatch.sh")),)
