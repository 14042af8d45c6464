"""A complete ZeRO checkpoint -> DeepSpeed's universal checkpoint, to resume on another
world size (a shrink after a node is lost for good, issue 22; docs/lost-a-node.md).

API (the launcher's recovery path and people call these; torch and deepspeed are
imported only inside :func:`convert_to_universal`):

* ``convert_to_universal(root, tag, *, workers=1, without_markers=None, timeout_s=None)
  -> Universal``: ``root`` holds ``<tag>/`` complete in one place (what
  ``clusterkit collect-ckpt`` leaves in DEST, or a shared-storage checkpoint root).
  Verified first with collect-ckpt's own rules (``discover.verify``: every node's
  completion marker, every rank's shard); then DeepSpeed's converter
  (``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``) runs in a
  child process into ``root/.<tag>_universal.tmp-<pid>/``; the clusterkit marker is
  written last and the directory renamed to ``root/<tag>_universal/``. DeepSpeed's files
  sit where the source had them: at the top, or (``--engine accelerate``) in
  ``pytorch_model/``, where accelerate's ``load_state`` reads them.
* ``universal_tag(tag)`` = ``<tag>_universal``; ``UNIVERSAL_MARKER`` (the marker's file
  name in that directory); ``read_universal_marker(tag_dir) -> UniversalMarker``
  (raises ``CheckpointError``); ``is_universal_dir(path)``.

What the resume needs: every node's checkpoint root (``--ckpt-dir`` of the bundled
workload; with node-local storage each node's own) holds a full copy of
``<tag>_universal/``, its marker copied last. Nothing else is passed: with
``--resume auto`` the workload finds it, loads it with ``checkpoint.load_universal``,
applies :func:`clusterkit.spec.batch.shrink_batch` and saves ordinary checkpoints
from then on (``--resume <tag>_universal`` names it explicitly).

The marker (``clusterkit-universal.json``, schema ``clusterkit.universal`` v1): the
source tag, its step and samples consumed, the world size, ZeRO stage, micro batch,
grad accumulation and global batch it was saved with, engine, precision, DeepSpeed's
version, ``ds_subdir``, and ``files`` (every file of the directory but the marker, relpath -> size)
so that a copy can be checked without reading it.

A user's own script (issue 31; docs/lost-a-node.md, "A user's script on fewer nodes"):
``convert_to_universal(..., without_markers=WithoutMarkers(...))`` judges its save by
DeepSpeed's own file set, and :func:`user_resume` is what its next attempt runs with:
the rendered ds_config with ``checkpoint.load_universal`` on and the batch of
:func:`clusterkit.spec.batch.shrink_batch`, and the tag it must load
(``CLUSTERKIT_RESUME_TAG``, node/contract.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clusterkit.checkpoints import layout
from clusterkit.checkpoints.collect import discover
from clusterkit.checkpoints.collectplan import CollectPlan, WithoutMarkers
from clusterkit.checkpoints.listing import parse_listing
from clusterkit.checkpoints.universal_marker import UniversalMarker, marker_from_json_dict
from clusterkit.errors import CheckpointError
from clusterkit.fsutil import (
    atomic_write_text,
    read_json_object,
    replace_dir,  # the one swap-in of a directory
)
from clusterkit.node.ckpt import listing as node_listing
from clusterkit.node.contract import ENV_RESUME_TAG, UNIVERSAL_MARKER, UNIVERSAL_SUFFIX
from clusterkit.spec.batch import BatchPlan, shrink_batch

CONVERTER = "deepspeed.checkpoint.ds_to_universal"
DEFAULT_TIMEOUT_S = 3600.0
OUTPUT_TAIL_LINES = 3


def universal_tag(tag: str) -> str:
    return f"{tag}{UNIVERSAL_SUFFIX}"


def read_universal_marker(tag_dir: str) -> UniversalMarker:
    path = os.path.join(tag_dir, UNIVERSAL_MARKER)
    return marker_from_json_dict(read_json_object(path, "universal marker", CheckpointError),
                                 path=path)


def is_universal_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, UNIVERSAL_MARKER))


def missing_files(tag_dir: str, marker: UniversalMarker) -> list[str]:
    """The marker's files absent from ``tag_dir`` or of another size (a partial copy)."""
    out = []
    for rel, size in sorted(marker.files.items()):
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full) or os.path.getsize(full) != size:
            out.append(rel)
    return out


