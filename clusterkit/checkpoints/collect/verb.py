"""collect-ckpt, the verb: list -> verify -> pick one copy per file -> copy, hashed on both ends.

The bytes come from one :class:`~clusterkit.checkpoints.sources.base.Source`, chosen by
``--via``: one ``ckpt.stream`` session per node (:mod:`clusterkit.checkpoints.sources.stream`:
ssh, local or slurm) or the transport's SFTP (:mod:`clusterkit.checkpoints.sources.sftp`).
Nothing is copied until every node has been listed and the checkpoint is known to be
complete and consistent (:func:`clusterkit.checkpoints.collect.discover.verify`); no file takes
its final name before the sha256 its node computed while reading it equals the one
computed here while writing it. DEST then looks like a shared-storage checkpoint root:
``latest``, ``zero_to_fp32.py`` and ``<tag>/`` holding every shard, every node's
completion marker and ``clusterkit-collect.json``
(:mod:`clusterkit.checkpoints.collect.manifest`, what ``--scatter`` uses).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from clusterkit.checkpoints.collect.choose import choose_sources, copy_notes, pick_sources
from clusterkit.checkpoints.collect.discover import choose_tag, shared_dir, verify
from clusterkit.checkpoints.collect.fromreplicas import (
    REPLICA_DAMAGED,
    ReplicaUse,
    next_route,
    plan_replicas,
    stand_ins,
)
from clusterkit.checkpoints.collect.manifest import write_latest, write_manifest
from clusterkit.checkpoints.collect.prune import prune_sources
from clusterkit.checkpoints.collect.tags import newest_collectable
from clusterkit.checkpoints.collectplan import CheckpointIncomplete, CollectPlan, WithoutMarkers
from clusterkit.checkpoints.listing import NodeListing
from clusterkit.checkpoints.replicas.assemble import ranks_of_slots
from clusterkit.checkpoints.sources.base import CollectNode, Source
from clusterkit.checkpoints.sources.factory import open_source
from clusterkit.checkpoints.sources.stream import StreamSource
from clusterkit.checkpoints.sources.transfer import (
    DestState,
    Hashed,
    NodeResult,
    NullProgress,
    ProgressSink,
    Wanted,
    clean_parts,
)
from clusterkit.errors import CheckpointError
from clusterkit.remote.base import Transport


@dataclass(frozen=True)
class CollectOptions:
    dest: str
    tag: str = "latest"
    jobs: int = 8
    method: str = "auto"  # auto | ssh | sftp | slurm (every node has its SlurmPlace)
    fsync: bool = True
    dry_run: bool = False
    prune_sources: bool = False
    without_markers: WithoutMarkers | None = None  # a user script's save: no clusterkit markers


@dataclass
class CollectReport:
    plan: CollectPlan
    wanted: list[Wanted]
    results: dict[str, NodeResult] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    method: str = ""
    seconds_list: float = 0.0
    seconds_hash: float = 0.0
    seconds_copy: float = 0.0
    pruned: dict[str, str] = field(default_factory=dict)  # node -> "ok" or why not
    replicas: ReplicaUse | None = None  # the parts read from replicas, when any node has some

    @property
    def bytes_copied(self) -> int:
        return sum(r.bytes_copied for r in self.results.values())

    @property
    def failed(self) -> dict[str, str]:
        return {f"{n}:{rel}": why for n, r in self.results.items() for rel, why in r.failed.items()}

    @property
    def skipped(self) -> int:
        return sum(len(r.skipped) for r in self.results.values())


def collect(transport: Transport, nodes: Sequence[CollectNode], options: CollectOptions,
            sink: ProgressSink | None = None,
            after_hash: Callable[[CollectPlan], None] | None = None,
            on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
            on_plan: Callable[[CollectPlan], None] | None = None) -> CollectReport:
    """The whole verb minus consolidation. Raises :class:`CheckpointIncomplete` (nothing
    copied) or :class:`CheckpointError` (some files failed; verified ones stay).

    ``after_hash`` (tests) runs between the hashing and the copy, which it forces to
    happen in that order; ``on_start`` gets each node's session process as its
    stream starts; ``on_plan`` the verified plan before anything is copied."""
    sink = sink or NullProgress()
    source = open_source(transport, nodes, method=options.method, dest=options.dest,
                         jobs=options.jobs, fsync=options.fsync, on_start=on_start)
    t0 = time.monotonic()
    with source:
        plan, use = _verified(source, source.listings(_tag_arg(options.tag)), options)
        if on_plan is not None:
            on_plan(plan)
        report = CollectReport(plan=plan, wanted=[], notes=list(plan.notes),
                               seconds_list=time.monotonic() - t0, replicas=use)
        # Hashed before the copy: everything for a dry run (it reports the checksums),
        # the test hook and a source that cannot hash while sending; on a re-run only
        # what DEST has a record of (to skip it if verified). The rest is read once,
        # hashed on its node as it is sent.
        whole = options.dry_run or after_hash is not None or not source.hashes_inline
        first = plan if whole else _subplan(plan, _recorded(options, plan))
        if first.files:
            t1 = time.monotonic()
            report.wanted, notes = _checked_choice(first, *source.hashes(first))
            if options.dry_run:  # the copy would refuse these: say so now
                notes += _would_refuse(report.wanted, use)
            report.wanted = _expected(report.wanted, use)
            report.notes += notes
            report.seconds_hash = time.monotonic() - t1
        if options.dry_run:
            return report
        if after_hash is not None:
            after_hash(plan)
        rest = _subplan(plan, set(plan.files) - set(first.files))
        inline = _expected(pick_sources(rest), use)
        report.wanted += inline
        report.method = source.method
        _prepare_dest(options.dest, plan.tag)
        t2 = time.monotonic()
        report.results, hashes, problems = source.copy(
            report.wanted, _unpicked_copies(rest, inline), sink)
        if use is not None:
            _fall_back(source, use, report, sink)
            report.notes += use.notes
        report.seconds_copy = time.monotonic() - t2
    _settle_inline_hashes(report, inline, hashes, problems, options.dest)
    _finish(transport, nodes, report, options)
    return report


def _verified(source: Source, listings: list[NodeListing], options: CollectOptions
              ) -> tuple[CollectPlan, ReplicaUse | None]:
    """The plan, with the parts that come from replicas when the nodes hold any: a node
    that is unreachable, or whose copy is missing or incomplete, is stood in for by a
    complete replica (:mod:`clusterkit.checkpoints.collect.fromreplicas`)."""
    tag = _tag_arg(options.tag)
    chosen = tag or choose_tag(listings, options.tag, markers=False)[0]
    shared = shared_dir(listings, chosen) if chosen else None
    if shared is not None:  # one line, not the replicas' or the shards' view of it
        raise shared
    wm = options.without_markers
    said = {ls.latest for ls in listings if not ls.error and ls.latest}
    if tag is None and len(said) < 2:  # the newest collectable tag, status's answer (tags.py);
        # nodes whose 'latest' files disagree hold two runs' saves: refused below
        found = newest_collectable(listings, without_markers=wm)
        tag = found.tag if found is not None else None
    if tag is None:  # none: 'latest' as the reachable nodes say, and verify() says why
        tag = choose_tag([ls for ls in listings if not ls.error], options.tag,
                         markers=wm is None)[0]
    # Every node answered but 'latest' is unclear: verify() says why, as without replicas.
    unclear = tag is None and not any(ls.error for ls in listings)
    use = None if unclear else plan_replicas(
        listings, tag, require_markers=wm is None,
        ranks=ranks_of_slots(wm.slots) if wm is not None and wm.slots else None)
    if use is None:
        return verify(listings, tag or options.tag, wm), None
    if use.routes and not isinstance(source, StreamSource):
        raise CheckpointError("completing a checkpoint from replicas needs one session per "
                              "node; --via sftp cannot read them", key="--via",
                              hint="drop --via sftp (the OpenSSH 'ssh' program is needed)")
    source.routes = use.routes
    return verify(stand_ins(use), use.tag, options.without_markers), use


def _expected(wanted: list[Wanted], use: ReplicaUse | None) -> list[Wanted]:
    """Files of which a replica manifest knows the sha256 must arrive with it."""
    if use is None:
        return wanted
    expect = use.expect()
    return [dataclasses.replace(w, sha256=e.sha256, mismatch=e.mismatch)
            if (e := expect.get((w.node, w.relpath))) is not None else w for w in wanted]


def _would_refuse(hashed: list[Wanted], use: ReplicaUse | None) -> list[str]:
    """Files whose sha256 on their node differs from their replica manifest's."""
    expect = use.expect() if use is not None else {}
    return [f"{w.node}:{w.relpath}: {e.mismatch}" for w in hashed
            if (e := expect.get((w.node, w.relpath))) is not None and e.sha256 != w.sha256]


