"""accelerate config YAML, one per machine_rank (pure).

Keys and checks follow accelerate 1.x (``commands/config/config_args.py``
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

from typing import Any

import yaml

from clusterkit.render.commands import JobLayout


def accelerate_config(layout: JobLayout, node_rank: int, ds_config_path: str) -> dict[str, Any]:
    """The config dict for ``machine_rank == node_rank``."""
    on_gpu = all(n.host.gpus > 0 for n in layout.nodes)
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE"}
    if layout.options.accelerate_use_deepspeed:
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {"deepspeed_config_file": ds_config_path,
                                      "deepspeed_multinode_launcher": "standard",
                                      "zero3_init_flag": False}
    else:
        config["distributed_type"] = "MULTI_GPU" if on_gpu else "MULTI_CPU"
        precision = layout.options.precision
        config["mixed_precision"] = {"bf16": "bf16", "fp16": "fp16"}.get(precision, "no")
    config.update({
        "machine_rank": node_rank,
        "num_machines": len(layout.nodes),
        "num_processes": layout.world_size,
        "main_process_ip": layout.master_addr,
        "main_process_port": layout.master_port,
        "rdzv_backend": "static",
        # same_network: torchrun gets --master-addr/--master-port (static rendezvous)
        # instead of a c10d endpoint; rank -> node stays fixed.
        "same_network": True,
        "main_training_function": "main",
        "gpu_ids": "all",
        "use_cpu": not on_gpu and not layout.options.accelerate_use_deepspeed,
        "debug": False,
        "enable_cpu_affinity": False,
    })
    return config


def render_accelerate_config(layout: JobLayout, node_rank: int, ds_config_path: str) -> str:
    header = (f"# accelerate config for machine_rank {node_rank} of job {layout.job_id} "
              "(rendered by clusterkit; edit the inventory, not this file)\n")
    body = yaml.safe_dump(accelerate_config(layout, node_rank, ds_config_path), sort_keys=False,
                          default_flow_style=False, allow_unicode=True)
    return header + body
