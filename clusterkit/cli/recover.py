"""Continuing a node-local job without a lost node (issue 22, docs/lost-a-node.md).

``clusterkit launch --job-id J --replace node6=node8``: the plan runs node6's node
index, ranks and slots on node8 (``hostfile.apply_replace``), and before any agent
starts, node6's part of the newest checkpoint the job can resume from is restored
onto node8 from a replica: pulled from its holder into a staging dir on this machine
(the collect machinery: one ``ckstream`` session, sha256 computed on the holder as it
reads and here as it arrives, both equal to the replica manifest's, which is the
source's own), then pushed to node8's checkpoint dir and hashed there again; the
completion marker goes last. The rank->node mapping is node6's with one name
changed, so the resume is exact.

Lives in ``cli`` because it joins ``launch`` (the plan, the job record) and
``checkpoints`` (the data path), two packages of one layer that may not import each
other (tests/test_layering.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.checkpoints import layout
from clusterkit.checkpoints.collect import CollectOptions, open_source
from clusterkit.checkpoints.listing import NodeListing
from clusterkit.checkpoints.source import CollectNode
from clusterkit.checkpoints.transfer import NullProgress, Wanted, hash_command, parse_hashes
from clusterkit.errors import LaunchError
from clusterkit.launch.run import Replacement
from clusterkit.node.contract import (
    REPLICA_MANIFEST,
    REPLICA_PARTIAL_PREFIX,
    REPLICA_SCHEMA,
    REPLICA_SCHEMA_VERSION,
    replica_source_dir,
)
from clusterkit.remote.base import Transport, target_for
from clusterkit.spec.job import JobPlan, NodePlan

HASH_TIMEOUT_S = 3600.0
STEP_RE = re.compile(r"(\d+)$")

Say = Callable[[str], None]


# ------------------------------------------------------------------ what exists


def collect_node(n: NodePlan, root: str) -> CollectNode:
    return CollectNode(n.name, target_for(n.host), n.python, root)


def list_roots(transport: Transport, nodes: Sequence[CollectNode], staging: str
               ) -> list[NodeListing]:
    """Every node's listing of its root, one session each (the collect-ckpt listing)."""
    with open_source(transport, nodes, CollectOptions(dest=staging, jobs=len(nodes) or 1)) as src:
        return src.listings(None)


def step_of(tag: str) -> int:
    m = STEP_RE.search(tag)
    return int(m.group(1)) if m else -1


def complete_elsewhere(own: Sequence[NodeListing], plan: JobPlan, skip: set[int]) -> list[str]:
    """Tags every node outside ``skip`` holds complete, newest first: its own completion
    marker there (the bundled workload), or the tag dir (a user's script: no markers)."""
    tags: set[str] | None = None
    for ls in own:
        if ls.index in skip:
            continue
        have = {t for t, files in ls.tags.items() if files is not None and _own_part(ls, t)}
        tags = have if tags is None else tags & have
    return sorted(tags or (), key=lambda t: (step_of(t), t), reverse=True)


def _own_part(ls: NodeListing, tag: str) -> bool:
    markers = ls.markers.get(tag) or {}
    if markers:
        return layout.marker_name(ls.index) in markers
    files = ls.tags.get(tag) or {}
    return not any(layout.parse_marker_name(posixpath.basename(f)) is not None for f in files)


def replica_tags(ls: NodeListing) -> list[str]:
    """The copies in a replica listing (root ``<ckpt>.replicas/node<N>``) that finished:
    their manifest is there; ``.partial-*`` copies in progress never count."""
    return [t for t, files in ls.tags.items()
            if files and not t.startswith(REPLICA_PARTIAL_PREFIX) and REPLICA_MANIFEST in files]


def ring_from(index: int, nodes: Sequence[NodePlan], skip: set[int]) -> list[tuple[int, NodePlan]]:
    """The other nodes in ring order after ``index``: where replication put its copies
    first (node i's copy lives on node i+1), so the likeliest holder is asked first."""
    n = len(nodes)
    order = [(index + k) % n for k in range(1, n)]
    return [(i, nodes[i]) for i in order if i not in skip]


# ------------------------------------------------------------------ restoring


@dataclass
class Restore:
    """What restoring one replaced node did, for the console and the tests."""

    replacement: Replacement
    tag: str = ""
    holder: str = ""
    files: int = 0
    bytes: int = 0
    rejected: list[str] = field(default_factory=list)  # holder: why its copy was not used