def _fall_back(source: Source, use: ReplicaUse, report: CollectReport,
               sink: ProgressSink) -> None:
    """A part whose files failed (a replica corrupted on disk, a primary file that
    differs from its replica's manifest, a read error) is read again from its next copy,
    while there is one; what is verified at DEST already is skipped."""
    while True:
        moved = [node for node, r in report.results.items() if r.failed and next_route(
            use, node, "; ".join(f"{rel}: {why}" for rel, why in list(r.failed.items())[:2]))]
        if not moved:
            return
        source.routes = use.routes
        again = _expected([w for w in report.wanted if w.node in moved], use)
        report.wanted = [w for w in report.wanted if w.node not in moved] + again
        results, _, _ = source.copy(again, {}, sink)
        for node in moved:
            old, new = report.results[node], results.get(node, NodeResult(node))
            new.copied = old.copied + new.copied
            new.bytes_copied += old.bytes_copied
            report.results[node] = new


def _tag_arg(tag: str) -> str | None:
    return None if tag == "latest" else tag


def _recorded(options: CollectOptions, plan: CollectPlan) -> set[str]:
    """The plan's files an earlier run may have verified: in DEST's state file, or
    under their final name (renamed just before a kill, not yet recorded)."""
    state_files = DestState(options.dest).files
    return {rel for rel in plan.files
            if rel in state_files or os.path.exists(os.path.join(options.dest, rel))}


