"""Where DeepSpeed ZeRO puts checkpoint files, and clusterkit's completion marker.

Pure: names, patterns and the marker schema. No file system access; the workload
(writer) and ``collect-ckpt`` (reader) do the I/O.

DeepSpeed 0.19 layout of one checkpoint ``<save_dir>/<tag>/`` (``engine.py``
``_get_ckpt_name``/``_get_rank_zero_ckpt_name``):

* ZeRO 0-2: ``mp_rank_00_model_states.pt`` (module + client state), written by
  data-parallel rank 0 — or by local rank 0 of *every* node with
  ``checkpoint.use_node_local_storage``. Not byte-identical across nodes: only
  global rank 0's copy carries ``shared_params`` (tied weights), which
  ``zero_to_fp32`` needs, so collect-ckpt keeps rank 0's copy.
* ZeRO-3: ``zero_pp_rank_{dp}_mp_rank_00_model_states.pt``, one per rank.
* ZeRO >= 1: one optimizer shard per rank,
  ``[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt``; the ``bf16_`` prefix
  appears whenever bf16 is enabled. Shards always carry the *global* dp index.
* ``<save_dir>/latest`` (tag name), ``<save_dir>/zero_to_fp32.py`` and
  ``<save_dir>/zero_to_torch.py``: global rank 0 only, i.e. on node 0 only with
  node-local storage (measured with DeepSpeed 0.19.8).

accelerate's ``save_state(output_dir)`` calls DeepSpeed with ``save_dir=output_dir``
and ``tag="pytorch_model"``, so for ``engine=accelerate`` the DeepSpeed files sit in
``<ckpt_dir>/<tag>/pytorch_model/`` (``ds_subdir`` in the marker) next to
accelerate's ``random_states_{rank}.pkl``.

clusterkit's completion marker ``<ckpt_dir>/<tag>/clusterkit-complete.node{N}.json``
is written by local rank 0 of node ``N`` after a global barrier that follows the
save, i.e. only once every rank has finished writing. It lists the node's ranks and
the files each needs to resume. A checkpoint is complete when markers for nodes
``0 .. num_nodes-1`` all exist (on shared storage they sit side by side; on
node-local storage each node holds its own).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from clusterkit.errors import CheckpointError
from clusterkit.node.contract import (
    MODEL_STATES_RE,
    OPTIM_STATES_RE,
    ZERO3_MODEL_STATES_RE,
    tag_step,
)

MARKER_SCHEMA = "clusterkit.checkpoint-complete"
MARKER_SCHEMA_VERSION = 1
# The completion-marker rule (MARKER_*, marker_name, parse_marker_name) is the node
# contract's (node/contract.py): callers import it from there, not through this module.
# DeepSpeed's file names (LATEST_FILE, RECOVERY_SCRIPTS, the shard regexes) are the node
# contract's too: the replica agents judge a tag dir with them on the node.
ACCELERATE_RNG_PATTERN = re.compile(r"^random_states_(\d+)\.pkl$")

ShardKind = Literal["model_states", "zero3_model_states", "optim_states"]

_MODEL_RE = MODEL_STATES_RE
_ZERO3_MODEL_RE = ZERO3_MODEL_STATES_RE
_OPTIM_RE = OPTIM_STATES_RE


@dataclass(frozen=True)
class ShardName:
    """A parsed DeepSpeed checkpoint file name. ``dp_rank`` is None for the shared
    ZeRO 0-2 model-states file, which every data-parallel rank reads."""

    kind: ShardKind
    dp_rank: int | None
    mp_rank: int
    bf16: bool = False


def parse_shard_name(name: str) -> ShardName | None:
    """Parse a bare file name; None for anything that is not a ZeRO shard."""
    if m := _MODEL_RE.match(name):
        return ShardName("model_states", None, int(m.group(1)))
    if m := _ZERO3_MODEL_RE.match(name):
        return ShardName("zero3_model_states", int(m.group(1)), int(m.group(2)))
    if m := _OPTIM_RE.match(name):
        return ShardName("optim_states", int(m.group(2)), int(m.group(3)), bf16=m.group(1) is not None)
    return None


def model_states_name(zero_stage: int, dp_rank: int, mp_rank: int = 0) -> str:
    if zero_stage == 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def optim_states_name(dp_rank: int, *, bf16: bool, mp_rank: int = 0) -> str:
    prefix = "bf16_" if bf16 else ""
    return f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def has_zero_optimizer_shards(zero_stage: int, precision: str) -> bool:
    """Stage 0 keeps optimizer state inside model_states (measured with DeepSpeed 0.19.8
    for fp32 and bf16 on the CPU accelerator: no ``*_optim_states.pt`` at stage 0)."""
    del precision  # kept in the signature: the bf16 prefix rule may differ per version
    return zero_stage >= 1


def rank_files(zero_stage: int, dp_rank: int, precision: str) -> tuple[str, ...]:
    """Files (relative to the DeepSpeed tag dir) that ``dp_rank`` must find to resume."""
    files = [model_states_name(zero_stage, dp_rank)]
    if has_zero_optimizer_shards(zero_stage, precision):
        files.append(optim_states_name(dp_rank, bf16=precision == "bf16"))
    return tuple(files)


def step_tag(step: int) -> str:
    """DeepSpeed's own default tag, so ``zero_to_fp32.py`` users see familiar names."""
    return f"global_step{step}"


