"""Restoring a node index's part of a checkpoint onto the node that now runs it.

A continued node-local job whose node was lost (``--replace node6=node8``) or came back
with an empty disk gets that node index's part from a replica (docs/lost-a-node.md):
pulled from its holder into a staging dir on this machine through the collect data path
(one ``ckpt.stream`` session, sha256 computed on the holder as it reads and here as it
arrives, both equal to the replica manifest's, which is the source's own), then pushed
to the node's checkpoint dir and hashed there again; the completion marker and
``latest`` go last, so a node that did not get everything never looks complete. A tag
whose copies all fail verification gives way to the next older one.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from clusterkit.checkpoints.collect.scatter import remote_hashes
from clusterkit.checkpoints.replicas.assemble import Assembly, PartSource
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.checkpoints.sources.factory import open_source
from clusterkit.checkpoints.sources.transfer import NullProgress, Wanted
from clusterkit.errors import CheckpointError, LaunchError
from clusterkit.launch.continuation import Replacement
from clusterkit.node.contract import goes_last
from clusterkit.remote.base import Transport, target_for
from clusterkit.spec.job import JobPlan, NodePlan

Say = Callable[[str], None]


REFUSAL_HINT = ("pass --resume never to start fresh on purpose, or --resume TAG for an older "
                "checkpoint every node still has; `clusterkit status JOB` shows which "
                "checkpoints are replicated; next time keep replicas on (--replicas K, default 1 "
                "with node-local storage; docs/lost-a-node.md)")


def collect_node(n: NodePlan, root: str) -> CollectNode:
    return CollectNode(n.name, target_for(n.host), n.python, root)


@dataclass
class Restore:
    """What restoring one node index's part did, for the console and the tests."""

    replacement: Replacement
    tag: str = ""
    holder: str = ""
    files: int = 0
    bytes: int = 0
    rejected: list[str] = field(default_factory=list)  # holder: why its copy was not used


def restore_parts(transport: Transport, plan: JobPlan, tried: Sequence[Assembly],
                   swaps: Sequence[Replacement], staging: str, say: Say) -> list[Restore]:
    """Newest tag first; a tag whose copies all fail verification gives way to the next."""
    rejected: list[str] = []
    for a in (t for t in tried if t.complete):
        done = _restore_tag(transport, plan, a, swaps, staging, say, rejected)
        if done is not None:
            return done
    raise LaunchError(_missing_text(swaps, tried, rejected), key="--replace", hint=REFUSAL_HINT)


def _restore_tag(transport: Transport, plan: JobPlan, a: Assembly, swaps: Sequence[Replacement],
                 staging: str, say: Say, rejected: list[str]) -> list[Restore] | None:
    assert a.tag is not None
    done = []
    for s in swaps:
        r = Restore(s, tag=a.tag)
        cands = a.candidates.get(s.index, ())
        if cands and not cands[0].replica:  # a restore that finished before, on the spare
            r.holder = s.new
            say(f"node index {s.index} ({s.old}): {s.new} already holds its part of {a.tag}")
            done.append(r)
            continue
        say(f"restoring node index {s.index} ({s.old})'s part of {a.tag} onto {s.new} "
            "from its replica ...")
        for part in (c for c in cands if c.replica):
            why = _try_copy(transport, plan, s, part, a.tag,
                            os.path.join(staging, f"node{s.index}"), r)
            if why is None:
                break
            r.rejected.append(f"{part.host}'s copy of {a.tag}: {why}")
        rejected.extend(r.rejected)
        for why in r.rejected:
            say(f"  not used: {why}")
        if not r.holder:
            return None
        say(f"restored {a.tag} of node index {s.index} ({s.old}) onto {s.new}: {r.files} files, "
            f"{r.bytes / 1e6:.1f} MB from its replica on {r.holder}, each file's sha256 equal to "
            "the replica manifest's as read on the holder, as received here and on " + s.new)
        done.append(r)
    return done


