"""Write a fake node-local ZeRO checkpoint (random bytes, real names and markers).

For tests and ``bench/collect.py``: the tiny workload's shards are a few hundred KB,
while the copy path needs realistic sizes. The layout is what DeepSpeed 0.19 writes
with ``use_node_local_storage`` (see :mod:`clusterkit.checkpoints.collect.discover`): node 0
has ``latest`` and the recovery scripts; every node has its own model states (ZeRO
0-2; node 0's copy differs, like the real one) or its ranks' ZeRO-3 model states,
its ranks' optimizer shards, and its completion marker.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence

from clusterkit.checkpoints import layout
from clusterkit.node import contract
from clusterkit.node.contract import LATEST_FILE, RECOVERY_SCRIPTS, marker_name

SCRIPT_TEXT = "# stand-in for DeepSpeed's zero_to_fp32.py\n"


def _write_bytes(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)


def _random(n: int) -> bytes:
    return os.urandom(n)


_POOL_BYTES = 32 << 20
_pool: list[bytes] = []


def _write_random(path: str, size: int, chunk: int = 1 << 20) -> None:
    """``size`` incompressible bytes, fast: 1 MiB slices of a 32 MiB urandom pool at
    random offsets (os.urandom alone runs at a few hundred MB/s; this at disk speed).
    Never zeros or sparse holes, so nothing on the way can shortcut them."""
    if not _pool:
        _pool.append(os.urandom(_POOL_BYTES + chunk))
    pool = memoryview(_pool[0])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        left = size
        while left:
            n = min(chunk, left)
            at = int.from_bytes(os.urandom(4), "little") % _POOL_BYTES
            fh.write(pool[at:at + n])
            left -= n


def write_node_local(roots: Sequence[str], *, ranks_per_node: int = 2, zero_stage: int = 2,
                     shard_bytes: int = 1 << 16, model_bytes: int = 1 << 14,
                     tag: str = "global_step1", hosts: Sequence[str] | None = None) -> int:
    """``roots[i]`` is node i's checkpoint root as seen from here. Returns total bytes."""
    num_nodes = len(roots)
    world = num_nodes * ranks_per_node
    step = layout.parse_step_tag(tag) or 1
    shared_model = _random(model_bytes)
    total = 0
    for index, root in enumerate(roots):
        tag_dir = os.path.join(root, tag)
        host = hosts[index] if hosts else f"node{index + 1}"
        ranks = range(index * ranks_per_node, (index + 1) * ranks_per_node)
        files: dict[str, int] = {}
        if zero_stage < 3:
            # Global rank 0 writes extra metadata (shared_params): its copy differs.
            data = shared_model if index else shared_model[:-8] + b"rank0!!!"
            _write_bytes(os.path.join(tag_dir, layout.model_states_name(zero_stage, 0)), data)
            files[layout.model_states_name(zero_stage, 0)] = len(data)
        for r in ranks:
            for name in layout.rank_files(zero_stage, r, "fp32"):
                if name in files:
                    continue
                size = shard_bytes if "optim" in name else model_bytes
                _write_random(os.path.join(tag_dir, name), size)
                files[name] = size
        total += sum(files.values())
        marker = layout.CompletionMarker(
            tag=tag, step=step, engine="deepspeed", ds_subdir="", zero_stage=zero_stage,
            precision="fp32", storage=contract.StorageKind.NODE_LOCAL.value, world_size=world,
            num_nodes=num_nodes,
            node_index=index, host=host,
            ranks=tuple(layout.RankEntry(global_rank=r, local_rank=r - ranks[0], host=host,
                                         files=layout.rank_files(zero_stage, r, "fp32"))
                        for r in ranks),
            node_files=files, created_unix=time.time())
        _write_bytes(os.path.join(tag_dir, marker_name(index)),
               json.dumps(marker.to_json_dict(), indent=1).encode())
        if index == 0:
            _write_bytes(os.path.join(root, LATEST_FILE), tag.encode())
            _write_bytes(os.path.join(root, "zero_to_fp32.py"), SCRIPT_TEXT.encode())
    return total