@dataclass(frozen=True)
class Universal:
    out_dir: str  # <root>/<tag>_universal
    tag: str  # its name: what --resume takes
    marker: UniversalMarker
    seconds: float


def verify_source(root: str, tag: str, without_markers: WithoutMarkers | None = None
                  ) -> CollectPlan:
    """collect-ckpt's completeness rules on one local checkpoint root (raises
    ``CheckpointIncomplete`` naming every missing marker or shard)."""
    text = json.dumps(node_listing.listing(root, tag))
    return discover.verify([parse_listing("here", 0, root, text)], tag, without_markers)


def convert_to_universal(root: str, tag: str, *, workers: int = 1,
                         without_markers: WithoutMarkers | None = None,
                         timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Universal:
    """Convert ``root/<tag>`` into ``root/<tag>_universal`` (see the module doc)."""
    t0 = time.monotonic()
    root = os.path.abspath(root)
    plan = verify_source(root, tag, without_markers)
    source = os.path.join(root, tag, plan.ds_subdir) if plan.ds_subdir else os.path.join(root, tag)
    saved = _saved(source, plan)
    if saved.zero_stage == 0:
        raise CheckpointError(f"{tag} was saved with ZeRO stage 0: it has no optimizer shards "
                              "for DeepSpeed's universal converter", path=os.path.join(root, tag),
                              hint="resume it on its own world size, or train with ZeRO 1-3")
    name = universal_tag(tag)
    final = os.path.join(root, name)
    # The converter writes `latest_universal` beside its output dir: give it a parent of
    # its own, so that nothing but the finished directory reaches root.
    work = os.path.join(root, f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        out = os.path.join(work, name)
        # accelerate's load_state reads DeepSpeed's files from <dir>/pytorch_model: the
        # same place in the universal dir (the converter's `latest_universal` then lands
        # in it, and goes).
        _run_converter(source, os.path.join(out, plan.ds_subdir) if plan.ds_subdir else out,
                       workers, timeout_s)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, "latest_universal"))
        marker = _marker(plan, saved, tag, out)
        atomic_write_text(os.path.join(out, UNIVERSAL_MARKER),
                          json.dumps(marker.to_json_dict(), indent=1) + "\n")
        replace_dir(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Universal(out_dir=final, tag=name, marker=marker, seconds=time.monotonic() - t0)


def _run_converter(source: str, out: str, workers: int, timeout_s: float | None) -> None:
    try:
        import deepspeed  # noqa: F401  (only to fail here, with a hint, when it is absent)
    except ImportError:
        raise CheckpointError("deepspeed is not installed for this Python", path=sys.executable,
                              hint="pip install deepspeed (the version that saved the "
                                   "checkpoint), or convert on a node that has it") from None
    n = str(max(1, workers))
    argv = [sys.executable, "-m", CONVERTER, "--input_folder", source, "--output_folder", out,
            "--num_extract_workers", n, "--num_merge_workers", n, "--inject_missing_state"]
    # Nothing is compiled; the import of DeepSpeed's Muon module would import inductor.
    env = {**os.environ, "TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1")}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env,
                              check=False)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"DeepSpeed's universal converter ran over {timeout_s:.0f} s",
                              path=source, hint="run it by hand: " + " ".join(argv)) from None
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        tail = " | ".join(ln.strip() for ln in lines[-OUTPUT_TAIL_LINES:])
        raise CheckpointError(f"DeepSpeed's universal converter failed (exit {proc.returncode}): "
                              f"{tail}", path=source,
                              hint="run it by hand to see everything: " + " ".join(argv))


