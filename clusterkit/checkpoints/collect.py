"""collect-ckpt: list -> verify -> pick one copy per file -> stream, hashed on both ends.

One session per node (:mod:`clusterkit.checkpoints.session`) does all of it over one
connection. Nothing is copied until every node has been listed and the checkpoint is
known to be complete and consistent (:func:`clusterkit.checkpoints.discover.verify`);
no file takes its final name before the sha256 its node computed while reading it
equals the one computed here while writing it. DEST then
looks like a shared-storage checkpoint root: ``latest``, ``zero_to_fp32.py`` and
``<tag>/`` holding every shard, every node's completion marker and
``clusterkit-collect.json`` (the manifest ``--scatter`` uses).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import json
import os
import posixpath
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.checkpoints import layout
from clusterkit.checkpoints.discover import (
    CheckpointIncomplete,
    CollectPlan,
    NodeListing,
    WithoutMarkers,
    listing_command,
    parse_listing,
    verify,
)
from clusterkit.checkpoints.session import NodeSession, SessionError
from clusterkit.checkpoints.transfer import (
    HASH_TIMEOUT_S,
    DestState,
    Hashed,
    NodeResult,
    NullProgress,
    ProgressSink,
    Receiver,
    Wanted,
    clean_parts,
    fetch_sftp,
    grouped,
    hash_command,
    have_ssh_binary,
    parse_hashes,
    stream_node,
)
from clusterkit.errors import CheckpointError
from clusterkit.fsutil import atomic_write_text
from clusterkit.hostrange import folded_lines
from clusterkit.node.ship import NodeCommand
from clusterkit.remote.base import SSHTarget, Transport
from clusterkit.slurm.steps import SlurmPlace, run_step, srun_hint

MANIFEST = "clusterkit-collect.json"
MANIFEST_SCHEMA = "clusterkit.collected-checkpoint"
LIST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CollectNode:
    """One selected node: how to reach it and where its checkpoint root is. With
    ``via``, every program runs there through Slurm (srun) and ``target`` is unused."""

    name: str
    target: SSHTarget
    python: str
    root: str
    via: SlurmPlace | None = None


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

    @property
    def bytes_copied(self) -> int:
        return sum(r.bytes_copied for r in self.results.values())

    @property
    def failed(self) -> dict[str, str]:
        return {f"{n}:{rel}": why for n, r in self.results.items() for rel, why in r.failed.items()}

    @property
    def skipped(self) -> int:
        return sum(len(r.skipped) for r in self.results.values())


# ------------------------------------------------------------------ listing


def list_nodes(transport: Transport, nodes: Sequence[CollectNode], tag: str | None
               ) -> list[NodeListing]:
    """One ``run_all`` of the listing script; unreachable nodes become listing errors."""
    cmds = {n.name: listing_command(n.python, n.root, tag) for n in nodes}
    group = transport.run_all([n.target for n in nodes], {k: c.argv for k, c in cmds.items()},
                              timeout=LIST_TIMEOUT_S, stdin=_shared_stdin(cmds))
    out: list[NodeListing] = []
    for index, (node, res) in enumerate(zip(nodes, group, strict=True)):
        if res.error is not None:
            out.append(NodeListing(node.name, index, node.root,
                                   error=f"cannot list ({res.error.kind}): {res.error.message}"))
        elif res.result is None or not res.result.ok:
            why = (res.result.stderr.strip().splitlines() or ["no output"])[-1] if res.result else "?"
            code = res.result.exit_code if res.result else "?"
            out.append(NodeListing(node.name, index, node.root,
                                   error=f"listing failed (exit {code}): {why}"))
        else:
            out.append(parse_listing(node.name, index, node.root, res.result.stdout))
    return out


def _shared_stdin(cmds: Mapping[str, NodeCommand]) -> bytes | None:
    """One node program's stdin (its sources), the same for every node."""
    return next(iter(cmds.values())).stdin if cmds else None


def discover(transport: Transport, nodes: Sequence[CollectNode], tag: str = "latest",
             without_markers: WithoutMarkers | None = None) -> CollectPlan:
    listings = list_nodes(transport, nodes, None if tag == "latest" else tag)
    return verify(listings, tag, without_markers)


# ------------------------------------------------------------------ hashing