def _subplan(plan: CollectPlan, rels: set[str]) -> CollectPlan:
    return dataclasses.replace(plan, files={r: c for r, c in plan.files.items() if r in rels})


def _checked_choice(plan: CollectPlan, hashes: Mapping[tuple[str, str], Hashed],
                    problems: list[str]) -> tuple[list[Wanted], list[str]]:
    wanted, notes, more = choose_sources(plan, hashes) if not problems else ([], [], [])
    if problems or more:
        raise CheckpointIncomplete(plan.tag, problems + more)
    return wanted, notes


def _unpicked_copies(plan: CollectPlan, picks: Sequence[Wanted]) -> dict[str, list[str]]:
    """Per node, the copies of duplicated files that are not sent: hashed on their node
    while the streams run, for the note on differing copies."""
    sent = {(w.node, w.relpath) for w in picks}
    out: dict[str, list[str]] = {}
    for rel, copies in plan.files.items():
        for c in copies:
            if len(copies) > 1 and (c.node, rel) not in sent:
                out.setdefault(c.node, []).append(rel)
    return out


def _prepare_dest(dest: str, tag: str) -> None:
    os.makedirs(dest, exist_ok=True)
    clean_parts(dest, tag)


def _settle_inline_hashes(report: CollectReport, inline: Sequence[Wanted],
                          hashes: Mapping[tuple[str, str], Hashed], problems: list[str],
                          dest: str) -> None:
    """The sha256 the nodes computed while sending into the manifest, and the note on
    differing duplicates once every copy's checksum is in."""
    notes, more = copy_notes(report.plan, inline, hashes)
    if (problems or more) and not report.failed:
        found = problems + more
        raise CheckpointError(
            f"source checksums of {report.plan.tag} could not be established: "
            + "; ".join(found[:6]), path=dest,
            hint="files without a matching checksum were not renamed into place; fix the "
                 "nodes named and run collect-ckpt again")
    report.notes += notes
    report.wanted = [dataclasses.replace(w, sha256=h.sha256) if not w.sha256 and (h := hashes.get(
        (w.node, w.relpath))) is not None else w for w in report.wanted]


def _finish(transport: Transport, nodes: Sequence[CollectNode], report: CollectReport,
            options: CollectOptions) -> None:
    plan = report.plan
    if report.failed:
        shown = "; ".join(f"{k}: {v}" for k, v in list(report.failed.items())[:6])
        damaged = any(REPLICA_DAMAGED in why for why in report.failed.values())
        raise CheckpointError(
            f"{len(report.failed)} file(s) of {plan.tag} failed verification or transfer "
            f"(verified files stay in DEST): {shown}", path=options.dest,
            hint="a replica that does not match its manifest is never used: bring the node "
                 "named back (or collect a tag another copy covers) and run collect-ckpt again"
            if damaged else
            "run the same command again: verified files are skipped, failed ones re-copied")
    use = report.replicas
    write_manifest(options.dest, plan, report.wanted, report.notes,
                   use.routes if use else None, use.parts_json() if use else None)
    write_latest(options.dest, plan.tag)
    if options.prune_sources:  # a node whose part came from a replica keeps what it has
        routed = use.routes if use else {}
        report.pruned = prune_sources(transport, [n for n in nodes if n.name not in routed],
                                      plan)