def restore_replacements(transport: Transport, plan: JobPlan, swaps: Sequence[Replacement],
                         staging: str, say: Say) -> list[Restore]:
    """Restore every replaced node's part of the newest checkpoint the other nodes and
    the replicas can complete; raise LaunchError naming what is missing."""
    spares = {s.index for s in swaps}
    own = list_roots(transport, [collect_node(n, n.ckpt_dir) for n in plan.nodes], staging)
    down = [f"{ls.node}: {ls.error}" for ls in own if ls.error and ls.index not in spares]
    if down:
        raise LaunchError(f"cannot restore {_names(swaps)}: other nodes of the job cannot be "
                          f"listed ({'; '.join(down)})", key="--replace",
                          hint="fix those nodes, or replace them too (--replace OLD=NEW)")
    tags = complete_elsewhere(own, plan, spares)
    done = []
    for s in swaps:
        say(f"restoring node index {s.index} ({s.old}) onto {s.new} from its replica ...")
        r = _restore_one(transport, plan, s, tags, spares, os.path.join(staging, f"node{s.index}"))
        say(f"restored {r.tag} of node index {s.index} ({s.old}) onto {s.new}: {r.files} files, "
            f"{r.bytes / 1e6:.1f} MB from its replica on {r.holder}, sha256 verified "
            "against the replica's manifest on the holder, here and on " + s.new)
        for why in r.rejected:
            say(f"  not used: {why}")
        done.append(r)
    return done


def _restore_one(transport: Transport, plan: JobPlan, s: Replacement, tags: Sequence[str],
                 spares: set[int], staging: str) -> Restore:
    result = Restore(s)
    holders = ring_from(s.index, plan.nodes, spares)
    roots = [collect_node(n, replica_source_dir(n.ckpt_dir, s.index)) for _, n in holders]
    listings = list_roots(transport, roots, staging)
    have = {ls.node: set(replica_tags(ls)) for ls in listings if not ls.error}
    for tag in tags:
        for node in roots:
            if tag not in have.get(node.name, ()):
                continue
            why = _try_holder(transport, plan, s, node, tag, staging, result)
            if why is None:
                return result
            result.rejected.append(f"{node.name}'s copy of {tag}: {why}")
    raise LaunchError(_missing_text(s, tags, listings, result), key="--replace",
                      hint=("pass --resume never to start fresh on purpose, or --resume an "
                            "older tag; `clusterkit status " + plan.job_id + "` shows which "
                            "checkpoints are replicated; next time keep replicas on "
                            "(--replicas K, default 1 with node-local storage)"))


def _missing_text(s: Replacement, tags: Sequence[str], listings: Sequence[NodeListing],
                  result: Restore) -> str:
    seen = "; ".join(f"{ls.node}: " + (ls.error or ", ".join(sorted(replica_tags(ls))) or "none")
                     for ls in listings)
    text = (f"cannot continue on {s.new} in place of {s.old}: no verified replica of node "
            f"index {s.index}'s part of a checkpoint the other nodes hold complete "
            f"({', '.join(tags) or 'none'}); replicas seen: {seen or 'no other node'}")
    if result.rejected:
        text += "; rejected: " + "; ".join(result.rejected)
    return text


def _try_holder(transport: Transport, plan: JobPlan, s: Replacement, holder: CollectNode,
                tag: str, staging: str, result: Restore) -> str | None:
    """Pull ``tag``'s copy from ``holder`` and push it to the spare; None when done, else
    why this copy was not used (the staging files of a rejected copy are removed)."""
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging, exist_ok=True)
    try:
        manifest = _read_manifest(transport, holder, tag)
        why = _manifest_problem(manifest, plan, s, tag)
        if why:
            return why
        files: Mapping[str, Mapping[str, Any]] = manifest["files"]
        _pull(transport, holder, tag, files, staging)
        spare = plan.nodes[s.index]
        _push(transport, collect_node(spare, spare.ckpt_dir), os.path.join(staging, tag), files)
    except LaunchError as exc:
        return exc.message
    result.tag, result.holder = tag, holder.name
    result.files = len(files)
    result.bytes = sum(int(v["size"]) for v in files.values())
    return None


def _read_manifest(transport: Transport, holder: CollectNode, tag: str) -> dict[str, Any]:
    path = posixpath.join(holder.root, tag, REPLICA_MANIFEST)
    res = transport.run(holder.target, ["cat", "--", path], timeout=60.0)
    if not res.ok:
        raise LaunchError(f"cannot read its manifest: {res.stderr.strip()[-200:]}")
    try:
        value = json.loads(res.stdout)
    except ValueError:
        raise LaunchError("its manifest is not JSON") from None
    if not isinstance(value, dict):
        raise LaunchError("its manifest is not a JSON object")
    return value


