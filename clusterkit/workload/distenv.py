"""Which rank am I? Resolved from the launcher's environment (pure function).

torchrun, DeepSpeed's launcher and ``accelerate launch`` export RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Under a plain ``srun`` only SLURM_PROCID /
SLURM_LOCALID / SLURM_NTASKS exist; the sbatch script must export MASTER_ADDR and
MASTER_PORT. The node index comes from the launcher where it says so (torchrun's
GROUP_RANK, DeepSpeed's CROSS_RANK, SLURM_NODEID) — that is what lets two fake
"nodes" share one machine in tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from clusterkit.errors import LaunchError

NODE_INDEX_VARS = ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID", "NODE_RANK")
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    node_index: int | None  # None: derive from host names after init
    source: str  # "torch" | "slurm" | "single"

    def exports(self) -> dict[str, str]:
        """The variables torch.distributed's env:// rendezvous reads."""
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank),
                "WORLD_SIZE": str(self.world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise LaunchError(f"environment variable is not an integer: {env[key]!r}", key=key) from None


def _node_index(env: Mapping[str, str]) -> int | None:
    for key in NODE_INDEX_VARS:
        if env.get(key, "").strip().isdigit():
            return int(env[key])
    return None


def resolve_dist_env(env: Mapping[str, str], cli_local_rank: int | None = None) -> DistEnv:
    """Read the rank layout from ``env``; ``cli_local_rank`` is ``--local_rank``."""
    if "RANK" in env and "WORLD_SIZE" in env:
        source = "torch"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else (cli_local_rank or 0)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        source = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    else:
        source = "single"
        rank, world, local = 0, 1, cli_local_rank or 0
    if not 0 <= rank < world:
        raise LaunchError(f"rank {rank} is outside world size {world}", key="RANK")
    addr = env.get("MASTER_ADDR", "")
    port_raw = env.get("MASTER_PORT", "")
    if world > 1 and (not addr or not port_raw):
        raise LaunchError("MASTER_ADDR and MASTER_PORT must be set for a multi-rank run",
                          key="MASTER_ADDR",
                          hint="under plain srun, export them in the sbatch script "
                               "(e.g. the first host of $SLURM_JOB_NODELIST)")
    port = int(port_raw) if port_raw.isdigit() else 29500
    return DistEnv(rank=rank, local_rank=local, world_size=world,
                   master_addr=addr or "127.0.0.1", master_port=port,
                   node_index=_node_index(env), source=source)
