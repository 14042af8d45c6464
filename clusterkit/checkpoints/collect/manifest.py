"""What collect-ckpt leaves in DEST besides the files: the manifest of the collected
tag (``clusterkit-collect.json``, read by ``--scatter`` and ``--consolidate``) and
DEST's ``latest``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from clusterkit.checkpoints.collectplan import CollectPlan
from clusterkit.checkpoints.sources.base import Route
from clusterkit.checkpoints.sources.transfer import Wanted
from clusterkit.errors import CheckpointError
from clusterkit.fsutil import atomic_write_text
from clusterkit.node.contract import LATEST_FILE, tag_step

MANIFEST = "clusterkit-collect.json"
MANIFEST_SCHEMA = "clusterkit.collected-checkpoint"


def manifest_dict(plan: CollectPlan, wanted: Sequence[Wanted], notes: Sequence[str],
                  routes: Mapping[str, Route] | None = None,
                  parts: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``routes``/``parts``: the node parts read from replicas (each such file's entry
    names its ``replica_on`` node; ``parts`` says where every node index's part came
    from)."""
    routes = routes or {}
    doc = {
        "schema": MANIFEST_SCHEMA, "schema_version": 1, "tag": plan.tag, "step": plan.step,
        "zero_stage": plan.zero_stage, "world_size": plan.world_size, "engine": plan.engine,
        "ds_subdir": plan.ds_subdir, "precision": plan.precision,
        "nodes": [{"node": n.node, "node_index": n.node_index, "host": n.host,
                   "ranks": list(n.ranks),
                   "rank_files": {str(r): list(f) for r, f in n.rank_files.items()}}
                  for n in plan.nodes],
        "files": {w.relpath: {"size": w.size, "sha256": w.sha256, "source": w.node,
                              "copies": [c.node for c in plan.files[w.relpath]],
                              **({"replica_on": routes[w.node].holder} if w.node in routes
                                 else {})}
                  for w in sorted(wanted, key=lambda w: w.relpath)},
        "notes": list(notes), "created_unix": time.time(),
    }
    if parts:
        doc["parts"] = dict(parts)
    return doc


def write_manifest(dest: str, plan: CollectPlan, wanted: Sequence[Wanted],
                   notes: Sequence[str], routes: Mapping[str, Route] | None = None,
                   parts: Mapping[str, Any] | None = None) -> None:
    atomic_write_text(os.path.join(dest, plan.tag, MANIFEST),
                      json.dumps(manifest_dict(plan, wanted, notes, routes, parts), indent=1)
                      + "\n")


def read_manifest(dest: str, tag: str) -> dict[str, Any]:
    path = os.path.join(dest, tag, MANIFEST)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError("no collected checkpoint here (manifest missing)", path=path,
                              hint="run clusterkit collect-ckpt first") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unreadable manifest ({exc})", path=path) from None
    if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
        raise CheckpointError("not a clusterkit collect manifest", path=path)
    return data


def latest_tag_at(dest: str) -> str | None:
    try:
        with open(os.path.join(dest, LATEST_FILE), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def write_latest(dest: str, tag: str) -> None:
    """Point DEST/latest at ``tag`` unless it already names a newer collected step."""
    current = latest_tag_at(dest)
    if current and current != tag and os.path.isfile(os.path.join(dest, current, MANIFEST)):
        cur, new = tag_step(current), tag_step(tag)
        if new >= 0 and cur > new:  # a tag naming no step (-1) is written
            return
    atomic_write_text(os.path.join(dest, LATEST_FILE), tag)