@dataclass(frozen=True)
class _Saved:
    """What DeepSpeed stored in the model states: its config and counters (a user's
    script has no clusterkit record of its batch)."""

    micro: int
    grad_accum: int
    global_samples: int
    version: str
    zero_stage: int  # clusterkit's marker's, else (a user's save) the saved ds_config's
    global_steps: int  # DeepSpeed's step counter (a user's tag names no step clusterkit reads)


def _saved(source: str, plan: CollectPlan) -> _Saved:
    import torch

    # A user's save has no clusterkit marker naming its stage: its model states file does.
    stages = [plan.zero_stage] if plan.zero_stage is not None else [3, 2]
    names = [layout.model_states_name(stage, 0) for stage in stages]
    path = next((os.path.join(source, n) for n in names if os.path.isfile(os.path.join(source, n))),
                os.path.join(source, names[-1]))
    state = torch.load(path, map_location="cpu", weights_only=False)
    cfg = state.get("ds_config") or {}
    try:
        micro = int(cfg["train_micro_batch_size_per_gpu"])
        ga = int(cfg.get("gradient_accumulation_steps", 1))
        stage = plan.zero_stage if plan.zero_stage is not None else \
            int((cfg.get("zero_optimization") or {}).get("stage", 0))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError("the model states hold no ds_config with an integer "
                              "train_micro_batch_size_per_gpu", path=path,
                              hint="save with a DeepSpeed that records its config") from None
    return _Saved(micro, ga, int(state.get("global_samples") or 0),
                  str(state.get("ds_version", "unknown")), int(stage),
                  int(state.get("global_steps") or 0))


def _marker(plan: CollectPlan, saved: _Saved, tag: str, out: str) -> UniversalMarker:
    files = {}
    for base, _, names in os.walk(out):
        for n in names:
            full = os.path.join(base, n)
            files[os.path.relpath(full, out)] = os.path.getsize(full)
    return UniversalMarker(
        source_tag=tag, step=int(plan.step if plan.step is not None else saved.global_steps),
        global_samples=saved.global_samples,
        world_size=plan.world_size, zero_stage=saved.zero_stage,
        micro_batch=saved.micro, grad_accum=saved.grad_accum,
        global_batch=saved.micro * saved.grad_accum * plan.world_size, engine=plan.engine,
        precision=plan.precision, deepspeed_version=saved.version, files=files,
        created_unix=time.time(), ds_subdir=plan.ds_subdir)


@dataclass(frozen=True)
class UserResume:
    """A user's script's attempt after a conversion: the tag it loads, its ds_config."""

    tag: str  # <tag>_universal, what CLUSTERKIT_RESUME_TAG names
    ds_config: Mapping[str, Any]
    batch: BatchPlan
    lines: tuple[str, ...]  # what changes, for the console


def user_resume(ds_config: Mapping[str, Any], marker: UniversalMarker, new_world: int
                ) -> UserResume:
    """The rendered ds_config of a user's script resumed from ``<source>_universal`` on
    ``new_world`` ranks (pure): ``checkpoint.load_universal`` on (DeepSpeed reads it at
    ``initialize``), the batch split by spec/batch.py's policy from the one it saved with."""
    plan = shrink_batch(marker.world_size, marker.micro_batch, marker.grad_accum, new_world)
    cfg = dict(ds_config)
    cfg["checkpoint"] = {**dict(cfg.get("checkpoint") or {}), "load_universal": True}
    cfg["train_micro_batch_size_per_gpu"] = plan.micro
    cfg["gradient_accumulation_steps"] = plan.grad_accum
    cfg["train_batch_size"] = plan.global_batch
    tag = universal_tag(marker.source_tag)
    lines = (f"world size {marker.world_size} -> {new_world}: your script loads {tag} "
             f"(${ENV_RESUME_TAG}) with checkpoint.load_universal on, this attempt only",
             f"batch: {plan.note}",
             "data order: your script owns it; with fewer ranks each rank's share of every "
             "step changes unless the script splits its data by the global sample index")
    return UserResume(tag, cfg, plan, lines)