def hash_sources(transport: Transport, nodes: Sequence[CollectNode], plan: CollectPlan
                 ) -> tuple[dict[tuple[str, str], Hashed], list[str]]:
    """sha256 of every copy of every planned file, computed on its node (one run_all)."""
    by_node: dict[str, list[str]] = {}
    for copies in plan.files.values():
        for c in copies:
            by_node.setdefault(c.node, []).append(c.relpath)
    involved = [n for n in nodes if n.name in by_node]
    cmds = {n.name: hash_command(n.python, n.root, by_node[n.name]) for n in involved}
    group = transport.run_all([n.target for n in involved], {k: c.argv for k, c in cmds.items()},
                              timeout=HASH_TIMEOUT_S, stdin=_shared_stdin(cmds))
    hashes: dict[tuple[str, str], Hashed] = {}
    problems = folded_lines([(r.host, f"cannot hash ({r.reason()})") for r in group.failed],
                            [n.name for n in involved])
    for node, res in zip(involved, group, strict=True):
        if res.result is None or not res.ok:
            continue  # reported above, folded with the nodes that failed the same way
        try:
            files, errors = parse_hashes(res.result.stdout)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            problems.append(f"{node.name}: unreadable hash output ({exc})")
            continue
        problems += [f"{node.name}: cannot read {rel}: {why}" for rel, why in errors.items()]
        for rel, h in files.items():
            hashes[(node.name, rel)] = h
    return hashes, problems


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
                         f"kept {w.node}'s (global rank 0 writes the complete model states)")
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
                         f"kept {src.node}'s (global rank 0 writes the complete model states)")
        h = hashes[(src.node, rel)]
        load[src.node] = load.get(src.node, 0) + h.size
        wanted.append(Wanted(node=src.node, relpath=rel, size=h.size, sha256=h.sha256))
    return wanted, notes, problems


# ------------------------------------------------------------------ sessions


@contextlib.contextmanager
def open_sessions(nodes: Sequence[CollectNode], failed: dict[str, str]
                  ) -> Iterator[dict[str, NodeSession]]:
    """One session per node for the whole verb; killed on any error or Ctrl-C. A node
    whose session cannot even start (no ``ssh``/python here) lands in ``failed``."""
    sessions: dict[str, NodeSession] = {}
    try:
        for n in nodes:
            try:
                sessions[n.name] = NodeSession(n.name, n.target, n.python, n.root, via=n.via)
            except OSError as exc:
                failed[n.name] = f"cannot start ({exc})"
        yield sessions
    except BaseException:
        for s in sessions.values():
            s.kill("collect-ckpt stopped")
        raise
    finally:
        with cf.ThreadPoolExecutor(max_workers=min(64, len(sessions) or 1)) as pool:
            list(pool.map(NodeSession.close, sessions.values()))


def list_over_sessions(transport: Transport, sessions: Mapping[str, NodeSession],
                       nodes: Sequence[CollectNode], tag: str | None,
                       failed: Mapping[str, str]) -> list[NodeListing]:
    """Every node's listing, asked in parallel on its session."""
    def one(item: tuple[int, CollectNode]) -> NodeListing:
        index, node = item
        session = sessions.get(node.name)
        if session is None:
            return NodeListing(node.name, index, node.root, error=failed.get(node.name, "?"))
        try:
            msg = session.wait_for("listing", session.request(
                "list", LIST_TIMEOUT_S + session.startup_s, tag=tag))
        except SessionError as exc:
            return NodeListing(node.name, index, node.root, error=_cannot_list(session, exc))
        return parse_listing(node.name, index, node.root, json.dumps(msg.get("listing")))

    with cf.ThreadPoolExecutor(max_workers=min(64, len(nodes) or 1)) as pool:
        listings = list(pool.map(one, enumerate(nodes)))
    return _explain_failures(transport, nodes, listings, tag)


def _cannot_list(session: NodeSession, exc: SessionError) -> str:
    """The listing error; srun's words get what to do about them (no SSH to re-ask)."""
    text = f"cannot list ({session.carrier}): {exc}"
    hint = srun_hint(text) if session.via is not None else None
    return f"{text} — {hint}" if hint else text


def _explain_failures(transport: Transport, nodes: Sequence[CollectNode],
                      listings: list[NodeListing], tag: str | None) -> list[NodeListing]:
    """OpenSSH's words carry each node's address, so equal failures would not fold;
    the paramiko transport classifies them (refused, auth, timeout, ...) like every
    other verb does. Asked only for the nodes whose session failed, and never for
    nodes reached through Slurm (no SSH there)."""
    bad = [n for n, ls in zip(nodes, listings, strict=True) if ls.error and n.via is None]
    if not bad or all(n.target.local for n in bad):
        return listings
    again = {ls.node: ls for ls in list_nodes(transport, bad, tag)}
    return [dataclasses.replace(again[ls.node], index=ls.index)
            if ls.error and ls.node in again and again[ls.node].error else ls for ls in listings]