def parse_step_tag(tag: str) -> int | None:
    """The step a tag names (``global_step40``, HF's ``checkpoint-30``, a user's
    ``step_12``): node/contract.tag_step, the one rule; None for a tag without a number."""
    step = tag_step(tag)
    return step if step >= 0 else None


@dataclass(frozen=True)
class RankEntry:
    """One global rank that lives on the marker's node."""

    global_rank: int
    local_rank: int
    host: str
    files: tuple[str, ...]  # relative to the checkpoint's tag dir (ds_subdir included)


@dataclass(frozen=True)
class CompletionMarker:
    """Schema v1 of ``clusterkit-complete.node{N}.json``.

    Paths in ``ranks[].files`` and ``node_files`` are relative to ``<ckpt_dir>/<tag>``.
    ``node_files`` maps every file present on this node under the tag dir to its size.
    """

    tag: str
    step: int
    engine: str  # "deepspeed" | "accelerate"
    ds_subdir: str  # "" (native) or "pytorch_model" (accelerate)
    zero_stage: int
    precision: str
    storage: str  # a StorageKind value
    world_size: int
    num_nodes: int
    node_index: int
    host: str
    ranks: tuple[RankEntry, ...]
    node_files: Mapping[str, int]
    created_unix: float
    global_samples: int = 0
    schema: str = MARKER_SCHEMA
    schema_version: int = MARKER_SCHEMA_VERSION

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "schema_version": self.schema_version,
            "tag": self.tag,
            "step": self.step,
            "global_samples": self.global_samples,
            "engine": self.engine,
            "ds_subdir": self.ds_subdir,
            "zero_stage": self.zero_stage,
            "precision": self.precision,
            "storage": self.storage,
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "node_index": self.node_index,
            "host": self.host,
            "ranks": [
                {"global_rank": r.global_rank, "local_rank": r.local_rank, "host": r.host,
                 "files": list(r.files)}
                for r in self.ranks
            ],
            "node_files": dict(sorted(self.node_files.items())),
            "created_unix": self.created_unix,
        }


_REQUIRED: Mapping[str, type | tuple[type, ...]] = {
    "schema": str, "schema_version": int, "tag": str, "step": int, "engine": str,
    "ds_subdir": str, "zero_stage": int, "precision": str, "storage": str, "world_size": int,
    "num_nodes": int, "node_index": int, "host": str, "ranks": list, "node_files": dict,
    "created_unix": (int, float),
}


def marker_from_json_dict(data: Mapping[str, Any], *, path: str | None = None) -> CompletionMarker:
    """Validate and parse a marker; raises CheckpointError naming the bad key."""
    for key, typ in _REQUIRED.items():
        if key not in data:
            raise CheckpointError("completion marker lacks a required key", path=path, key=key)
        if not isinstance(data[key], typ) or isinstance(data[key], bool):
            raise CheckpointError(f"completion marker key has the wrong type ({type(data[key]).__name__})",
                                  path=path, key=key)
    if data["schema"] != MARKER_SCHEMA or data["schema_version"] != MARKER_SCHEMA_VERSION:
        raise CheckpointError(
            f"unsupported marker schema {data['schema']!r} v{data['schema_version']}",
            path=path, key="schema", hint=f"this clusterkit reads {MARKER_SCHEMA} v{MARKER_SCHEMA_VERSION}")
    ranks = tuple(_rank_entry(r, path) for r in data["ranks"])
    node_files = {str(k): int(v) for k, v in data["node_files"].items()}
    return CompletionMarker(
        tag=data["tag"], step=data["step"], engine=data["engine"], ds_subdir=data["ds_subdir"],
        zero_stage=data["zero_stage"], precision=data["precision"], storage=data["storage"],
        world_size=data["world_size"], num_nodes=data["num_nodes"], node_index=data["node_index"],
        host=data["host"], ranks=ranks, node_files=node_files,
        created_unix=float(data["created_unix"]), global_samples=int(data.get("global_samples", 0)))


def _rank_entry(raw: Any, path: str | None) -> RankEntry:
    if not isinstance(raw, dict):
        raise CheckpointError("marker rank entry is not an object", path=path, key="ranks")
    try:
        return RankEntry(global_rank=int(raw["global_rank"]), local_rank=int(raw["local_rank"]),
                         host=str(raw["host"]), files=tuple(str(f) for f in raw["files"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"marker rank entry is malformed ({exc})", path=path,
                              key="ranks") from None
