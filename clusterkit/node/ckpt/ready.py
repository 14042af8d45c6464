"""A node's checkpoint dir readied before the ranks start (issue 38, docs/programs.md).

One rule for both ways a job starts its ranks: the node agent of ``clusterkit launch``
(node program ``agent.core``: the launcher's ``checkpoint-prep.<node>.json``) and the
batch script of ``clusterkit sbatch`` (node program ``slurm.replica ready``: the run's
``prep.json``, written by its ``plan`` step).

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import json
import os

from clusterkit.node.contract import (
    ASIDE_SUFFIX,
    LATEST_FILE,
    MODEL_STATES_RE,
    OPTIM_STATES_RE,
    ZERO3_MODEL_STATES_RE,
)
from clusterkit.node.files import write_atomic


def ready_checkpoints(text: str) -> list[str]:
    """Ready this node's checkpoint dir before the ranks start (issue 38; the launcher's
    ``checkpoint-prep.<node>.json``, docs/programs.md); returns what was done, one line
    each. The dir itself is made (a program that saves into it finds it), newer
    checkpoints that cannot be assembled on this node set are moved aside (renamed,
    never deleted), DeepSpeed's top-level ``latest`` names the checkpoint every node
    resumes from, and a tag dir holding one DeepSpeed tag but no ``latest`` (written by
    global rank 0 only: HF's ``checkpoint-N/latest``) gets one."""
    prep = json.loads(text)
    ckpt = str(prep["ckpt_dir"])
    os.makedirs(ckpt, exist_ok=True)
    said = [f"moved {tag} aside to {moved} (it cannot be assembled on this node set)"
            for tag in prep.get("aside") or () for moved in [_set_aside(ckpt, str(tag))] if moved]
    latest = prep.get("latest")
    if latest and os.path.isdir(os.path.join(ckpt, latest)):
        path = os.path.join(ckpt, LATEST_FILE)
        if not _reads(path, latest):
            write_atomic(path, str(latest))
            said.append(f"{LATEST_FILE} -> {latest}")
    if prep.get("nested_latest"):
        said += _nested_latest(ckpt)
    return said


def _reads(path: str, text: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip() == text
    except OSError:
        return False


def _set_aside(ckpt: str, tag: str) -> str | None:
    src = os.path.join(ckpt, tag)
    if not os.path.isdir(src):
        return None
    n, dest = 1, f"{src}{ASIDE_SUFFIX}"
    while os.path.lexists(dest):
        n += 1
        dest = f"{src}{ASIDE_SUFFIX}{n}"
    os.rename(src, dest)
    return os.path.basename(dest)


def _is_ds_tag(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(MODEL_STATES_RE.match(n) or OPTIM_STATES_RE.match(n)
               or ZERO3_MODEL_STATES_RE.match(n) for n in names)


def _nested_latest(ckpt: str) -> list[str]:
    said = []
    for tag in sorted(os.listdir(ckpt)):
        tag_dir = os.path.join(ckpt, tag)
        if tag.startswith(".") or not os.path.isdir(tag_dir) \
                or os.path.lexists(os.path.join(tag_dir, LATEST_FILE)):
            continue
        inner = [d for d in sorted(os.listdir(tag_dir))
                 if os.path.isdir(os.path.join(tag_dir, d)) and _is_ds_tag(os.path.join(tag_dir, d))]
        if len(inner) == 1:
            write_atomic(os.path.join(tag_dir, LATEST_FILE), inner[0])
            said.append(f"{tag}/{LATEST_FILE} -> {inner[0]}")
    return said
