"""Argv pieces more than one launcher builds on (pure).

Each builder returns :class:`~clusterkit.spec.job.NodeCommand` values: ``argv`` +
``env`` + ``cwd``, quoted once at the boundary (``NodeCommand.shell_line`` /
``full_argv``). Which launcher passes ``--local_rank``: DeepSpeed's
``deepspeed.launcher.launch`` appends ``--local_rank=N`` (we leave that on: the
workload accepts both spellings); torchrun, ``accelerate launch`` and plain ``srun``
pass nothing and set ``LOCAL_RANK`` (or ``SLURM_LOCALID``) in the environment instead.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from clusterkit.errors import RenderError
from clusterkit.shellsafe import bare_word
from clusterkit.spec.job import JobPlan

TORCHRUN = ("-m", "torch.distributed.run")
# Slurm's --signal=USR1@90 (and scancel --signal=USR1) signals every process of the step.
# torchrun and `accelerate launch` have no USR1 handler, so the default action would kill
# the launcher (and then srun kills the saving ranks); ignoring USR1 there is safe because
# the workload installs its own handler, which replaces the inherited "ignore".
IGNORE_USR1 = 'trap "" USR1; '
# Run torchrun with --node-rank taken from the Slurm task's own environment: a fixed
# script, the interpreter and the remaining words arrive as "$0" "$@", nothing is re-parsed.
SLURM_NODE_RANK_EXEC = IGNORE_USR1 + 'exec "$0" -m torch.distributed.run --node-rank="$SLURM_NODEID" "$@"'
SLURM_EXEC = IGNORE_USR1 + 'exec "$@"'
# sbatch.sh runs every rank under this shell ("$0" = the job's exits dir), which outlives
# the rank (no exec) to record how it ended: a rank that exits non-zero writes
# "<time ns> <node> <status>" to <exits dir>/rank$RANK. After a failed step the batch
# script names the earliest one: --kill-on-bad-exit then tears the other ranks down with
# SIGTERM, and their 143 must not hide the cause (a missing file's 2, an import error's 1).
# The rank keeps USR1 ignored unless it installs a handler (docs/sbatch.md, "Preemption").
RANK_RUN = (IGNORE_USR1 + 'd=$0; "$@"; rc=$?; [ "$rc" = 0 ] || printf "%s %s %s\\n" '
            '"$(date +%s%N)" "${SLURMD_NODENAME:-$(hostname)}" "$rc" 2>/dev/null >"$d/rank$RANK"; '
            'exit "$rc"')
# One Slurm task per rank (sbatch.sh's deepspeed variant): the standard torch variables
# from Slurm's own, as torchrun sets them for its ranks (deepspeed.init_distributed needs
# RANK/LOCAL_RANK/WORLD_SIZE, or it falls back to MPI discovery and mpi4py).
SLURM_RANK_RUN = ('export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" '
                  'WORLD_SIZE="$SLURM_NTASKS"; ' + RANK_RUN)
# sbatch.sh launch lines: the master address/port are the batch script's shell variables.
ADDR_WORD = "@CLUSTERKIT_MASTER_ADDR@"
PORT_WORD = "@CLUSTERKIT_MASTER_PORT@"


def launcher_program(program: Sequence[str], module_flag: str) -> list[str]:
    """``("-m", mod, *args)`` as a launcher wants it (``--module mod ...``)."""
    if program and program[0] == "-m":
        return [module_flag, *program[1:]]
    return list(program)


def uniform(plan: JobPlan, backend: str) -> None:
    """Backends that run one command line for every node need identical nodes."""
    first = plan.nodes[0]
    for node in plan.nodes[1:]:
        for what, a, b in (("python", first.python, node.python),
                           ("workdir", first.workdir, node.workdir),
                           ("program", plan.programs[0], plan.programs[node.node_rank]),
                           ("environment", dict(first.env), dict(node.env))):
            if a != b:
                raise RenderError(
                    f"{backend} runs the same command on every node, but {what} differs between "
                    f"{first.name} and {node.name}", key=what,
                    hint="make it the same in the inventory (defaults:) or use --launcher torchrun")


def same_nproc(plan: JobPlan, backend: str) -> int:
    counts = {n.nproc for n in plan.nodes}
    if len(counts) != 1:
        raise RenderError(f"{backend} needs the same number of ranks on every node, got "
                          + ", ".join(f"{n.name}={n.nproc}" for n in plan.nodes),
                          key="--gpus-per-node", hint="select whole hosts with equal slots")
    return counts.pop()


def torchrun_restarts(plan: JobPlan, *, static: bool) -> int:
    """torchrun's own ``--max-restarts``. Under a static rendezvous torchrun restarts only
    its own node's ranks, which cannot rejoin the others (seen on the Slurm bed: a rank's
    exit-time abort restarted it alone, and it died on gloo's "connectFullMesh ...
    Connection refused"): 0 there, the job's own restarts (launch's attempts, the batch
    script's requeues) are the ones that work. Under c10d every node re-rendezvouses."""
    return 0 if static else plan.options.max_restarts


