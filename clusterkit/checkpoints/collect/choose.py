"""Which copy of each file collect-ckpt sends, once the nodes' checksums are (or are
not yet) known. Per-node duplicates (DeepSpeed's model states on every node) are the
reason: identical copies balance the load, differing ones go to global rank 0's."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence

from clusterkit.checkpoints import layout
from clusterkit.checkpoints.collectplan import CollectPlan
from clusterkit.checkpoints.sources.transfer import Hashed, Wanted


def why_kept(rel: str) -> str:
    """Why global rank 0's copy of a file the nodes hold different copies of is the one:
    DeepSpeed's model states (only rank 0's carries the tied weights), or any other file
    each node's program wrote for itself (HF's ``training_args.bin`` pickles per-process
    settings, ``trainer_state.json`` the writer's own times)."""
    if layout.parse_shard_name(posixpath.basename(rel)) is not None:
        return "global rank 0 writes the complete model states"
    return ("each node's program wrote its own copy; global rank 0's is the one a "
            "single-node save holds")


def pick_sources(plan: CollectPlan) -> list[Wanted]:
    """The copy of each file to send before any checksum is known: the only copy, or
    for per-node duplicates the copy of the node holding global rank 0 (which wins
    anyway when copies differ). ``sha256`` stays empty until the hashes arrive."""
    out: list[Wanted] = []
    for rel, copies in plan.files.items():
        pick = next((c for c in copies if c.node == plan.canonical_node), copies[0])
        out.append(Wanted(node=pick.node, relpath=rel, size=pick.size, sha256="",
                          mtime=pick.mtime))
    return out


def copy_notes(plan: CollectPlan, picks: Sequence[Wanted],
               hashes: Mapping[tuple[str, str], Hashed]) -> tuple[list[str], list[str]]:
    """(notes, problems) about duplicates once every copy's hash is known."""
    notes: list[str] = []
    problems: list[str] = []
    for w in picks:
        copies = plan.files[w.relpath]
        mine = hashes.get((w.node, w.relpath))
        if len(copies) < 2 or mine is None:
            continue
        others = [c.node for c in copies if c.node != w.node
                  and (h := hashes.get((c.node, w.relpath))) is not None and h.sha256 != mine.sha256]
        if others and w.node != plan.canonical_node:
            problems.append(f"{w.relpath} differs between {', '.join(c.node for c in copies)} and "
                            f"{plan.canonical_node} (global rank 0) has no copy")
        elif others:
            notes.append(f"{w.relpath}: the copies on {', '.join(others)} differ from {w.node}'s; "
                         f"kept {w.node}'s ({why_kept(w.relpath)})")
    return notes, problems


def choose_sources(plan: CollectPlan, hashes: Mapping[tuple[str, str], Hashed]
                   ) -> tuple[list[Wanted], list[str], list[str]]:
    """One source per file. Identical copies: the least loaded node sends it. Differing
    copies: global rank 0's node wins (DeepSpeed writes rank-local metadata into the
    per-node model states), with a note. Returns (wanted, notes, problems)."""
    load: dict[str, int] = {}
    wanted: list[Wanted] = []
    notes: list[str] = []
    problems: list[str] = []
    # Unique files first so duplicates can balance around them.
    for rel, copies in sorted(plan.files.items(), key=lambda kv: (len(kv[1]), kv[0])):
        hashed = [(c, hashes.get((c.node, rel))) for c in copies]
        missing = [c.node for c, h in hashed if h is None]
        if missing:
            problems.append(f"{', '.join(missing)}: {rel} has no source checksum")
            continue
        changed = [c.node for c, h in hashed if h is not None and h.size != c.size]
        if changed:
            problems.append(f"{', '.join(changed)}: {rel} changed size between listing and hashing")
            continue
        digests = {h.sha256 for _, h in hashed if h is not None}
        if len(digests) == 1:
            src = min(copies, key=lambda c: (load.get(c.node, 0), c.node))
        else:
            pick = [c for c in copies if c.node == plan.canonical_node]
            if not pick:
                problems.append(f"{rel} differs between {', '.join(c.node for c in copies)} and "
                                f"{plan.canonical_node} (global rank 0) has no copy")
                continue
            src = pick[0]
            others = [c.node for c, h in hashed
                      if h is not None and c.node != src.node
                      and h.sha256 != hashes[(src.node, rel)].sha256]
            notes.append(f"{rel}: the copies on {', '.join(others)} differ from {src.node}'s; "
                         f"kept {src.node}'s ({why_kept(rel)})")
        h = hashes[(src.node, rel)]
        load[src.node] = load.get(src.node, 0) + h.size
        wanted.append(Wanted(node=src.node, relpath=rel, size=h.size, sha256=h.sha256))
    return wanted, notes, problems