def hash_over_sessions(sessions: Mapping[str, NodeSession], nodes: Sequence[CollectNode],
                       plan: CollectPlan) -> tuple[dict[tuple[str, str], Hashed], list[str]]:
    """sha256 of every copy of every planned file, on its node, before any copy."""
    by_node = _copies_by_node(plan)
    involved = [n for n in nodes if n.name in by_node]

    def one(node: CollectNode) -> tuple[dict[str, Hashed], dict[str, str], str]:
        session = sessions[node.name]
        try:
            msg = session.wait_for("hashes", session.request(
                "hash", HASH_TIMEOUT_S, files=by_node[node.name]))
            files, errors = parse_hashes(json.dumps(msg))
        except (SessionError, ValueError, KeyError, TypeError) as exc:
            return {}, {}, str(exc)
        return files, errors, ""

    with cf.ThreadPoolExecutor(max_workers=min(64, len(involved) or 1)) as pool:
        answers = list(pool.map(one, involved))
    hashes: dict[tuple[str, str], Hashed] = {}
    problems = folded_lines([(n.name, f"cannot hash ({why})")
                             for n, (_, _, why) in zip(involved, answers, strict=True) if why],
                            [n.name for n in involved])
    for node, (files, errors, _) in zip(involved, answers, strict=True):
        problems += [f"{node.name}: cannot read {rel}: {why}" for rel, why in errors.items()]
        hashes.update({(node.name, rel): h for rel, h in files.items()})
    return hashes, problems


def _copies_by_node(plan: CollectPlan) -> dict[str, list[str]]:
    by_node: dict[str, list[str]] = {}
    for copies in plan.files.values():
        for c in copies:
            by_node.setdefault(c.node, []).append(c.relpath)
    return by_node


# ------------------------------------------------------------------ transfer


def resolve_method(method: str, nodes: Sequence[CollectNode] = ()) -> str:
    if method == "slurm" and not all(n.via is not None for n in nodes):
        raise CheckpointError("--via slurm needs every node's Slurm place", key="--via",
                              hint="collect a Slurm job (JOB or its job dir), or drop --via slurm")
    if method == "auto" and nodes and all(n.via is not None for n in nodes):
        return "slurm"
    if method == "auto":
        return "ssh" if have_ssh_binary() else "sftp"
    if method == "ssh" and not have_ssh_binary():
        raise CheckpointError("--via ssh needs the OpenSSH 'ssh' program on PATH",
                              hint="install openssh-client, or use --via sftp")
    return method


def _todo(wanted: Sequence[Wanted], state: DestState, sink: ProgressSink,
          results: dict[str, NodeResult]) -> list[Wanted]:
    """The files not yet verified at DEST (a file with a known sha256 may be)."""
    todo: list[Wanted] = []
    for w in wanted:
        results.setdefault(w.node, NodeResult(w.node))
        if w.sha256 and state.is_verified(w):
            results[w.node].skipped.append(w.relpath)
            sink.file_done(w.node, w.relpath, w.size, "skipped")
        else:
            todo.append(w)
    return todo


def transfer(sessions: Mapping[str, NodeSession], nodes: Sequence[CollectNode],
             wanted: Sequence[Wanted], hash_only: Mapping[str, Sequence[str]],
             options: CollectOptions, sink: ProgressSink,
             on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
             ) -> tuple[dict[str, NodeResult], dict[tuple[str, str], Hashed], list[str]]:
    """Stream what is not yet verified at DEST, ``--jobs`` nodes at once; each node also
    hashes its ``hash_only`` files meanwhile. Returns (results, node hashes, problems)."""
    state = DestState(options.dest)
    results: dict[str, NodeResult] = {}
    per_node = grouped(_todo(wanted, state, sink, results))
    sink.begin({n: sum(w.size for w in ws) for n, ws in per_node.items()})
    units = [n for n in nodes if n.name in per_node or hash_only.get(n.name)]
    hashes: dict[tuple[str, str], Hashed] = {}
    problems: list[str] = []

    def work(node: CollectNode) -> None:
        session = sessions[node.name]
        result = results.setdefault(node.name, NodeResult(node.name))
        if on_start is not None:
            on_start(session.proc)
        t0 = time.monotonic()
        receiver = Receiver(options.dest, state, sink, node.name, result, options.fsync)
        got = stream_node(session, per_node.get(node.name, []), hash_only.get(node.name, ()),
                          receiver)
        result.seconds = time.monotonic() - t0
        hashes.update({(node.name, rel): h for rel, h in got.hashes.items()})
        problems.extend(f"{node.name}: cannot hash {rel}: {why}"
                        for rel, why in got.hash_errors.items())

    pool = cf.ThreadPoolExecutor(max_workers=max(1, min(options.jobs, len(units) or 1)),
                                 thread_name_prefix="clusterkit-collect")
    try:
        list(pool.map(work, units))
    except BaseException:
        for s in sessions.values():  # readers blocked on a session return at once
            s.kill("collect-ckpt stopped")
        raise
    finally:
        pool.shutdown(wait=True)
        state.flush()
        sink.end()
    return results, hashes, problems


