"""The marker of a universal conversion (``clusterkit-universal.json``, beside DeepSpeed's
universal checkpoint): what it was converted from (the save's tag, step, world size,
ZeRO stage, batch, precision) and its files with their sizes. One reader for everyone:
the converter writes it (checkpoints/convert/universal.py), collect-ckpt and status judge
a conversion inside a program's tag dir by it (checkpoints/collect/inside.py), a
reshard's next attempt reads its batch. Its own module: the converter imports collect's
discovery, which imports the judging rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterkit.errors import CheckpointError

UNIVERSAL_SCHEMA = "clusterkit.universal"
UNIVERSAL_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class UniversalMarker:
    source_tag: str
    step: int
    global_samples: int
    world_size: int  # of the save it was converted from
    zero_stage: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    engine: str
    precision: str
    deepspeed_version: str
    files: Mapping[str, int] = field(default_factory=dict)  # relpath -> size, marker excluded
    created_unix: float = 0.0
    ds_subdir: str = ""  # DeepSpeed's files one level down (accelerate: pytorch_model)

    def to_json_dict(self) -> dict[str, Any]:
        return {"schema": UNIVERSAL_SCHEMA, "version": UNIVERSAL_SCHEMA_VERSION,
                "source_tag": self.source_tag, "step": self.step,
                "global_samples": self.global_samples, "world_size": self.world_size,
                "zero_stage": self.zero_stage, "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum, "global_batch": self.global_batch,
                "engine": self.engine, "precision": self.precision,
                "deepspeed_version": self.deepspeed_version, "ds_subdir": self.ds_subdir,
                "files": dict(sorted(self.files.items())), "created_unix": self.created_unix}


_INT_KEYS = ("step", "global_samples", "world_size", "zero_stage", "micro_batch", "grad_accum",
             "global_batch")
_STR_KEYS = ("source_tag", "engine", "precision", "deepspeed_version")


def marker_from_json_dict(data: Mapping[str, Any], *, path: str | None = None) -> UniversalMarker:
    if data.get("schema") != UNIVERSAL_SCHEMA or data.get("version") != UNIVERSAL_SCHEMA_VERSION:
        raise CheckpointError(f"not a {UNIVERSAL_SCHEMA} v{UNIVERSAL_SCHEMA_VERSION} marker",
                              path=path, key="schema")
    for keys, typ in ((_INT_KEYS, int), (_STR_KEYS, str)):
        for key in keys:
            if not isinstance(data.get(key), typ) or isinstance(data.get(key), bool):
                raise CheckpointError("universal marker lacks a key or it has the wrong type",
                                      path=path, key=key)
    files = data.get("files")
    if not isinstance(files, dict):
        raise CheckpointError("universal marker lacks its file list", path=path, key="files")
    return UniversalMarker(**{k: data[k] for k in (*_INT_KEYS, *_STR_KEYS)},
                           files={str(k): int(v) for k, v in files.items()},
                           created_unix=float(data.get("created_unix", 0.0)),
                           ds_subdir=str(data.get("ds_subdir", "")))
