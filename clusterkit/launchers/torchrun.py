"""``--launcher torchrun``: ``python -m torch.distributed.run`` on every node.

Also renders the torchrun fan-out over pdsh (``torchrun-pdsh``, for reference in
commands.sh) and the srun + torchrun line of sbatch.sh, which ``native`` and ``slurm``
share.
"""

from __future__ import annotations

import shlex

from clusterkit.launchers.argv import (
    ADDR_WORD,
    PORT_WORD,
    TORCHRUN,
    launcher_program,
    pdsh_ssh_args,
    rendezvous,
    same_nproc,
    srun_torchrun_argv,
    torchrun_restarts,
    uniform,
    with_shell_vars,
    without_path,
)
from clusterkit.launchers.base import Backend
from clusterkit.node.contract import exits_dir
from clusterkit.shellsafe import NODE_RANK_PLACEHOLDER, pdsh_remote
from clusterkit.spec.job import JobPlan, NodeCommand, NodePlan, launcher_log_dir


def _torchrun_flags(plan: JobPlan, node: NodePlan, node_rank: str | None,
                    log_dir: str) -> list[str]:
    o = plan.options
    # --log-dir: per-rank stdout/stderr files (torchrun makes a fresh subdirectory per run);
    # --tee: and still on the console.
    flags = [f"--nnodes={len(plan.nodes)}", f"--nproc-per-node={node.nproc}",
             *rendezvous(plan, node_rank),
             f"--max-restarts={torchrun_restarts(plan, static=o.rdzv != 'c10d')}",
             f"--log-dir={log_dir}", "--tee=3"]
    if o.local_ranks_filter is not None:
        flags.append(f"--local-ranks-filter={o.local_ranks_filter}")
    return flags


def torchrun_commands(plan: JobPlan, run_id: str | None) -> tuple[NodeCommand, ...]:
    """One ``python -m torch.distributed.run`` per node, each with its own node rank."""
    out = []
    for node in plan.nodes:
        argv = [node.python, *TORCHRUN, *_torchrun_flags(plan, node, str(node.node_rank),
                                                         launcher_log_dir(node.job_dir, node.node_rank)),
                *launcher_program(plan.programs[node.node_rank], "-m")]
        out.append(NodeCommand(label=f"torchrun node {node.node_rank}", host=node.name,
                               node_rank=node.node_rank, argv=tuple(argv), env=node.env,
                               cwd=node.workdir))
    return tuple(out)


def torchrun_pdsh_command(plan: JobPlan, run_id: str | None) -> tuple[NodeCommand, ...]:
    """The same torchrun on every node from node 0 in one ``pdsh`` fan-out (``%n`` = node rank)."""
    uniform(plan, "the pdsh fan-out")
    node = plan.nodes[0]
    same_nproc(plan, "the pdsh fan-out")
    inner = [node.python, *TORCHRUN, *_torchrun_flags(plan, node, NODE_RANK_PLACEHOLDER,
                                                    launcher_log_dir(node.job_dir)),
             *launcher_program(plan.programs[0], "-m")]
    env_words = [f"{k}={v}" for k, v in node.env.items()]
    line = f"cd -- {shlex.quote(node.workdir)} && {shlex.join(['env', *env_words, *inner])}"
    hosts = ",".join(n.name for n in plan.nodes)
    argv = ["pdsh", "-R", "ssh", "-S", "-f", str(len(plan.nodes)), "-w", hosts, pdsh_remote(line)]
    return (NodeCommand(label="torchrun on every node via pdsh", host=node.name, node_rank=None,
                        argv=tuple(argv), env={"PDSH_SSH_ARGS_APPEND": pdsh_ssh_args(plan)},
                        cwd=node.workdir),)


def sbatch_line(plan: JobPlan, log_dir: str) -> tuple[str, str]:
    """sbatch.sh: srun starts one torchrun per node; the address/port are the script's."""
    argv = without_path(srun_torchrun_argv(plan, ADDR_WORD, PORT_WORD, log_dir,
                                           exits_dir(plan.nodes[0].job_dir)),
                        plan.nodes[0].env.get("PATH", ""))
    return "torchrun", with_shell_vars(argv)


BACKEND = Backend(
    "torchrun", "python -m torch.distributed.run on every node", plan_backend="torchrun",
    command_sets=("torchrun",), sbatch_plan="slurm",
    builders=(("torchrun", torchrun_commands), ("torchrun-pdsh", torchrun_pdsh_command)),
    sbatch_line=sbatch_line)
