"""The user-script contract: what every rank of a job finds in its environment (pure).

Whatever the backend (native agent, torchrun, DeepSpeed over pdsh, accelerate,
Slurm), a user's own program gets these besides the standard torch variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
The names are fixed: docs/launch.md "Your own training script" documents them.
``CLUSTERKIT_HEARTBEAT`` belongs to the watchdog (docs/launch.md) and is set there.
"""

from __future__ import annotations

from dataclasses import dataclass

ENV_JOB_ID = "CLUSTERKIT_JOB_ID"
ENV_JOB_DIR = "CLUSTERKIT_JOB_DIR"
ENV_DS_CONFIG = "CLUSTERKIT_DS_CONFIG"
ENV_CKPT_DIR = "CLUSTERKIT_CKPT_DIR"
ENV_STORAGE = "CLUSTERKIT_STORAGE"
CONTRACT_NAMES: tuple[str, ...] = (ENV_JOB_ID, ENV_JOB_DIR, ENV_DS_CONFIG, ENV_CKPT_DIR,
                                   ENV_STORAGE)
DS_CONFIG_FILE = "ds_config.json"  # written into every node's job dir
# DeepSpeed's own convention (deepspeed.add_config_arguments): the script reads its config
# path from this argument. `--deepspeed-config-arg` appends it to the script's arguments.
DEEPSPEED_CONFIG_ARG = "--deepspeed_config"
STORAGE_KINDS: tuple[str, ...] = ("shared", "node-local")
# Rank 0 of the bundled workload ends with this line + one JSON object; the launcher
# reads it from the rank lines, prints it once and saves it (docs/launch.md).
SUMMARY_PREFIX = "CLUSTERKIT_SUMMARY "
# ... and writes the same object to <run dir>/summary.json (atomic): what a reader that
# sees only a console stream cut into pieces (srun --label, torchrun's tee) reads instead.
SUMMARY_FILE = "summary.json"
RUN_SUBDIR = "run"  # <job dir>/run: the bundled workload's --run-dir (monitor, summary)
LOG_SUBDIR = "logs"  # <job dir>/logs: where the sbatch template's --output/--error point
# <job dir>/exits: under sbatch each rank that exits non-zero records how (argv.RANK_RUN);
# the batch script names the first one as the step's cause.
EXITS_SUBDIR = "exits"
# sbatch: the file that appears when the job is asked to stop (time limit, preemption,
# `clusterkit sbatch cancel JOB --signal USR1 --batch`); the ranks also get SIGUSR1.
# A rank that follows the contract saves into $CLUSTERKIT_CKPT_DIR and exits 0
# (docs/sbatch.md, "Preemption: what your script must do").
ENV_STOP_FILE = "CLUSTERKIT_STOP_FILE"
STOP_FILE = "stop"  # <job dir>/stop


def exits_dir(job_dir: str) -> str:
    return f"{job_dir}/{EXITS_SUBDIR}"


@dataclass(frozen=True)
class Contract:
    """One node's view of the job, as its ranks see it."""

    job_id: str
    job_dir: str  # this node's job dir (absolute)
    ckpt_dir: str  # this job's checkpoint dir on this node (absolute)
    storage: str  # "shared" or "node-local"

    @property
    def ds_config(self) -> str:
        return f"{self.job_dir}/{DS_CONFIG_FILE}"

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
