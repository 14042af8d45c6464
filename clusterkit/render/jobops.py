"""The DeepSpeed ops a job's ranks JIT-build at start, per node: one rule for both starts.

``clusterkit launch`` builds them before its agents start the ranks
(launch/gate.ready_job_ops); the batch script of ``clusterkit sbatch`` builds them in a
step of its own before the launch step (render/sbatch.py, docs/sbatch.md, "JIT ops").
"""

from __future__ import annotations

from clusterkit.launchers import BACKENDS
from clusterkit.node.provision.jitops import ops_for_config
from clusterkit.spec.job import JobPlan, NodePlan


def accelerator(node: NodePlan) -> str:
    """DeepSpeed's accelerator on the node: DS_ACCELERATOR, else cuda with GPUs, else cpu."""
    return node.env.get("DS_ACCELERATOR") or ("cuda" if node.host.gpus > 0 else "cpu")


def job_ops(plan: JobPlan) -> dict[str, list[str]]:
    """Node -> the op builders its ranks JIT-build at start (node/provision/jitops.ops_for_config of
    the job's ds_config on the node's accelerator); empty when the job runs no DeepSpeed
    that clusterkit knows of (a user's script under torchrun without
    --deepspeed-config-arg: its ranks build what they need, and the watchdogs wait for
    a build they see running)."""
    o = plan.options
    imports = BACKENDS[plan.backend].gate_needs  # the packages every rank imports
    if not (o.uses_workload or o.deepspeed_config_arg or "deepspeed" in imports):
        return {}
    return {n.name: ops_for_config(dict(plan.ds_config), accelerator(n)) for n in plan.nodes}