def _manifest_problem(m: Mapping[str, Any], plan: JobPlan, s: Replacement, tag: str
                      ) -> str | None:
    """Why this manifest does not describe node index ``s.index``'s part of ``tag``."""
    if m.get("schema") != REPLICA_SCHEMA or m.get("version") != REPLICA_SCHEMA_VERSION:
        return f"unknown manifest schema {m.get('schema')!r} version {m.get('version')!r}"
    if m.get("job_id") != plan.job_id or m.get("tag") != tag or m.get("source") != s.index:
        return (f"its manifest is for job {m.get('job_id')}, tag {m.get('tag')}, node index "
                f"{m.get('source')}")
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        return "its manifest lists no files"
    if not any(layout.parse_marker_name(posixpath.basename(f)) == s.index for f in files) \
            and any(layout.parse_marker_name(posixpath.basename(f)) is not None for f in files):
        return f"its manifest lacks node index {s.index}'s completion marker"
    return None


def _pull(transport: Transport, holder: CollectNode, tag: str,
          files: Mapping[str, Mapping[str, Any]], staging: str) -> None:
    """The replica's files into ``staging/<tag>/``: each checked against the manifest's
    sha256 (the source's) as the holder reads it and as it arrives here, so a copy
    corrupted on the holder's disk is caught and never used."""
    wanted = [Wanted(holder.name, posixpath.join(tag, rel), int(v["size"]), str(v["sha256"]))
              for rel, v in files.items()]
    with open_source(transport, [holder], CollectOptions(dest=staging, jobs=1)) as src:
        results, _, problems = src.copy(wanted, {}, NullProgress())
    failed = results.get(holder.name)
    bad = dict(failed.failed) if failed is not None else {}
    missing = [w.relpath for w in wanted
               if not os.path.isfile(os.path.join(staging, w.relpath)) and w.relpath not in bad]
    if bad or missing or problems:
        shown = [f"{rel}: {why}" for rel, why in list(bad.items())[:3]]
        shown += [f"{rel}: not received" for rel in missing[:3]] + problems[:2]
        raise LaunchError("; ".join(shown))


def _push(transport: Transport, spare: CollectNode, local_root: str,
          files: Mapping[str, Mapping[str, Any]]) -> None:
    """The staged files into the spare's checkpoint dir, hashed there; the completion
    marker and ``latest`` last, so a spare that did not get everything never looks
    complete to the workload's resume."""
    last = sorted(f for f in files if _goes_last(f))
    first = sorted(f for f in files if not _goes_last(f))
    for d in sorted({posixpath.dirname(posixpath.join(spare.root, f)) for f in files}):
        transport.makedirs(spare.target, d)
    transport.run(spare.target, ["rm", "-f", "--", *(posixpath.join(spare.root, f)
                                                     for f in last)], timeout=60.0)
    for group in (first, last):
        for f in group:
            transport.put(spare.target, os.path.join(local_root, f), posixpath.join(spare.root, f))
        _check_on_node(transport, spare, group, files)


def _goes_last(rel: str) -> bool:
    name = posixpath.basename(rel)
    return rel == layout.LATEST_FILE or layout.parse_marker_name(name) is not None


def _check_on_node(transport: Transport, node: CollectNode, rels: Sequence[str],
                   files: Mapping[str, Mapping[str, Any]]) -> None:
    if not rels:
        return
    cmd = hash_command(node.python, node.root, list(rels))
    res = transport.run(node.target, cmd.argv, timeout=HASH_TIMEOUT_S, stdin=cmd.stdin)
    if not res.ok:
        raise LaunchError(f"hashing on {node.name} failed: {res.stderr.strip()[-200:]}",
                          host=node.name)
    got, _ = parse_hashes(res.stdout)
    bad = [r for r in rels if r not in got or got[r].sha256 != files[r]["sha256"]]
    if bad:
        raise LaunchError(f"sha256 mismatch on {node.name} after upload: {', '.join(bad[:4])}",
                          host=node.name)


def _names(swaps: Sequence[Replacement]) -> str:
    return ", ".join(f"{s.old} -> {s.new}" for s in swaps)


@contextlib.contextmanager
def staging_dir(path: str) -> Iterator[str]:
    """The restore's staging dir on this machine, removed afterwards (it held one node's
    share of one checkpoint, once)."""
    os.makedirs(path, exist_ok=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
