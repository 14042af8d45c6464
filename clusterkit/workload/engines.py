"""The two ways to drive DeepSpeed: natively, or through accelerate's DeepSpeed plugin.

Both adapters own a real ``DeepSpeedEngine`` built from the same ds_config (optimizer
and WarmupCosineLR scheduler included, so DeepSpeed checkpoints them), and expose the
small surface the training loop needs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from clusterkit.errors import CheckpointError
from clusterkit.node.contract import ACCELERATE_DS_SUBDIR
from clusterkit.workload.data import Batch
from clusterkit.workload.model import GPT, param_groups


class TrainEngine(Protocol):
    ds_subdir: str  # where DeepSpeed's files sit inside <ckpt_dir>/<tag>

    @property
    def global_steps(self) -> int: ...

    @property
    def global_samples(self) -> int: ...

    def train_step(self, micro_batches: Sequence[Batch]) -> torch.Tensor: ...

    def eval_loss(self, batch: Batch) -> torch.Tensor: ...

    def lr(self) -> float: ...

    def save(self, ckpt_dir: str, tag: str, client: dict[str, Any]) -> None: ...

    def load(self, ckpt_dir: str, tag: str) -> None: ...

    def save_16bit(self, directory: str, filename: str) -> bool: ...

    def full_fp32_state_dict(self) -> dict[str, torch.Tensor]: ...

    def monitor_events(self, events: list[tuple[str, float, int]]) -> None: ...


def _monitor_events(ds_engine: Any, events: list[tuple[str, float, int]]) -> None:
    """Write (name, value, global_samples) into DeepSpeed's own monitors (CSV/TensorBoard
    from the ds_config). DeepSpeed 0.19 logs only the lr there; loss comes from us."""
    monitor = getattr(ds_engine, "monitor", None)
    if monitor is not None and monitor.enabled:
        monitor.write_events(events)


def _full_fp32_state_dict(ds_engine: Any) -> dict[str, torch.Tensor]:
    """Collective: every rank must call it. fp32 master weights, assembled by the
    engine itself (ZeRO-3 gathers partitions; ZeRO 1/2 all-reduce the hp fragments)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out: dict[str, torch.Tensor] = {}
    for name, param in ds_engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        if full is None:  # ZeRO-0 fp32: the module parameter is the master weight
            full = param.detach()
        out[name] = full.detach().float().cpu().clone()
    return out


class DeepSpeedAdapter:
    ds_subdir = ""

    def __init__(self, model: GPT, ds_config: dict[str, Any], weight_decay: float) -> None:
        import deepspeed

        groups = param_groups(model, weight_decay)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                               config=ds_config)
        self.engine: Any = engine

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    @property
    def global_samples(self) -> int:
        return int(self.engine.global_samples)

    def train_step(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.engine.device)
        for batch in micro_batches:
            loss = self.engine(batch.inputs.to(self.engine.device),
                               batch.targets.to(self.engine.device))
            self.engine.backward(loss)
            self.engine.step()  # a no-op until the accumulation boundary
            total += loss.detach().float()
        return total / len(micro_batches)

    def eval_loss(self, batch: Batch) -> torch.Tensor:
        dev = self.engine.device
        return self.engine(batch.inputs.to(dev), batch.targets.to(dev)).detach().float()  # type: ignore[no-any-return]

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, ckpt_dir: str, tag: str, client: dict[str, Any]) -> None:
        self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"clusterkit": client})

    def load(self, ckpt_dir: str, tag: str) -> None:
        load_path, _ = self.engine.load_checkpoint(ckpt_dir, tag=tag)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {tag!r}",
                                  path=os.path.join(ckpt_dir, tag))

    def save_16bit(self, directory: str, filename: str) -> bool:
        return bool(self.engine.save_16bit_model(directory, filename))

    def full_fp32_state_dict(self) -> dict[str, torch.Tensor]:
        return _full_fp32_state_dict(self.engine)

    def monitor_events(self, events: list[tuple[str, float, int]]) -> None:
        _monitor_events(self.engine, events)