def _missing_text(swaps: Sequence[Replacement], tried: Sequence[Assembly],
                  rejected: Sequence[str]) -> str:
    what = (tried[0].describe() if tried and not tried[0].complete else
            "no checkpoint of the job on its nodes or in their replicas" if not tried else
            "every copy failed verification")
    text = f"cannot continue with {swap_names(swaps)}: {what}"
    return text + ("; rejected: " + "; ".join(rejected) if rejected else "")


def _try_copy(transport: Transport, plan: JobPlan, s: Replacement, part: PartSource, tag: str,
              staging: str, result: Restore) -> str | None:
    """Pull one replica from its holder and push it to the spare; None when done, else why
    this copy was not used (the staging files of a rejected copy are removed)."""
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging, exist_ok=True)
    holder = next(n for n in plan.nodes if n.name == part.host)
    files = {rel: (size, part.sha256[rel]) for rel, size in part.files.items()}
    try:
        _pull(transport, collect_node(holder, part.root), files, staging)
        spare = plan.nodes[s.index]
        push_files(transport, collect_node(spare, spare.ckpt_dir), staging, files)
    except LaunchError as exc:
        return exc.message
    result.holder, result.files = part.host, len(files)
    result.bytes = sum(size for size, _ in files.values())
    return None


def _pull(transport: Transport, holder: CollectNode, files: Mapping[str, tuple[int, str]],
          staging: str) -> None:
    """The replica's files into ``staging``: each checked against the manifest's sha256
    (the source's) as the holder reads it and as it arrives here, so a copy corrupted on
    the holder's disk is caught and never used."""
    wanted = [Wanted(holder.name, rel, size, digest) for rel, (size, digest) in files.items()]
    with open_source(transport, [holder], dest=staging, jobs=1) as src:
        results, _, problems = src.copy(wanted, {}, NullProgress())
    failed = results.get(holder.name)
    bad = dict(failed.failed) if failed is not None else {}
    missing = [w.relpath for w in wanted
               if not os.path.isfile(os.path.join(staging, w.relpath)) and w.relpath not in bad]
    if bad or missing or problems:
        shown = [f"{rel}: {why}" for rel, why in list(bad.items())[:3]]
        shown += [f"{rel}: not received" for rel in missing[:3]] + problems[:2]
        raise LaunchError("; ".join(shown))


def push_files(transport: Transport, spare: CollectNode, local_root: str,
          files: Mapping[str, tuple[int, str]]) -> None:
    """The staged files into the spare's checkpoint dir, hashed there; the completion
    marker and ``latest`` last, so a spare that did not get everything never looks
    complete to the workload's resume."""
    last = sorted(f for f in files if goes_last(f))
    first = sorted(f for f in files if not goes_last(f))
    for d in sorted({posixpath.dirname(posixpath.join(spare.root, f)) for f in files}):
        transport.makedirs(spare.target, d)
    transport.run(spare.target, ["rm", "-f", "--", *(posixpath.join(spare.root, f)
                                                     for f in last)], timeout=60.0)
    for group in (first, last):
        for f in group:
            transport.put(spare.target, os.path.join(local_root, f), posixpath.join(spare.root, f))
        _check_on_node(transport, spare, group, files)


def _check_on_node(transport: Transport, node: CollectNode, rels: Sequence[str],
                   files: Mapping[str, tuple[int, str]]) -> None:
    if not rels:
        return
    try:
        got = remote_hashes(transport, node, rels)
    except CheckpointError as exc:  # a restore's failures are the launch's: LaunchError
        raise LaunchError(f"{node.name}: {exc.message}", host=node.name) from None
    bad = [r for r in rels if got.get(r) != files[r][1]]
    if bad:
        raise LaunchError(f"sha256 mismatch on {node.name} after upload: {', '.join(bad[:4])}",
                          host=node.name)


def swap_names(swaps: Sequence[Replacement]) -> str:
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
