"""Pure builder for DeepSpeed ``ds_config`` dicts.

A :class:`ZeroSpec` (frozen, validated on construction) goes in, a plain JSON-able
dict comes out. No I/O, no environment probing: facts such as the world size or
whether a GPU is present are inputs, so the same spec renders the same config on a
laptop, in a test and on the cluster head node.

Keys follow DeepSpeed 0.19 (``deepspeed/runtime/config.py``, ``zero/config.py``,
``monitor/config.py``, ``runtime/lr_schedules.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from clusterkit.errors import RenderError

Offload = Literal["none", "cpu", "nvme"]
Precision = Literal["fp32", "bf16", "fp16"]

OFFLOAD_CHOICES: tuple[str, ...] = ("none", "cpu", "nvme")
PRECISION_CHOICES: tuple[str, ...] = ("fp32", "bf16", "fp16")
PRECISION_AUTO_CHOICES: tuple[str, ...] = ("auto", *PRECISION_CHOICES)
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
# The job defaults every verb and the bundled workload share (spec.job.JobOptions).
DEFAULT_ZERO_STAGE = 2
DEFAULT_STEPS = 100
DEFAULT_MICRO_BATCH = 1
DEFAULT_LR = 1e-3
DEFAULT_WARMUP_STEPS = 10


def resolve_precision(requested: str, on_gpu: bool, cpu_ranks: str = "this job's ranks"
                      ) -> Precision:
    """The one precision rule: ``auto`` is bf16 when every rank has a GPU, else fp32
    (DeepSpeed's CPU path trains bf16, but slowly and without gain); an explicit choice
    stands wherever it can run.

    fp16 needs a GPU: DeepSpeed's CPU accelerator supports fp32 and bf16 only
    (``supported_dtypes()``), so an explicit fp16 for ranks without a GPU is refused
    (``cpu_ranks`` names them). It used to reach ds_config.json while the ranks trained
    fp32 and the summary said fp32, without a word (issue 25). An explicit bf16 on CPU
    ranks stands: it really trains bf16 there (ZeRO 0, 2 and 3 measured, docs/workload.md)."""
    if requested == "auto":
        return "bf16" if on_gpu else "fp32"
    if requested not in PRECISION_CHOICES:
        raise RenderError(f"--precision must be one of {', '.join(PRECISION_AUTO_CHOICES)}, "
                          f"got {requested!r}", key="--precision")
    if requested == "fp16" and not on_gpu:
        raise RenderError(f"fp16 needs a GPU for every rank, but {cpu_ranks} run on the CPU, "
                          "which trains fp32 or bf16 only", key="--precision",
                          hint="use --precision auto (fp32 on CPU ranks, bf16 on GPUs), bf16 or "
                               "fp32; if the nodes have GPUs, say so with gpus: N in the inventory")
    return requested  # type: ignore[return-value]


@dataclass(frozen=True)
class ZeroSpec:
    """Everything that decides a ds_config. ``world_size`` is the data-parallel size."""

    stage: int = DEFAULT_ZERO_STAGE
    offload_optimizer: Offload = "none"
    offload_param: Offload = "none"
    nvme_path: str | None = None
    precision: Precision = "bf16"
    micro_batch: int = DEFAULT_MICRO_BATCH
    grad_accum: int = 1
    world_size: int = 1
    clip: float = 1.0
    # Optimizer (AdamW) and WarmupCosineLR schedule.
    lr: float = DEFAULT_LR
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    total_steps: int = DEFAULT_STEPS
    warmup_min_ratio: float = 0.0
    cos_min_ratio: float = 0.1
    # torch.optim.AdamW instead of FusedAdam: needed where FusedAdam cannot build (CPU).
    # Ignored with optimizer offload, where DeepSpeed always uses DeepSpeedCPUAdam.
    torch_adam: bool = False
    node_local_checkpoints: bool = False
    gather_16bit_on_save: bool = False
    csv_monitor_dir: str | None = None
    tensorboard_dir: str | None = None
    monitor_job_name: str = "clusterkit"
    steps_per_print: int = 1_000_000  # DeepSpeed's own chatty log; the workload prints its own
    wall_clock_breakdown: bool = False

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def train_batch_size(self) -> int:
        """Global batch: micro batch x accumulation steps x data-parallel world size."""
        return self.micro_batch * self.grad_accum * self.world_size


def _fail(key: str, message: str, hint: str | None = None) -> RenderError:
    return RenderError(message, key=key, hint=hint)


def _validate(spec: ZeroSpec) -> None:
    if spec.stage not in ZERO_STAGES:
        raise _fail("stage", f"ZeRO stage must be one of 0-3, got {spec.stage}")
    for key, value in (("offload_optimizer", spec.offload_optimizer),
                       ("offload_param", spec.offload_param)):
        if value not in OFFLOAD_CHOICES:
            raise _fail(key, f"must be one of {', '.join(OFFLOAD_CHOICES)}, got {value!r}")
    if spec.precision not in PRECISION_CHOICES:
        raise _fail("precision", f"must be one of {', '.join(PRECISION_CHOICES)}, "
                                 f"got {spec.precision!r}")
    if spec.offload_optimizer != "none" and spec.stage == 0:
        raise _fail("offload_optimizer", "optimizer offload needs ZeRO stage 1, 2 or 3")
    if spec.offload_param != "none" and spec.stage != 3:
        raise _fail("offload_param", "parameter offload needs ZeRO stage 3",
                    hint="use --zero-stage 3 or drop --offload-param")
    if spec.offload_optimizer == "nvme" and spec.stage != 3:
        raise _fail("offload_optimizer", "NVMe optimizer offload needs ZeRO stage 3")
    uses_nvme = "nvme" in (spec.offload_optimizer, spec.offload_param)
    if uses_nvme and not spec.nvme_path:
        raise _fail("nvme_path", "NVMe offload needs a path on a local NVMe file system")
    if spec.gather_16bit_on_save and spec.stage != 3:
        raise _fail("gather_16bit_on_save", "consolidated 16-bit save only applies to ZeRO-3")
    for name, count in (("micro_batch", spec.micro_batch), ("grad_accum", spec.grad_accum),
                        ("world_size", spec.world_size), ("total_steps", spec.total_steps)):
        if count < 1:
            raise _fail(name, f"must be >= 1, got {count}")
    if spec.warmup_steps < 1:
        # DeepSpeed's WarmupCosineLR rejects warmup_num_steps <= 0.
        raise _fail("warmup_steps", f"must be >= 1, got {spec.warmup_steps}")
    if spec.clip < 0:
        raise _fail("clip", f"must be >= 0 (0 disables clipping), got {spec.clip}")
    if spec.lr <= 0:
        raise _fail("lr", f"must be > 0, got {spec.lr}")


def _offload_block(device: Offload, nvme_path: str | None) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device}
    if device == "cpu":
        block["pin_memory"] = True
    if device == "nvme":
        block["nvme_path"] = nvme_path
        block["pin_memory"] = True
    return block


def _zero_block(spec: ZeroSpec) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": spec.stage}
    if spec.stage == 0:
        return zero
    zero["contiguous_gradients"] = True
    zero["overlap_comm"] = spec.stage >= 2
    if spec.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_block(spec.offload_optimizer, spec.nvme_path)
    if spec.stage == 3:
        if spec.offload_param != "none":
            zero["offload_param"] = _offload_block(spec.offload_param, spec.nvme_path)
        zero["stage3_gather_16bit_weights_on_model_save"] = spec.gather_16bit_on_save
    return zero


def _precision_blocks(precision: Precision) -> dict[str, Any]:
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        # Dynamic loss scaling (loss_scale 0), DeepSpeed's recommended default.
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                         "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
    return {}


def _monitor_blocks(spec: ZeroSpec) -> dict[str, Any]:
    blocks: dict[str, Any] = {}
    if spec.csv_monitor_dir is not None:
        blocks["csv_monitor"] = {"enabled": True, "output_path": spec.csv_monitor_dir,
                                 "job_name": spec.monitor_job_name}
    if spec.tensorboard_dir is not None:
        blocks["tensorboard"] = {"enabled": True, "output_path": spec.tensorboard_dir,
                                 "job_name": spec.monitor_job_name}
    return blocks


def _optimizer_block(spec: ZeroSpec) -> dict[str, Any]:
    params: dict[str, Any] = {"lr": spec.lr, "betas": list(spec.betas), "eps": spec.eps,
                              "weight_decay": spec.weight_decay}
    if spec.torch_adam and spec.offload_optimizer == "none":
        params["torch_adam"] = True
    return {"type": "AdamW", "params": params}


def _scheduler_block(spec: ZeroSpec) -> dict[str, Any]:
    return {"type": "WarmupCosineLR",
            "params": {"total_num_steps": spec.total_steps,
                       "warmup_num_steps": spec.warmup_steps,
                       "warmup_min_ratio": spec.warmup_min_ratio,
                       "cos_min_ratio": spec.cos_min_ratio,
                       "warmup_type": "linear"}}


def build_ds_config(spec: ZeroSpec) -> dict[str, Any]:
    """Render ``spec`` as a DeepSpeed config dict (a fresh object on every call)."""
    config: dict[str, Any] = {
        "train_batch_size": spec.train_batch_size,
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.grad_accum,
        "gradient_clipping": spec.clip,
        "steps_per_print": spec.steps_per_print,
        "wall_clock_breakdown": spec.wall_clock_breakdown,
        "optimizer": _optimizer_block(spec),
        "scheduler": _scheduler_block(spec),
        "zero_optimization": _zero_block(spec),
        # Tags are chosen by rank 0 and broadcast; a mismatch is a bug, so fail loudly.
        "checkpoint": {"tag_validation": "FAIL",
                       "use_node_local_storage": spec.node_local_checkpoints},
    }
    config.update(_precision_blocks(spec.precision))
    config.update(_monitor_blocks(spec))
    return config
