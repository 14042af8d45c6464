"""The user-script contract: what every rank of a job finds in its environment (pure).

Whatever the backend (native agent, torchrun, DeepSpeed over pdsh, accelerate,
Slurm), a user's own program gets these besides the standard torch variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
The names are fixed: docs/launch.md "Your own training script" documents them; they
are spelled once, in :mod:`clusterkit.node.contract` (with the job-dir layout,
``JobDir``), and re-exported here for the layers above the node code.
"""

from __future__ import annotations

from dataclasses import dataclass

# The names themselves live in the node contract (standard library, shipped to nodes);
# the layers above the node code import them from here or from there, never spell them.
from clusterkit.node.contract import (
    CONTRACT_NAMES,
    ENV_CKPT_DIR,
    ENV_DS_CONFIG,
    ENV_JOB_DIR,
    ENV_JOB_ID,
    ENV_STOP_FILE,
    ENV_STORAGE,
    SUMMARY_PREFIX,
    JobDir,
    exits_dir,
)

__all__ = ["CONTRACT_NAMES", "DEEPSPEED_CONFIG_ARG", "DS_CONFIG_FILE", "ENV_CKPT_DIR",
           "ENV_DS_CONFIG", "ENV_JOB_DIR", "ENV_JOB_ID", "ENV_STOP_FILE", "ENV_STORAGE",
           "EXITS_SUBDIR", "LOG_SUBDIR", "RUN_SUBDIR", "STOP_FILE", "STORAGE_KINDS",
           "SUMMARY_FILE", "SUMMARY_PREFIX", "Contract", "JobDir", "exits_dir"]

DS_CONFIG_FILE = JobDir.DS_CONFIG
# DeepSpeed's own convention (deepspeed.add_config_arguments): the script reads its config
# path from this argument. `--deepspeed-config-arg` appends it to the script's arguments.
DEEPSPEED_CONFIG_ARG = "--deepspeed_config"
STORAGE_KINDS: tuple[str, ...] = ("shared", "node-local")
# The job-dir names callers above the node code use (JobDir is the layout).
SUMMARY_FILE, RUN_SUBDIR, LOG_SUBDIR = JobDir.SUMMARY, JobDir.RUN, JobDir.LOGS
EXITS_SUBDIR, STOP_FILE = JobDir.EXITS, JobDir.STOP


@dataclass(frozen=True)
class Contract:
    """One node's view of the job, as its ranks see it."""

    job_id: str
    job_dir: str  # this node's job dir (absolute)
    ckpt_dir: str  # this job's checkpoint dir on this node (absolute)
    storage: str  # "shared" or "node-local"

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