def transfer_sftp(transport: Transport, nodes: Sequence[CollectNode], wanted: Sequence[Wanted],
                  options: CollectOptions, sink: ProgressSink) -> dict[str, NodeResult]:
    """The fallback data path: paramiko SFTP, ``--jobs`` nodes at once."""
    state = DestState(options.dest)
    results: dict[str, NodeResult] = {}
    per_node = grouped(_todo(wanted, state, sink, results))
    sink.begin({n: sum(w.size for w in ws) for n, ws in per_node.items()})
    by_name = {n.name: n for n in nodes}

    def work(name: str) -> None:
        node, t0 = by_name[name], time.monotonic()
        fetch_sftp(transport, node.target, node.root, per_node[name], options.dest, state, sink,
                   results[name], fsync=options.fsync)
        results[name].seconds = time.monotonic() - t0

    try:
        with cf.ThreadPoolExecutor(max_workers=max(1, min(options.jobs, len(per_node) or 1)),
                                   thread_name_prefix="clusterkit-collect") as pool:
            list(pool.map(work, per_node))
    finally:
        state.flush()
        sink.end()
    return results


# ------------------------------------------------------------------ manifest / latest


def manifest_dict(plan: CollectPlan, wanted: Sequence[Wanted], notes: Sequence[str]
                  ) -> dict[str, Any]:
    return {
        "schema": MANIFEST_SCHEMA, "schema_version": 1, "tag": plan.tag, "step": plan.step,
        "zero_stage": plan.zero_stage, "world_size": plan.world_size, "engine": plan.engine,
        "ds_subdir": plan.ds_subdir, "precision": plan.precision,
        "nodes": [{"node": n.node, "node_index": n.node_index, "host": n.host,
                   "ranks": list(n.ranks),
                   "rank_files": {str(r): list(f) for r, f in n.rank_files.items()}}
                  for n in plan.nodes],
        "files": {w.relpath: {"size": w.size, "sha256": w.sha256, "source": w.node,
                              "copies": [c.node for c in plan.files[w.relpath]]}
                  for w in sorted(wanted, key=lambda w: w.relpath)},
        "notes": list(notes), "created_unix": time.time(),
    }


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
        with open(os.path.join(dest, layout.LATEST_FILE), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _write_latest(dest: str, tag: str) -> None:
    """Point DEST/latest at ``tag`` unless it already names a newer collected step."""
    current = latest_tag_at(dest)
    if current and current != tag and os.path.isfile(os.path.join(dest, current, MANIFEST)):
        cur, new = layout.parse_step_tag(current), layout.parse_step_tag(tag)
        if cur is not None and new is not None and cur > new:
            return
    atomic_write_text(os.path.join(dest, layout.LATEST_FILE), tag)


# ------------------------------------------------------------------ the verb


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
    method = resolve_method(options.method, nodes)
    if method == "sftp":
        return _collect_sftp(transport, nodes, options, sink, after_hash, on_plan)
    t0 = time.monotonic()
    failed: dict[str, str] = {}
    with open_sessions(nodes, failed) as sessions:
        plan = verify(list_over_sessions(transport, sessions, nodes, _tag_arg(options.tag),
                                         failed), options.tag, options.without_markers)
        if on_plan is not None:
            on_plan(plan)
        report = CollectReport(plan=plan, wanted=[], notes=list(plan.notes),
                               seconds_list=time.monotonic() - t0)
        # Hashed before the copy: everything for a dry run (it reports the checksums)
        # and the test hook; on a re-run only what DEST has a record of (to skip it if
        # verified). The rest is read once, hashed on its node as it is sent.
        first = plan if options.dry_run or after_hash else _subplan(plan, _recorded(options, plan))
        if first.files:
            t1 = time.monotonic()
            report.wanted, notes = _checked_choice(first, *hash_over_sessions(sessions, nodes, first))
            report.notes += notes
            report.seconds_hash = time.monotonic() - t1
        if options.dry_run:
            return report
        if after_hash is not None:
            after_hash(plan)
        rest = _subplan(plan, set(plan.files) - set(first.files))
        inline = pick_sources(rest)
        report.wanted += inline
        report.method = method
        _prepare_dest(options.dest, plan.tag)
        t2 = time.monotonic()
        report.results, hashes, problems = transfer(
            sessions, nodes, report.wanted, _unpicked_copies(rest, inline), options, sink,
            on_start)
        report.seconds_copy = time.monotonic() - t2
    _settle_inline_hashes(report, inline, hashes, problems, options.dest)
    _finish(transport, nodes, report, options)
    return report


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
        raise CheckpointError(
            f"{len(report.failed)} file(s) of {plan.tag} failed verification or transfer "
            f"(verified files stay in DEST): {shown}", path=options.dest,
            hint="run the same command again: verified files are skipped, failed ones re-copied")
    atomic_write_text(os.path.join(options.dest, plan.tag, MANIFEST),
                      json.dumps(manifest_dict(plan, report.wanted, report.notes), indent=1) + "\n")
    _write_latest(options.dest, plan.tag)
    if options.prune_sources:
        report.pruned = prune_sources(transport, nodes, plan)


def _collect_sftp(transport: Transport, nodes: Sequence[CollectNode], options: CollectOptions,
                  sink: ProgressSink, after_hash: Callable[[CollectPlan], None] | None,
                  on_plan: Callable[[CollectPlan], None] | None) -> CollectReport:
    """``--via sftp``: paramiko for everything, in phases (list, hash, copy)."""
    t0 = time.monotonic()
    plan = discover(transport, nodes, options.tag, options.without_markers)
    if on_plan is not None:
        on_plan(plan)
    t1 = time.monotonic()
    wanted, notes = _checked_choice(plan, *hash_sources(transport, nodes, plan))
    report = CollectReport(plan=plan, wanted=wanted, notes=[*plan.notes, *notes], seconds_list=t1 - t0,
                           seconds_hash=time.monotonic() - t1)
    if options.dry_run:
        return report
    if after_hash is not None:
        after_hash(plan)
    report.method = "sftp"
    _prepare_dest(options.dest, plan.tag)
    t2 = time.monotonic()
    report.results = transfer_sftp(transport, nodes, report.wanted, options, sink)
    report.seconds_copy = time.monotonic() - t2
    _finish(transport, nodes, report, options)
    return report


def prune_sources(transport: Transport, nodes: Sequence[CollectNode], plan: CollectPlan
                  ) -> dict[str, str]:
    """Delete the collected tag's files on every node (only after DEST verified them);
    over SSH, or through Slurm for nodes reached that way."""
    argv: dict[str, list[str]] = {}
    for n in nodes:
        rels = sorted({c.relpath for copies in plan.files.values() for c in copies
                       if c.node == n.name and c.relpath.startswith(plan.tag + "/")})
        if rels:
            paths = [posixpath.join(n.root, r) for r in rels]
            script = 'rm -f -- "$@" && find "$0" -depth -type d -empty -delete'
            argv[n.name] = ["sh", "-c", script, posixpath.join(n.root, plan.tag), *paths]
    out = _prune_through_slurm([n for n in nodes if n.name in argv and n.via is not None], argv)
    chosen = [n for n in nodes if n.name in argv and n.via is None]
    group = transport.run_all([n.target for n in chosen], argv, timeout=LIST_TIMEOUT_S)
    for n, res in zip(chosen, group, strict=True):
        out[n.name] = "ok" if res.ok else (res.error.message if res.error else
                                           (res.result.stderr.strip() if res.result else "?"))
    return out


def _prune_through_slurm(nodes: Sequence[CollectNode], argv: Mapping[str, list[str]]
                         ) -> dict[str, str]:
    def one(n: CollectNode) -> str:
        assert n.via is not None
        res = run_step(n.via, argv[n.name], LIST_TIMEOUT_S + n.via.startup_s)
        tail = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        return "ok" if res.returncode == 0 else tail

    with cf.ThreadPoolExecutor(max_workers=min(64, len(nodes) or 1)) as pool:
        return dict(zip([n.name for n in nodes], pool.map(one, nodes), strict=True))