def shard_paths(root: str, tag: str = "global_step1") -> list[str]:
    """Optimizer shard files under one node's root (for tests that break them)."""
    d = os.path.join(root, tag)
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith("_optim_states.pt"))


def write_replica(root: str, holder_root: str, source: int, tag: str = "global_step1", *,
                  job_id: str = "job", source_host: str | None = None,
                  holder: str | None = None, manifest: bool = True) -> str:
    """Copy node index ``source``'s ``tag`` (its root ``root``) into ``holder_root``'s
    replica area as the replication service leaves it: the tag's files under ``<tag>/``
    (node 0: also ``latest`` and the recovery scripts), the manifest with real sha256s
    written last. ``manifest=False`` leaves a copy that never finished. Returns its dir."""
    dest = contract.replica_dir(holder_root, source, tag)
    rels = [os.path.relpath(os.path.join(d, n), root)
            for d, _, names in os.walk(os.path.join(root, tag)) for n in names]
    rels += [n for n in (LATEST_FILE, *RECOVERY_SCRIPTS)
             if source == 0 and os.path.isfile(os.path.join(root, n))]
    files: dict[str, dict[str, object]] = {}
    for rel in sorted(rels):
        with open(os.path.join(root, rel), "rb") as fh:
            data = fh.read()
        _write_bytes(os.path.join(dest, rel), data)
        files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if manifest:
        doc = {"schema": contract.REPLICA_SCHEMA, "version": contract.REPLICA_SCHEMA_VERSION,
               "job_id": job_id, "tag": tag, "source": source,
               "source_host": source_host or f"node{source + 1}",
               "holder": holder or os.path.basename(os.path.dirname(holder_root.rstrip("/"))),
               "files": files, "completed": time.time()}
        _write_bytes(os.path.join(dest, contract.REPLICA_MANIFEST), json.dumps(doc, indent=1).encode())
    return dest


def write_ring_replicas(roots: Sequence[str], tag: str = "global_step1", *, replicas: int = 1,
                        hosts: Sequence[str] | None = None) -> None:
    """Every node's ``tag`` copied to the next ``replicas`` nodes (the default ring)."""
    n = len(roots)
    for source, root in enumerate(roots):
        for k in range(1, replicas + 1):
            holder = (source + k) % n
            write_replica(root, roots[holder], source, tag,
                          source_host=hosts[source] if hosts else None,
                          holder=hosts[holder] if hosts else None)


def write_hf_save(roots: Sequence[str], step: int, *, model_everywhere: bool = True) -> str:
    """An HF Trainer + DeepSpeed save as each node holds it (issue 38): ``checkpoint-N/``
    with DeepSpeed's ``global_stepN/`` inside and ``latest`` in the tag, HF's own
    ``trainer_state.json`` beside it (differing per node), no completion markers, nothing
    at the root. Without ``model_everywhere`` (a ds_config without use_node_local_storage)
    the model states are on node 0 only. 2 ranks a node, ZeRO-2. Returns the tag."""
    tag = f"checkpoint-{step}"
    write_node_local(roots, zero_stage=2, shard_bytes=2048, model_bytes=512, tag=tag)
    for index, root in enumerate(roots):
        tag_dir = os.path.join(root, tag)
        inner = os.path.join(tag_dir, f"global_step{step}")
        os.makedirs(inner)
        for name in sorted(os.listdir(tag_dir)):
            if not name.endswith(".pt"):
                continue
            if model_everywhere or index == 0 or "optim" in name:
                os.rename(os.path.join(tag_dir, name), os.path.join(inner, name))
            else:
                os.unlink(os.path.join(tag_dir, name))
        os.unlink(os.path.join(tag_dir, marker_name(index)))
        _write_bytes(os.path.join(tag_dir, LATEST_FILE), f"global_step{step}".encode())
        _write_bytes(os.path.join(tag_dir, "trainer_state.json"),
               json.dumps({"global_step": step, "node": index}).encode())
        for name in (LATEST_FILE, *RECOVERY_SCRIPTS):  # HF keeps these inside the tag
            if os.path.exists(os.path.join(root, name)):
                os.unlink(os.path.join(root, name))
    return tag
