"""A universal conversion put inside the program's own tag dir (``OtherWorld.UNIVERSAL_INSIDE``,
spec/programs.py): HF Trainer's ``checkpoint-N/global_stepN`` converted beside itself,
accelerate's ``step_N/pytorch_model`` in its place. One code for both ways a job goes on
with another number of nodes: a launch's reshard (jobs/reshard.py, on this machine) and
the batch script's conversion step (jobs/slurm_reshard.py, on the batch host); each then
puts the tag dir on every node its own way (a launch's push, node/slurm/restore.spread_into),
the old world's DeepSpeed tag never among it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

from clusterkit.checkpoints.convert.universal import Universal, universal_tag
from clusterkit.fsutil import atomic_write_text
from clusterkit.node.contract import ASIDE_SUFFIX, LATEST_UNIVERSAL_FILE, UNIVERSAL_MARKER
from clusterkit.node.hashing import sha256_file
from clusterkit.spec.programs import DERIVED_DS_CONFIG, Profile


def into_tag_dir(dest: str, tag: str, u: Universal, *, in_place: bool = False
                 ) -> tuple[Universal, dict[str, tuple[int, str]]]:
    """The converter's output (``<tag>_universal/<DeepSpeed tag>``) moved into the tag dir
    where the program's DeepSpeed load reads it with load_universal on: HF's beside its
    tag, ``<tag>/global_stepN_universal`` with ``<tag>/latest_universal`` naming it;
    ``in_place`` (accelerate, which loads ``pytorch_model`` by name) in the tag's own
    place, the gathered original renamed ``pytorch_model.set-aside`` (kept: the marker
    names it) and ``latest_universal`` naming the conversion (collect's rule finds it by
    that). The files to put on every node, relative to ``dest`` with (size, sha256): the
    whole tag dir but the old DeepSpeed tag (a node new to the mapping gets the program's
    own files, every node every rank's RNG state)."""
    sub = u.marker.ds_subdir
    name, original = (sub, sub + ASIDE_SUFFIX) if in_place else (universal_tag(sub), sub)
    if in_place:
        os.replace(os.path.join(dest, tag, sub), os.path.join(dest, tag, original))
    shutil.rmtree(os.path.join(dest, tag, name), ignore_errors=True)
    os.replace(os.path.join(u.out_dir, sub), os.path.join(dest, tag, name))
    # The marker goes with it, naming what it was converted from (collect-ckpt and status
    # judge the old world's tag by that save's world size, checkpoints/collect/inside.py)
    # and its files relative to it; it goes last on every node.
    marker = dataclasses.replace(u.marker, source_tag=f"{tag}/{original}", ds_subdir="", files={
        rel[len(sub) + 1:]: size for rel, size in u.marker.files.items()
        if rel.startswith(sub + "/")})
    atomic_write_text(os.path.join(dest, tag, name, UNIVERSAL_MARKER),
                      json.dumps(marker.to_json_dict(), indent=1) + "\n")
    atomic_write_text(os.path.join(dest, tag, LATEST_UNIVERSAL_FILE), name + "\n")
    files = {rel: v for rel, v in local_files(dest, tag).items()
             if not rel.startswith(f"{tag}/{original}/")}
    return dataclasses.replace(u, out_dir=os.path.join(dest, tag, name), tag=f"{tag}/{name}",
                               marker=marker), files


def inside_line(u: Universal, new_world: int, profile: Profile, when: str) -> str:
    """What is said once the conversion is in the tag dir: what loads it, with
    ``checkpoint.load_universal`` on in the derived config for ``when`` (this attempt,
    this run)."""
    env = f" (${profile.config_env})" if profile.config_env else ""
    who = (f"{profile.name}'s load_state loads {u.tag}, now DeepSpeed's universal checkpoint "
           f"(the old world's tag kept as {u.marker.source_tag})" if profile.ds_tag else
           f"DeepSpeed loads {u.tag} ({LATEST_UNIVERSAL_FILE})")
    return (f"world size {u.marker.world_size} -> {new_world}: {who} with "
            f"checkpoint.load_universal on in {DERIVED_DS_CONFIG}{env}, {when}; the batch is "
            "your program's own (per-device size x ranks)")


def with_load_universal(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config with ``checkpoint.load_universal`` on (the rest as it was): what
    the attempt after a conversion loads with, in clusterkit's derived config only."""
    ckpt = doc.get("checkpoint")
    return {**doc, "checkpoint": {**(ckpt if isinstance(ckpt, dict) else {}),
                                  "load_universal": True}}


def local_files(root: str, tag: str) -> dict[str, tuple[int, str]]:
    """Every file under ``root/tag``: its path relative to ``root`` -> (size, sha256)."""
    out = {}
    for d, _dirs, names in os.walk(os.path.join(root, tag)):
        for name in names:
            path = os.path.join(d, name)
            out[os.path.relpath(path, root).replace(os.sep, "/")] = (os.path.getsize(path),
                                                                     sha256_file(path))
    return out
