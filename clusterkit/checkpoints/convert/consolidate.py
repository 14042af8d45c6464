"""Turn a collected ZeRO checkpoint into one fp32 state dict, with DeepSpeed's own code.

The only module of collect-ckpt that imports torch/deepspeed (lazily, inside the
functions). Output goes to ``<DEST>/<tag>-fp32/`` (``pytorch_model.bin`` or
``model.safetensors``, sharded with an index above ``max_shard_size``), written into a
temporary directory and renamed into place only after it loaded back and, when its
tensors match a bundled preset, loaded strictly into ``clusterkit.workload``'s GPT.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from clusterkit.errors import CheckpointError
from clusterkit.fsutil import replace_dir
from clusterkit.units import parse_size

FORMATS = ("fp32", "safetensors")
NOT_CHECKED = "not load-tested (no model check given)"


@dataclass(frozen=True)
class Consolidated:
    out_dir: str
    files: tuple[str, ...]
    tensors: int
    parameters: int
    model_check: str  # what the state dict was loaded into, or why not


def output_dir(dest: str, tag: str) -> str:
    return os.path.join(dest, f"{tag}-fp32")


def consolidate(dest: str, tag: str, fmt: str = "fp32", *, max_shard_size: int | str = "5GB",
                out_dir: str | None = None, ds_subdir: str = "", universal: bool = False,
                model_check: Callable[[Mapping[str, Any]], str] | None = None) -> Consolidated:
    """Run ``convert_zero_checkpoint_to_fp32_state_dict`` on DEST and verify the result.

    ``ds_subdir``: where DeepSpeed's files sit inside the tag dir (accelerate's
    ``save_state`` puts them in ``pytorch_model/``, HF's Trainer in ``global_stepN/``);
    ``universal``: that dir is DeepSpeed's universal checkpoint (what a reshard left in
    HF's ``checkpoint-N``), read by :func:`universal_state_dict`. The output is named by
    ``tag``."""
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown --consolidate format {fmt!r}", key="--consolidate",
                              hint=f"choose one of {', '.join(FORMATS)}")
    # One size rule for every verb (docs/units.md): "5GB" = 5*10^9 as Hugging Face counts,
    # "5G" = 5GiB; DeepSpeed's writer and ours get the byte count, never the text.
    shard_bytes = max_shard_size if isinstance(max_shard_size, int) else \
        parse_size(max_shard_size, "--max-shard-size")
    final = out_dir or output_dir(dest, tag)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(dest, f"{tag}/{ds_subdir}" if ds_subdir else tag, tmp, fmt == "safetensors",
                 shard_bytes, universal)
        state = load_state_dict_dir(tmp)
        # The caller (cli) knows the models; checkpoints sit below the workload layer.
        check = model_check(state) if model_check is not None else NOT_CHECKED
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = tuple(sorted(os.listdir(final)))
    return Consolidated(out_dir=final, files=files, tensors=len(state),
                        parameters=sum(int(t.numel()) for t in _unique_tensors(state)),
                        model_check=check)


def _convert(dest: str, tag: str, out: str, safe: bool, max_shard_size: int,
             universal: bool = False) -> None:
    from deepspeed.utils import zero_to_fp32

    os.makedirs(out, exist_ok=True)
    try:
        if universal:
            state = universal_state_dict(os.path.join(dest, tag))
        elif safe:
            # DeepSpeed's own safetensors writer refuses tied weights (wte/lm_head share
            # storage); reconstruct with its code, then write untied copies ourselves.
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(dest, tag=tag)
        else:
            with _quiet_bars(zero_to_fp32):
                zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
                    dest, out, max_shard_size=max_shard_size, safe_serialization=False, tag=tag)
            return
    except (ValueError, FileNotFoundError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"DeepSpeed could not consolidate {tag}: {' '.join(str(exc).split())}",
                              path=os.path.join(dest, tag),
                              hint="run collect-ckpt without --consolidate to check the shards, "
                                   "then DEST/zero_to_fp32.py by hand") from None
    if safe:
        _save_sharded(_untie(state), out, max_shard_size, safe=True)
    else:  # keeps tied weights tied, as DeepSpeed's writer does
        _save_sharded(state, out, max_shard_size, safe=False)


def universal_state_dict(uni_dir: str) -> dict[str, Any]:
    """The fp32 state dict of a DeepSpeed universal checkpoint (``ds_to_universal``'s
    output: ``zero/<parameter>/fp32.pt`` per parameter beside the model states files it
    copied), built the way ``zero_to_fp32`` builds it from the original save: the
    buffers, every parameter the model states list (frozen ones of ZeRO 0-2 too: the
    converter wrote them from the module), then the tied names. The values are the
    optimizer's fp32 master weights, so they equal ``zero_to_fp32`` of the original."""
    import torch
    from deepspeed.checkpoint.constants import PARAM
    from deepspeed.utils.zero_to_fp32 import parse_model_states

    names = sorted(os.listdir(uni_dir))
    zero3 = [n for n in names if n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt")]
    files = [os.path.join(uni_dir, n) for n in (zero3 or ["mp_rank_00_model_states.pt"])]
    first = parse_model_states(files)[0]
    shapes = {name: shape for group in first.param_shapes for name, shape in group.items()}
    frozen = dict(first.frozen_param_shapes or {})
    if zero3 and frozen:
        raise ValueError(f"{len(frozen)} frozen parameters of a ZeRO-3 save are not in its "
                         "universal checkpoint (DeepSpeed's converter writes trainable ones only)")
    state: dict[str, Any] = dict(first.buffers)
    for name, shape in {**frozen, **shapes}.items():
        path = os.path.join(uni_dir, "zero", name, "fp32.pt")
        saved = torch.load(path, map_location="cpu", weights_only=False)
        tensor = saved[PARAM] if isinstance(saved, dict) else saved  # ZeRO-3: the flat tensor
        if tensor.numel() != shape.numel():
            raise ValueError(f"{path} holds {tensor.numel()} values, the model states say "
                             f"{name} has shape {tuple(shape)}")
        state[name] = tensor.float().reshape(shape)
    for alias, name in first.shared_params:
        if name in state:
            state[alias] = state[name]
    return state


@contextlib.contextmanager
def _quiet_bars(module: ModuleType) -> Iterator[None]:
    """DeepSpeed's writer draws a tqdm bar per shard ("Saving checkpoint shards"): in a
    captured or logged console that is a run of carriage-return updates, not a line.
    ``TQDM_DISABLE`` is read when tqdm is imported, which DeepSpeed (or transformers)
    may have done already in this process, so the module's own ``tqdm`` is swapped for a
    disabled one while it runs; collect-ckpt prints its own line per stage."""
    bar = getattr(module, "tqdm", None)
    if bar is None:
        yield
        return
    setattr(module, "tqdm", functools.partial(bar, disable=True))  # noqa: B010 (any module)
    try:
        yield
    finally:
        setattr(module, "tqdm", bar)  # noqa: B010


def _untie(state: Mapping[str, Any]) -> dict[str, Any]:
    seen: set[int] = set()
    out: dict[str, Any] = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone().contiguous() if ptr in seen else t.contiguous()
        seen.add(ptr)
    return out


def _save_sharded(state: Mapping[str, Any], out: str, max_bytes: int, *, safe: bool) -> None:
    """``model.safetensors`` / ``pytorch_model.bin``, or HF-style shards and their
    ``.index.json`` above ``max_bytes`` (the names DeepSpeed's own writer uses)."""
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes

    def write(shard: dict[str, Any], fname: str) -> None:
        if safe:
            from safetensors.torch import save_file

            save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        else:
            import torch

            torch.save(shard, os.path.join(out, fname))

    if len(shards) == 1:
        write(shards[0], f"{stem}.{ext}")
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}"
        write(shard, fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in _unique_tensors(state))
    with open(os.path.join(out, f"{stem}.{ext}.index.json"), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)


def load_state_dict_dir(path: str) -> dict[str, Any]:
    """Load what ``convert_zero_checkpoint_to_fp32_state_dict`` wrote (sharded or not)."""
    import torch

    names = sorted(os.listdir(path))
    index = [n for n in names if n.endswith(".index.json")]
    if index:
        with open(os.path.join(path, index[0]), encoding="utf-8") as fh:
            shards = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        shards = [n for n in names if n.endswith((".bin", ".safetensors", ".pt"))]
    state: dict[str, Any] = {}
    for shard in shards:
        full = os.path.join(path, shard)
        if shard.endswith(".safetensors"):
            from safetensors.torch import load_file

            state.update(load_file(full))
        else:
            state.update(torch.load(full, map_location="cpu", weights_only=True))
    if not state:
        raise CheckpointError("the consolidated state dict is empty", path=path)
    return state


def _unique_tensors(state: Mapping[str, Any]) -> list[Any]:
    seen: set[int] = set()
    out = []
    for t in state.values():
        key = t.data_ptr() if t.numel() else id(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out