def rendezvous(plan: JobPlan, node_rank: str | None) -> list[str]:
    o = plan.options
    if o.rdzv == "c10d":
        if plan.node_local:
            raise RenderError("c10d rendezvous assigns node ranks in arrival order, so node-local "
                              "checkpoints could be resumed on the wrong node", key="--rdzv",
                              hint="use --rdzv static with --storage node-local")
        return ["--rdzv-backend=c10d", f"--rdzv-endpoint={plan.master_addr}:{plan.master_port}",
                f"--rdzv-id={plan.job_id}"]
    words = [f"--node-rank={node_rank}"] if node_rank is not None else []
    return [*words, f"--master-addr={plan.master_addr}", f"--master-port={plan.master_port}"]


def pdsh_ssh_args(plan: JobPlan) -> str:
    """PDSH_SSH_ARGS_APPEND: our ssh_config (host names -> addresses, users, ports, keys)."""
    path = bare_word(f"{plan.nodes[0].job_dir}/ssh_config", "job directory")
    return f"-F {path}"


def ranks_under_recorder(plan: JobPlan, exits_dir: str, no_python: str) -> list[str]:
    """``<no_python> sh -c RANK_RUN <exits dir> <python> -u <program>``: a torchrun-based
    launcher (its ``--no-python`` spelling) starts each rank under :data:`RANK_RUN`."""
    node = plan.nodes[0]
    return [no_python, "sh", "-c", RANK_RUN, exits_dir, node.python, "-u", *plan.programs[0]]


def srun_torchrun_argv(plan: JobPlan, master_addr: str, master_port: str,
                       log_dir: str, exits_dir: str | None = None) -> list[str]:
    """``srun ... torchrun`` words; the address/port may be shell variables (sbatch).

    ``--log-dir``: without it torchrun makes ``/tmp/torchelastic_*`` on every node and
    never removes it (one leftover per node per run); with it each rank's output also
    lands in a file under the job's log directory. ``exits_dir`` (sbatch.sh): each rank
    runs under :data:`RANK_RUN`, which records a failing rank's status there."""
    uniform(plan, "srun")
    node = plan.nodes[0]
    nproc = same_nproc(plan, "srun")
    o = plan.options
    head = ["srun", f"--nodes={len(plan.nodes)}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            f"--chdir={node.workdir}", "env", *(f"{k}={v}" for k, v in node.env.items())]
    static = plan.node_local or o.rdzv == "static"
    common = [f"--nnodes={len(plan.nodes)}", f"--nproc-per-node={nproc}",
              f"--max-restarts={torchrun_restarts(plan, static=static)}",
              f"--log-dir={log_dir}", "--tee=3"]
    program = (launcher_program(plan.programs[0], "-m") if exits_dir is None
               else ranks_under_recorder(plan, exits_dir, "--no-python"))
    if o.rdzv == "c10d" and plan.node_local:
        rendezvous(plan, None)  # raises: c10d cannot keep rank -> node fixed
    if static:
        # Static rendezvous keeps rank -> node fixed (node-local checkpoints depend on it).
        return [*head, "sh", "-c", SLURM_NODE_RANK_EXEC, node.python, *common,
                f"--master-addr={master_addr}", f"--master-port={master_port}", *program]
    return [*head, "sh", "-c", SLURM_EXEC, "sh", node.python, *TORCHRUN, *common, "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master_addr}:{master_port}", f"--rdzv-id={plan.job_id}", *program]


def with_shell_vars(argv: list[str]) -> str:
    """shlex.join, then the two placeholders become "$MASTER_ADDR"/"$MASTER_PORT"."""
    line = shlex.join(argv)
    if line.count(ADDR_WORD) != 1 or line.count(PORT_WORD) != 1:
        raise RenderError("a value contains a reserved word @CLUSTERKIT_MASTER_...@",
                          hint="rename it")
    return line.replace(ADDR_WORD, '"$MASTER_ADDR"').replace(PORT_WORD, '"$MASTER_PORT"')


def without_path(argv: list[str], path: str) -> list[str]:
    # srun passes the script's environment to every task; its PATH (the site's, with the
    # interpreter's dir in front) must not be replaced by the plan's fixed system PATH.
    word = f"PATH={path}"
    return [w for w in argv if w != word]


def srun_rank_argv(plan: JobPlan, exits_dir: str, extra: list[str]) -> list[str]:
    """sbatch.sh, one Slurm task per rank: srun, the job environment, the torch variables
    (:data:`SLURM_RANK_RUN`), the program under the exit recorder."""
    uniform(plan, "srun")
    node = plan.nodes[0]
    nproc = same_nproc(plan, "srun")
    return ["srun", f"--nodes={len(plan.nodes)}", f"--ntasks-per-node={nproc}",
            "--kill-on-bad-exit=1", f"--chdir={node.workdir}", *extra, *srun_env_words(plan),
            f"LOCAL_WORLD_SIZE={nproc}", "sh", "-c", SLURM_RANK_RUN, exits_dir, node.python, "-u",
            *plan.programs[0]]


def srun_env_words(plan: JobPlan) -> list[str]:
    """``env K=V ...`` for an srun line in sbatch.sh: everything but PATH (the script's own)."""
    return ["env", *(f"{k}={v}" for k, v in plan.nodes[0].env.items() if k != "PATH")]
