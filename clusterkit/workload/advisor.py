"""Memory advisor: which ZeRO strategy fits a preset model on a given cluster?

Model-state memory (params, grads, optimizer states; activations NOT included) per
GPU and per node CPU RAM, for each strategy in speed order
DDP > ZeRO-1 > ZeRO-2 > ZeRO-2+offload > ZeRO-3 > ZeRO-3+offload. ZeRO-2/3 numbers
come from DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs`` /
``estimate_zero3_model_states_mem_needs``, the functions behind the documented
``*_all_cold`` helpers, which only print). DDP and ZeRO-1 have no DeepSpeed
estimator; they use the same byte accounting DeepSpeed documents for ZeRO-2 (per
param: 2 bf16 params + 2 bf16 grads + 4 fp32 grads + 4 fp32 master + 8 Adam moments):
DDP keeps all 20 bytes on every GPU, ZeRO-1 partitions the 16 fp32 bytes.

A strategy "fits" when its model states use at most ``gpu_fraction`` of GPU memory
(the rest is left for activations, buffers and fragmentation) and, if the node's
RAM is given, its CPU estimate fits in RAM.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

from clusterkit.errors import ClusterkitError
from clusterkit.units import parse_size
from clusterkit.workload.presets import ModelPreset, get_preset

DEFAULT_GPU_FRACTION = 0.75
BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor default

def parse_bytes(text: str, key: str = "memory") -> int:
    """'80GiB' = '80G', '81920MiB', '1.5TB' -> bytes, by the one size rule (docs/units.md)."""
    return parse_size(text, key)


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class StrategyEstimate:
    name: str
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    gpu_bytes: int  # per GPU, model states only
    cpu_bytes_per_node: int
    fits_gpu: bool
    fits_cpu: bool

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_cpu


@dataclass(frozen=True)
class Advice:
    model: str
    n_params: int
    nodes: int
    gpus_per_node: int
    gpu_mem_bytes: int
    cpu_mem_bytes_per_node: int | None
    gpu_fraction: float
    estimates: tuple[StrategyEstimate, ...]  # fastest first
    recommended: StrategyEstimate | None


def _raw_estimates(preset: ModelPreset, nodes: int, gpus_per_node: int
                   ) -> list[tuple[str, int, str, str, int, int]]:
    # DeepSpeed's logger writes to the stdout it finds at import ("Setting accelerator to
    # CPU" on a machine without GPUs), which would break `clusterkit plan --json | jq`;
    # bound to stderr here, it stays there for this process.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n = preset.n_params
    total_gpus = nodes * gpus_per_node
    load_cpu = int(n * 4 * gpus_per_node * BUFFER_FACTOR)  # every local rank builds the model
    rows = [("DDP", 0, "none", "none", 20 * n, load_cpu),
            ("ZeRO-1", 1, "none", "none", 4 * n + int(16 * n / total_gpus), load_cpu)]
    for name, offload in (("ZeRO-2", False), ("ZeRO-2+offload", True)):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params=n, num_gpus_per_node=gpus_per_node, num_nodes=nodes,
            cpu_offload=offload, additional_buffer_factor=BUFFER_FACTOR)
        rows.append((name, 2, "cpu" if offload else "none", "none", int(gpu), int(cpu)))
    for name, offload in (("ZeRO-3", False), ("ZeRO-3+offload", True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total_params=n, largest_layer_params=preset.largest_layer_params,
            num_gpus_per_node=gpus_per_node, num_nodes=nodes, cpu_offload=offload,
            cpu_offload_params=offload, zero_init=True, additional_buffer_factor=BUFFER_FACTOR)
        rows.append((name, 3, "cpu" if offload else "none", "cpu" if offload else "none",
                     int(gpu), int(cpu)))
    return rows


def advise(model: str | ModelPreset, *, nodes: int, gpus_per_node: int, gpu_mem_bytes: int,
           cpu_mem_bytes_per_node: int | None = None,
           gpu_fraction: float = DEFAULT_GPU_FRACTION) -> Advice:
    preset = get_preset(model) if isinstance(model, str) else model
    if nodes < 1 or gpus_per_node < 1:
        raise ClusterkitError("nodes and GPUs per node must be >= 1", key="nodes")
    if gpu_mem_bytes <= 0 or not 0 < gpu_fraction <= 1:
        raise ClusterkitError("GPU memory must be > 0 and the usable fraction in (0, 1]",
                              key="gpu_mem")
    budget = gpu_mem_bytes * gpu_fraction
    estimates = tuple(
        StrategyEstimate(name=name, zero_stage=stage, offload_optimizer=opt, offload_param=par,
                         gpu_bytes=gpu, cpu_bytes_per_node=cpu, fits_gpu=gpu <= budget,
                         fits_cpu=cpu_mem_bytes_per_node is None or cpu <= cpu_mem_bytes_per_node)
        for name, stage, opt, par, gpu, cpu in _raw_estimates(preset, nodes, gpus_per_node))
    recommended = next((e for e in estimates if e.fits), None)
    return Advice(model=preset.name, n_params=preset.n_params, nodes=nodes,
                  gpus_per_node=gpus_per_node, gpu_mem_bytes=gpu_mem_bytes,
                  cpu_mem_bytes_per_node=cpu_mem_bytes_per_node, gpu_fraction=gpu_fraction,
                  estimates=estimates, recommended=recommended)


def format_table(advice: Advice) -> str:
    """Plain-text table (also fine inside rich output)."""
    cpu_note = (format_bytes(advice.cpu_mem_bytes_per_node)
                if advice.cpu_mem_bytes_per_node is not None else "not checked")
    lines = [
        f"model {advice.model} ({advice.n_params / 1e6:.0f}M params) on {advice.nodes} node(s) x "
        f"{advice.gpus_per_node} GPU(s), {format_bytes(advice.gpu_mem_bytes)} per GPU "
        f"(model states may use {advice.gpu_fraction:.0%}), CPU RAM per node: {cpu_note}",
        f"{'strategy':<16} {'per GPU':>12} {'CPU per node':>14}  fits",
    ]
    for e in advice.estimates:
        mark = "yes" if e.fits else ("no (GPU)" if not e.fits_gpu else "no (CPU)")
        star = "  <- recommended" if e is advice.recommended else ""
        lines.append(f"{e.name:<16} {format_bytes(e.gpu_bytes):>12} "
                     f"{format_bytes(e.cpu_bytes_per_node):>14}  {mark}{star}")
    if advice.recommended is None:
        lines.append("nothing fits: add nodes/GPUs, use NVMe offload, or a smaller model")
    lines.append("activations are not included; they grow with micro batch x sequence length")
    return "\n".join(lines)
