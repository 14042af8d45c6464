"""--scatter: push a collected checkpoint back to node-local dirs for the next launch.

Each node gets its ranks' shards, the model states, ``latest``, and (node 0) the
recovery scripts; its completion marker goes last, after the node's files were
verified by sha256 *on the node*, so a node that did not get everything never
looks complete to the workload.

Ranks are assigned in selection order (node k gets the next ``slots`` ranks), the
same rule the launcher uses. The same world size on a different node split (7 x 2 ->
14 x 1) is supported: ZeRO shards are per data-parallel rank, so each rank only needs
its own file. A different world size is refused: DeepSpeed can only re-shard through
a universal checkpoint (``checkpoints/convert/universal.py``: DeepSpeed's ``ds_to_universal``,
loaded with ``checkpoint.load_universal``), which every node then holds whole.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import posixpath
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.checkpoints import layout
from clusterkit.checkpoints.collect.manifest import read_manifest
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.checkpoints.sources.transfer import hash_command, parse_hashes
from clusterkit.errors import CheckpointError
from clusterkit.node.contract import LATEST_FILE, RECOVERY_SCRIPTS, StorageKind, marker_name
from clusterkit.remote.base import Transport

HASH_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ScatterTarget:
    node: CollectNode
    slots: int


@dataclass(frozen=True)
class NodePush:
    node: str
    node_index: int
    ranks: tuple[int, ...]
    files: tuple[str, ...]  # relpaths under the checkpoint root (tag files, scripts)
    marker: dict[str, Any]  # the completion marker JSON for this node


@dataclass
class ScatterReport:
    tag: str
    pushes: list[NodePush]
    uploaded: dict[str, int] = field(default_factory=dict)  # node -> files uploaded
    skipped: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    remapped: bool = False
    seconds: float = 0.0


def plan_scatter(manifest: Mapping[str, Any], targets: Sequence[ScatterTarget]) -> list[NodePush]:
    """Pure: which files and which marker each target node gets."""
    world = int(manifest["world_size"])
    new_world = sum(t.slots for t in targets)
    if new_world != world:
        raise CheckpointError(
            f"the checkpoint has {world} data-parallel ranks but the selected nodes give "
            f"{new_world} slots; ZeRO shards cannot be re-split by copying",
            key="--scatter",
            hint=f"select nodes with {world} slots in total, or convert it with "
                 "clusterkit.checkpoints.convert.universal.convert_to_universal and copy "
                 "<tag>_universal/ to every node: the bundled workload resumes it on any "
                 "world size (docs/workload.md)")
    tag, sub = str(manifest["tag"]), str(manifest["ds_subdir"])
    rank_files: dict[int, list[str]] = {}
    for n in manifest["nodes"]:
        for r, files in n["rank_files"].items():
            rank_files[int(r)] = list(files)
    old_markers = _old_markers(manifest)
    scripts = [f for f in manifest["files"] if f in RECOVERY_SCRIPTS]
    pushes: list[NodePush] = []
    first = 0
    for index, t in enumerate(targets):
        ranks = tuple(range(first, first + t.slots))
        first += t.slots
        rels = sorted({posixpath.join(tag, f) for r in ranks for f in rank_files.get(r, [])})
        # None: collected without markers, stage 1 or 2 (the model states file is shared)
        if manifest["zero_stage"] is None or int(manifest["zero_stage"]) < 3:
            rels.append(posixpath.join(tag, sub, layout.model_states_name(0, 0)))
        if index == 0:
            rels += scripts
        files = tuple(sorted(set(rels)))
        missing = [f for f in files if f not in manifest["files"]]
        if missing:
            raise CheckpointError(f"the collected checkpoint lacks {', '.join(missing[:4])}",
                                  hint="collect it again")
        marker = _marker_for(manifest, old_markers.get(index), t, index, ranks, files,
                             rank_files)
        pushes.append(NodePush(t.node.name, index, ranks, files, marker))
    return pushes


def _old_markers(manifest: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(n["node_index"]): n for n in manifest["nodes"]}


def _marker_for(manifest: Mapping[str, Any], old: Mapping[str, Any] | None, t: ScatterTarget,
                index: int, ranks: tuple[int, ...], files: tuple[str, ...],
                rank_files: Mapping[int, list[str]]) -> dict[str, Any]:
    tag = str(manifest["tag"])
    sizes = {f[len(tag) + 1:]: int(manifest["files"][f]["size"]) for f in files
             if f.startswith(tag + "/")}
    host = str(old["host"]) if old and tuple(old["ranks"]) == ranks else t.node.name
    marker = layout.CompletionMarker(
        tag=tag, step=int(manifest["step"] or 0), engine=str(manifest["engine"]),
        ds_subdir=str(manifest["ds_subdir"]), zero_stage=int(manifest["zero_stage"] or 0),
        precision=str(manifest["precision"]), storage=StorageKind.NODE_LOCAL.value,
        world_size=int(manifest["world_size"]), num_nodes=0, node_index=index, host=host,
        ranks=tuple(layout.RankEntry(global_rank=r, local_rank=i, host=host,
                                     files=tuple(rank_files.get(r, ())))
                    for i, r in enumerate(ranks)),
        node_files=sizes, created_unix=time.time())
    return marker.to_json_dict()


def scatter(transport: Transport, dest: str, tag: str, targets: Sequence[ScatterTarget],
            *, jobs: int = 8) -> ScatterReport:
    manifest = read_manifest(dest, tag)
    pushes = plan_scatter(manifest, targets)
    for p in pushes:
        p.marker["num_nodes"] = len(pushes)
    old = {int(n["node_index"]): tuple(n["ranks"]) for n in manifest["nodes"]}
    report = ScatterReport(tag=tag, pushes=pushes,
                           remapped=any(old.get(p.node_index) != p.ranks for p in pushes)
                           or len(old) != len(pushes))
    by_name = {t.node.name: t.node for t in targets}
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=max(1, min(jobs, len(pushes)))) as pool:
        futures = {pool.submit(_push_node, transport, dest, manifest, by_name[p.node], p): p
                   for p in pushes}
        for fut, p in futures.items():
            try:
                uploaded, skipped = fut.result()
                report.uploaded[p.node], report.skipped[p.node] = uploaded, skipped
            except CheckpointError as exc:
                report.failed[p.node] = exc.message
            except Exception as exc:  # TransportError included: per-node result
                report.failed[p.node] = getattr(exc, "message", None) or str(exc)
    report.seconds = time.monotonic() - t0
    if report.failed:
        detail = "; ".join(f"{n}: {why}" for n, why in report.failed.items())
        raise CheckpointError(f"scatter failed on {len(report.failed)} node(s): {detail}",
                              hint="fix those nodes and run --scatter again (nodes that got "
                                   "every file are skipped)")
    return report


def remote_hashes(transport: Transport, node: CollectNode, files: Sequence[str]
                  ) -> dict[str, str]:
    """relpath -> sha256 of ``files`` under ``node.root``, hashed on the node (absent: not
    there); the check after an upload (here and in jobs/recover.py's restore)."""
    cmd = hash_command(node.python, node.root, list(files))
    res = transport.run(node.target, cmd.argv, timeout=HASH_TIMEOUT_S, stdin=cmd.stdin)
    if not res.ok:
        raise CheckpointError(f"hashing on the node failed: {res.stderr.strip()[-300:]}",
                              host=node.name)
    got, _errors = parse_hashes(res.stdout)
    return {rel: h.sha256 for rel, h in got.items()}


def _push_node(transport: Transport, dest: str, manifest: Mapping[str, Any], node: CollectNode,
               push: NodePush) -> tuple[int, int]:
    files = manifest["files"]
    have = remote_hashes(transport, node, push.files)
    todo = [f for f in push.files if have.get(f) != files[f]["sha256"]]
    for d in sorted({posixpath.dirname(posixpath.join(node.root, f)) for f in push.files}):
        transport.makedirs(node.target, d)
    tag = str(manifest["tag"])
    # The old marker first: an interrupted scatter must not leave a stale "complete".
    transport.run(node.target, ["rm", "-f", "--", posixpath.join(
        node.root, tag, marker_name(push.node_index))], timeout=60.0)
    for f in todo:
        transport.put(node.target, os.path.join(dest, f), posixpath.join(node.root, f))
    after = remote_hashes(transport, node, push.files) if todo else have
    bad = [f for f in push.files if after.get(f) != files[f]["sha256"]]
    if bad:
        raise CheckpointError(f"sha256 mismatch after upload: {', '.join(bad[:4])}",
                              host=node.name)
    _put_text(transport, node, posixpath.join(node.root, LATEST_FILE), tag)
    _put_text(transport, node, posixpath.join(node.root, tag, marker_name(push.node_index)),
              json.dumps(push.marker, indent=1) + "\n")
    return len(todo), len(push.files) - len(todo)


def _put_text(transport: Transport, node: CollectNode, remote: str, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".tmp", delete=False, encoding="utf-8") as fh:
        fh.write(text)
        local = fh.name
    try:
        transport.put(node.target, local, remote)
    finally:
        os.unlink(local)
