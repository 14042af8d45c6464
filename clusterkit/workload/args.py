"""Command line of ``python -m clusterkit.workload`` (no torch import)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from clusterkit.node.contract import ENV_DUMP_WEIGHTS, STORAGE_KINDS, StorageKind
from clusterkit.spec import job as spec_job
from clusterkit.spec import zero as spec
from clusterkit.workload.presets import PRESETS

# --dump-weights for the bundled workload under `clusterkit launch`, which has no flag
# for it (tests share one launched 7x2 run between launch and collect-ckpt checks).
DUMP_WEIGHTS_ENV = ENV_DUMP_WEIGHTS


@dataclass(frozen=True)
class WorkloadArgs:
    engine: str
    model: str
    steps: int
    micro_batch: int
    grad_accum: int
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    nvme_path: str | None
    precision: str
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    clip: float
    seed: int
    ds_config: str | None
    run_dir: str
    ckpt_dir: str | None
    storage: str
    save_every: int
    save_final: bool
    stop_after_steps: int
    resume: str
    save_16bit: bool
    eval_every: int
    eval_batches: int
    log_every: int
    dump_weights: str | None
    dump_loaded_weights: str | None
    dist_timeout: float
    peak_tflops: float | None
    local_rank: int | None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m clusterkit.workload", allow_abbrev=False,  # --save is not --save-every
        description="GPT training with DeepSpeed ZeRO (native or via accelerate): restartable "
                    "checkpoints on shared or node-local storage, preemption-safe.")
    g = p.add_argument_group("model and engine")
    g.add_argument("--engine", choices=("deepspeed", "accelerate"), default="deepspeed")
    g.add_argument("--model", choices=tuple(PRESETS), default=spec_job.DEFAULT_MODEL)
    g.add_argument("--steps", type=int, default=spec.DEFAULT_STEPS,
                   help=f"total optimizer steps (default {spec.DEFAULT_STEPS})")
    g.add_argument("--micro-batch", type=int, default=spec.DEFAULT_MICRO_BATCH,
                   help=f"sequences per rank per micro step (default {spec.DEFAULT_MICRO_BATCH})")
    g.add_argument("--grad-accum", type=int, default=1, help="micro steps per optimizer step")
    g.add_argument("--seed", type=int, default=1234)
    z = p.add_argument_group("ZeRO / precision (ignored with --ds-config)")
    z.add_argument("--zero-stage", type=int, choices=spec.ZERO_STAGES, default=spec.DEFAULT_ZERO_STAGE)
    z.add_argument("--offload-optimizer", choices=spec.OFFLOAD_CHOICES, default="none")
    z.add_argument("--offload-param", choices=spec.OFFLOAD_CHOICES, default="none")
    z.add_argument("--nvme-path", default=None)
    z.add_argument("--precision", choices=spec.PRECISION_AUTO_CHOICES, default="auto",
                   help="auto: bf16 on GPU, fp32 on CPU")
    z.add_argument("--lr", type=float, default=spec.DEFAULT_LR)
    z.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as lr fraction")
    z.add_argument("--warmup-steps", type=int, default=spec.DEFAULT_WARMUP_STEPS)
    z.add_argument("--weight-decay", type=float, default=0.1)
    z.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (0: off)")
    z.add_argument("--ds-config", default=None,
                   help="use this ds_config JSON as is instead of building one from flags")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--run-dir", default="clusterkit-run", help="logs and monitor CSVs")
    c.add_argument("--ckpt-dir", default=None,
                   help="checkpoint root (default RUN_DIR/checkpoints); {node} and {host} "
                        "expand to the node index and host name")
    c.add_argument("--storage", choices=STORAGE_KINDS, default=StorageKind.SHARED.value)
    c.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: off)")
    c.add_argument("--no-final-save", dest="save_final", action="store_false",
                   help="skip the checkpoint at the end (benchmarks)")
    c.add_argument("--stop-after-steps", type=int, default=0, metavar="N",
                   help="run at most N steps in this invocation, save and exit 0 (time-boxed "
                        "jobs; the schedule still spans --steps)")
    c.add_argument("--resume", default="auto", metavar="auto|never|TAG",
                   help="auto: newest complete checkpoint, if any (default)")
    c.add_argument("--save-16bit", action="store_true",
                   help="ZeRO-3: also save consolidated 16-bit weights with the final checkpoint")
    c.add_argument("--dump-weights", default=os.environ.get(DUMP_WEIGHTS_ENV) or None,
                   metavar="PATH",
                   help="rank 0 writes the full fp32 state dict here after training "
                        f"(default: ${DUMP_WEIGHTS_ENV}, e.g. from `launch --set-env`)")
    c.add_argument("--dump-loaded-weights", default=None, metavar="PATH",
                   help="rank 0 writes the full fp32 state dict here right after a checkpoint "
                        "was loaded (checks a resume, e.g. on fewer ranks, against the "
                        "consolidated checkpoint)")
    o = p.add_argument_group("evaluation, logging, distributed")
    o.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: off)")
    o.add_argument("--eval-batches", type=int, default=2)
    o.add_argument("--log-every", type=int, default=10)
    o.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds before a stuck collective fails the run")
    o.add_argument("--peak-tflops", type=float, default=None,
                   help="per-GPU peak for MFU (default: looked up from the GPU name)")
    # DeepSpeed's launcher passes --local_rank=N; accept both spellings.
    o.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help=argparse.SUPPRESS)
    return p


def _positive(parser: argparse.ArgumentParser, name: str, value: int, minimum: int) -> None:
    if value < minimum:
        parser.error(f"{name} must be >= {minimum}, got {value}")


def parse_args(argv: Sequence[str] | None = None) -> WorkloadArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    for name, minimum in (("steps", 1), ("micro_batch", 1), ("grad_accum", 1),
                          ("save_every", 0), ("stop_after_steps", 0), ("eval_every", 0),
                          ("eval_batches", 1), ("log_every", 1), ("warmup_steps", 1)):
        _positive(parser, "--" + name.replace("_", "-"), getattr(ns, name), minimum)
    if ns.save_16bit and ns.zero_stage != 3 and ns.ds_config is None:
        parser.error("--save-16bit needs --zero-stage 3")
    return WorkloadArgs(**vars(ns))
