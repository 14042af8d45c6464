"""The environment of the job's processes on one node.

Part of the node agent (:mod:`clusterkit.node.agent.core`; node program ``agent.core``, whose
module list in :mod:`clusterkit.ship` names this file). The launcher's (or a
rank's) environment is the agent's own plus the job's env values, the job tags that
make the teardown job-scoped (``CLUSTERKIT_JOB_ID``, node, attempt), the progress
directory and an OpenMP thread count; a native rank gets what torchrun would give it.
Its own module because the exec'd ranks and the fork server's ranks must get the
same environment from one rule.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import os

from clusterkit.node.agent.files import expand
from clusterkit.node.contract import (
    ENV_ATTEMPT,
    ENV_HEARTBEAT,
    ENV_HEARTBEAT_DIR,
    ENV_NODE,
    ENV_STACKS,
    HEARTBEAT_SUFFIX,
    STACKS_SUFFIX,
    progress_file,
)
from clusterkit.node.contract import ENV_JOB_ID as ENV_JOB
from clusterkit.node.protocol import AgentSpec


def omp_threads(nproc: int) -> str:
    """OpenMP threads per rank: the CPUs this node lets us run on / its ranks, at least 1.

    (Issue 13: ranks that start a thread per core each oversubscribe the node; torchrun's
    fixed 1 wastes the cores of a node with fewer ranks than CPUs.) Same rule as the
    batch script's (docs/sbatch.md)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return str(max(1, cpus // max(1, nproc)))


def child_env(spec: AgentSpec, job_dir: str, progress_dir: str) -> dict[str, str]:
    """The launcher's environment (and the base of every rank's)."""
    env = dict(os.environ)
    env.update({k: expand(v, job_dir) for k, v in spec.env.items()})
    env.update({ENV_JOB: spec.job_id, ENV_NODE: spec.node,
                ENV_ATTEMPT: str(spec.attempt), ENV_HEARTBEAT_DIR: progress_dir})
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines, not 8 KiB blocks, reach the console
    if spec.local_ranks > 0 and "OMP_NUM_THREADS" not in env:
        # torchrun and accelerate keep a value they find (their own default is a fixed 1
        # for several ranks); an inventory env value wins over ours.
        env["OMP_NUM_THREADS"] = omp_threads(spec.local_ranks)
    return env


def rank_env(spec: AgentSpec, job_dir: str, progress_dir: str, local_rank: int) -> dict[str, str]:
    """What torchrun gives a worker, minus its TORCHELASTIC_* agent variables."""
    n = spec.native or {}
    env = child_env(spec, job_dir, progress_dir)
    nproc = int(n["nproc"])
    env.update({
        "RANK": str(int(n["first_rank"]) + local_rank), "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(n["world_size"]), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(n["node_rank"]), "GROUP_WORLD_SIZE": str(n["nnodes"]),
        "ROLE_RANK": str(int(n["first_rank"]) + local_rank), "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(n["world_size"]), "MASTER_ADDR": str(n["master_addr"]),
        "MASTER_PORT": str(n["master_port"]),
    })
    rank = int(n["first_rank"]) + local_rank
    env[ENV_HEARTBEAT] = progress_file(progress_dir, rank, HEARTBEAT_SUFFIX)
    env[ENV_STACKS] = progress_file(progress_dir, rank, STACKS_SUFFIX)
    if "OMP_NUM_THREADS" not in env:  # an inventory env value wins
        env["OMP_NUM_THREADS"] = omp_threads(nproc)
    return env