def _tolerate_missing_transformers(plugin_cls: Any) -> None:
    """accelerate 1.15's ``DeepSpeedPlugin.set_deepspeed_weakref`` imports transformers
    unconditionally (only to publish an ``HfDeepSpeedConfig`` for transformers'
    ``from_pretrained`` under zero.Init). This workload builds its model itself, so
    without transformers installed that step is skipped instead of crashing."""
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        return
    if getattr(plugin_cls, "_clusterkit_patched", False):
        return

    def set_deepspeed_weakref(self: Any) -> None:
        self.dschf = None

    plugin_cls.set_deepspeed_weakref = set_deepspeed_weakref
    plugin_cls._clusterkit_patched = True


class AccelerateAdapter:
    """accelerate + DeepSpeedPlugin: gradient accumulation through
    ``accelerator.accumulate``, checkpoints through ``save_state``/``load_state``."""

    ds_subdir = ACCELERATE_DS_SUBDIR

    def __init__(self, model: GPT, ds_config: dict[str, Any], weight_decay: float,
                 project_dir: str, trackers: Sequence[str]) -> None:
        import torch.distributed as dist
        from accelerate import Accelerator
        from accelerate.utils import (
            DeepSpeedPlugin,
            DummyOptim,
            DummyScheduler,
            InitProcessGroupKwargs,
        )

        _tolerate_missing_transformers(DeepSpeedPlugin)
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
        precision = "bf16" if ds_config.get("bf16", {}).get("enabled") else (
            "fp16" if ds_config.get("fp16", {}).get("enabled") else "no")
        self.accelerator: Any = Accelerator(
            deepspeed_plugin=plugin, mixed_precision=precision,
            gradient_accumulation_steps=int(ds_config["gradient_accumulation_steps"]),
            project_dir=project_dir, log_with=list(trackers) or None,
            # Name the already-initialised backend: without it accelerate finds no GPU
            # backend on CPU and treats every rank as process 0 of 1 (all ranks then
            # write random_states_0.pkl and all think they are the main process).
            kwargs_handlers=[InitProcessGroupKwargs(backend=dist.get_backend())])
        optim = DummyOptim(param_groups(model, weight_decay))
        sched = DummyScheduler(optim)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optim, sched)
        self.engine: Any = self.model  # prepare() returns the DeepSpeedEngine itself
        if trackers:
            self.accelerator.init_trackers("clusterkit")

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    @property
    def global_samples(self) -> int:
        return int(self.engine.global_samples)

    def train_step(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        dev = self.accelerator.device
        total = torch.zeros((), dtype=torch.float32, device=dev)
        for batch in micro_batches:
            with self.accelerator.accumulate(self.model):
                loss = self.model(batch.inputs.to(dev), batch.targets.to(dev))
                self.accelerator.backward(loss)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
            total += loss.detach().float()
        return total / len(micro_batches)

    def eval_loss(self, batch: Batch) -> torch.Tensor:
        dev = self.accelerator.device
        return self.model(batch.inputs.to(dev), batch.targets.to(dev)).detach().float()  # type: ignore[no-any-return]

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def log(self, values: dict[str, float], step: int) -> None:
        self.accelerator.log(values, step=step)

    def save(self, ckpt_dir: str, tag: str, client: dict[str, Any]) -> None:
        # accelerate hands extra kwargs to DeepSpeed's save_checkpoint.
        self.accelerator.save_state(os.path.join(ckpt_dir, tag),
                                    client_state={"clusterkit": client})

    def load(self, ckpt_dir: str, tag: str) -> None:
        self.accelerator.load_state(os.path.join(ckpt_dir, tag))

    def save_16bit(self, directory: str, filename: str) -> bool:
        return bool(self.engine.save_16bit_model(directory, filename))

    def full_fp32_state_dict(self) -> dict[str, torch.Tensor]:
        return _full_fp32_state_dict(self.engine)

    def monitor_events(self, events: list[tuple[str, float, int]]) -> None:
        _monitor_events(self.engine, events)

    def end(self) -> None:
        self.accelerator.end_training()
