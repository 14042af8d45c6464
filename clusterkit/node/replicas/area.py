"""The replica area on disk (part of the node agent, issue 22; layout in node/contract.py).

What a receiving agent may write there (:func:`safe_rel`), how a copy's manifest is made
and read (a copy without a readable manifest does not count), how a copy is committed,
and the sweep of copies a killed agent left half-written. Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

from clusterkit.node.contract import (
    LATEST_FILE,
    RECOVERY_SCRIPTS,
    REPLICA_MANIFEST,
    REPLICA_PARTIAL_PREFIX,
    REPLICA_SCHEMA,
    REPLICA_SCHEMA_VERSION,
    replica_area,
)
from clusterkit.node.replicas.rules import parse_replica_manifest


def safe_rel(rel: Any, tag: str) -> bool:
    """A relpath the receiver may write: under ``<tag>/``, or a top-level ``latest`` or
    recovery script; never absolute, never ``..``, never hidden, never the manifest."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return False
    parts = rel.split("/")
    if any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        return False
    if len(parts) == 1:
        return rel == LATEST_FILE or rel in RECOVERY_SCRIPTS
    return parts[0] == tag and rel != REPLICA_MANIFEST


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    with contextlib.ExitStack() as done:
        done.callback(os.close, fd)
        os.fsync(fd)


def read_manifest(path: str) -> dict[str, Any] | None:
    """A replica dir's manifest, or None when absent or unreadable (the copy counts not)."""
    try:
        with open(os.path.join(path, REPLICA_MANIFEST), encoding="utf-8") as fh:
            text = fh.read()
        parse_replica_manifest(text)  # the one manifest rule (node/replicas/rules.py)
        doc = json.loads(text)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def sweep_partials(ckpt_dir: str) -> list[str]:
    """Remove copies a killed agent left half-written (``node<N>/.partial-*``)."""
    gone = []
    area = replica_area(ckpt_dir)
    for src in (os.listdir(area) if os.path.isdir(area) else []):
        d = os.path.join(area, src)
        for name in (os.listdir(d) if os.path.isdir(d) else []):
            if name.startswith(REPLICA_PARTIAL_PREFIX):
                shutil.rmtree(os.path.join(d, name), ignore_errors=True)
                gone.append(os.path.join(d, name))
    return gone


def new_manifest(job_id: str, tag: str, source: int, source_host: str, holder: str,
                 files: Mapping[str, tuple[int, str, float | None]]) -> dict[str, Any]:
    """A replica manifest (schema ``clusterkit.replica``): ``files`` rel -> (size, sha256,
    the source's mtime)."""
    return {"schema": REPLICA_SCHEMA, "version": REPLICA_SCHEMA_VERSION, "job_id": job_id,
            "tag": tag, "source": source, "source_host": source_host, "holder": holder,
            "files": {rel: {"size": size, "sha256": sha, "mtime": mtime}
                      for rel, (size, sha, mtime) in files.items()},
            "completed": time.time()}


def commit_copy(partial: str, final: str, manifest: dict[str, Any]) -> None:
    """A copy in ``partial`` becomes the replica ``final``: manifest last, then the
    rename (the server's commit, and a Slurm restore's: node/slurm/restore.py); an older
    copy of the tag is moved aside to a partial name (never read) first and removed after."""
    with open(os.path.join(partial, REPLICA_MANIFEST), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    for d, _, _ in os.walk(partial):
        fsync_dir(d)
    old = None
    if os.path.exists(final):
        old = partial + "-old"
        os.rename(final, old)
    os.rename(partial, final)
    fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
