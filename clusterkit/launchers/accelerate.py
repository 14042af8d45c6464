"""``--launcher accelerate``: ``accelerate launch`` on every node, one config YAML each.

The YAML keys and checks follow accelerate 1.x (``commands/config/config_args.py``
``ClusterConfig``, ``utils/dataclasses.py`` ``DeepSpeedPlugin``):

* ``num_processes`` is the TOTAL number of processes, not per machine.
* With ``deepspeed_config_file`` the precision, ZeRO stage, offload, accumulation and
  clipping live in ds_config.json only: accelerate raises if the YAML also sets
  ``mixed_precision`` or any of those keys, so the YAML carries none of them.
* ``deepspeed_multinode_launcher: standard`` (torchrun on every node). The ``pdsh``
  mode makes ``accelerate launch`` append its whole environment, secrets included, to
  ``.deepspeed_env`` (accelerate#2839); use ``--launcher deepspeed`` for pdsh instead.
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from clusterkit.launchers.argv import (
    IGNORE_USR1,
    launcher_program,
    ranks_under_recorder,
    srun_env_words,
    uniform,
)
from clusterkit.launchers.base import Backend
from clusterkit.node.contract import JobDir, exits_dir
from clusterkit.spec.job import JobPlan, NodeCommand, launcher_log_dir

ACCELERATE = ("-m", "accelerate.commands.launch")
# accelerate on each Slurm node: its machine_rank's YAML, the head resolved at run time.
# The launcher ignores USR1 (argv.IGNORE_USR1): measured on a real Slurm 22.05, the
# default action killed it and --kill-on-bad-exit then killed the ranks mid-save.
# --tee 3: each rank's lines carry its rank label, which `clusterkit sbatch --watch`
# reads (accelerate's own --tee default, 0, overrides torchrun's).
# --log_dir (accelerate hands it to torchrun): without it torchrun makes
# /tmp/torchelastic_* on every node and never removes it, one leftover per node per run.
ACCELERATE_EXEC = (IGNORE_USR1 + 'd=$1; l=$2; shift 2; exec "$0" ' + " ".join(ACCELERATE)
                   + ' --tee 3 --log_dir="$l"'
                   + ' --config_file="$d/accelerate_config.rank$SLURM_NODEID.yaml"'
                   ' --main_process_ip="$MASTER_ADDR" --main_process_port="$MASTER_PORT" "$@"')


def accelerate_config_name(node_rank: int) -> str:
    return f"accelerate_config.rank{node_rank}.yaml"


def accelerate_config(plan: JobPlan, node_rank: int, ds_config_path: str) -> dict[str, Any]:
    """The config dict for ``machine_rank == node_rank``."""
    on_gpu = all(n.host.gpus > 0 for n in plan.nodes)
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE"}
    if plan.options.accelerate_use_deepspeed:
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {"deepspeed_config_file": ds_config_path,
                                      "deepspeed_multinode_launcher": "standard",
                                      "zero3_init_flag": False}
    else:
        config["distributed_type"] = "MULTI_GPU" if on_gpu else "MULTI_CPU"
        precision = plan.options.precision
        config["mixed_precision"] = {"bf16": "bf16", "fp16": "fp16"}.get(precision, "no")
    config.update({
        "machine_rank": node_rank,
        "num_machines": len(plan.nodes),
        "num_processes": plan.world_size,
        "main_process_ip": plan.master_addr,
        "main_process_port": plan.master_port,
        "rdzv_backend": "static",
        # same_network: torchrun gets --master-addr/--master-port (static rendezvous)
        # instead of a c10d endpoint; rank -> node stays fixed.
        "same_network": True,
        "main_training_function": "main",
        "gpu_ids": "all",
        "use_cpu": not on_gpu and not plan.options.accelerate_use_deepspeed,
        "debug": False,
        "enable_cpu_affinity": False,
    })
    return config


def render_accelerate_config(plan: JobPlan, node_rank: int, ds_config_path: str) -> str:
    header = (f"# accelerate config for machine_rank {node_rank} of job {plan.job_id} "
              "(rendered by clusterkit; edit the inventory, not this file)\n")
    body = yaml.safe_dump(accelerate_config(plan, node_rank, ds_config_path), sort_keys=False,
                          default_flow_style=False, allow_unicode=True)
    return header + body


def config_files(plan: JobPlan) -> dict[str, str]:
    """One YAML per node, read by that node's ``accelerate launch --config_file``."""
    return {accelerate_config_name(n.node_rank): render_accelerate_config(
        plan, n.node_rank, JobDir(n.job_dir).ds_config) for n in plan.nodes}


def accelerate_commands(plan: JobPlan, run_id: str | None) -> tuple[NodeCommand, ...]:
    """``accelerate launch --config_file`` per node, each with its machine_rank's YAML."""
    out = []
    for node in plan.nodes:
        # --tee 3: accelerate hands it to torchrun, whose "[default<r>]:" line prefix
        # names each rank (the node agent reads it as the rank label).
        argv = [node.python, *ACCELERATE, "--tee", "3",
                f"--log_dir={launcher_log_dir(node.job_dir, node.node_rank)}",
                f"--config_file={node.job_dir}/{accelerate_config_name(node.node_rank)}",
                *launcher_program(plan.programs[node.node_rank], "--module")]
        out.append(NodeCommand(label=f"accelerate node {node.node_rank}", host=node.name,
                               node_rank=node.node_rank, argv=tuple(argv), env=node.env,
                               cwd=node.workdir))
    return tuple(out)


def sbatch_line(plan: JobPlan, log_dir: str) -> tuple[str, str]:
    """sbatch.sh: srun starts one ``accelerate launch`` per node with its node's YAML."""
    uniform(plan, "srun")
    node = plan.nodes[0]
    argv = ["srun", f"--nodes={len(plan.nodes)}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            f"--chdir={node.workdir}", *srun_env_words(plan), "sh", "-c", ACCELERATE_EXEC,
            node.python, node.job_dir, log_dir,
            *ranks_under_recorder(plan, exits_dir(node.job_dir), "--no_python")]
    return "accelerate", shlex.join(argv)


BACKEND = Backend(
    "accelerate", "accelerate launch on every node", plan_backend="accelerate",
    command_sets=("accelerate",), sbatch_plan="accelerate",
    builders=(("accelerate", accelerate_commands),), sbatch_line=sbatch_line,
    files=config_files, gate_needs=("torch", "accelerate"), engine="accelerate")
