"""collect-ckpt's main data path: one ``ckpt.stream`` session per node for the whole verb.

Each node's :class:`~clusterkit.checkpoints.sources.session.NodeSession` (OpenSSH ``ssh``, a
local child, or one ``srun`` task for a node reached through Slurm) lists, hashes and
streams; files are hashed on the node as they are sent, so a first run reads each
file once (:mod:`clusterkit.checkpoints.sources.transfer` receives and verifies them).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import json
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType

from clusterkit.checkpoints.collectplan import CollectPlan
from clusterkit.checkpoints.listing import NodeListing, parse_listing
from clusterkit.checkpoints.sources.base import (
    LIST_TIMEOUT_S,
    CollectNode,
    NodeHashes,
    Route,
    copies_by_node,
    list_nodes,
    todo,
)
from clusterkit.checkpoints.sources.session import NodeSession, SessionError
from clusterkit.checkpoints.sources.transfer import (
    HASH_TIMEOUT_S,
    DestState,
    Hashed,
    NodeResult,
    ProgressSink,
    Receiver,
    Wanted,
    at,
    grouped,
    parse_hashes,
    rel_under,
    stream_node,
)
from clusterkit.hostrange import folded_lines
from clusterkit.remote.base import Transport
from clusterkit.slurm.steps import srun_hint


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


class StreamSource:
    """The :class:`~clusterkit.checkpoints.sources.base.Source` over one session per node.
    ``transport`` only re-asks the nodes whose session failed (see ``_explain``)."""

    hashes_inline = True

    def __init__(self, method: str, transport: Transport, nodes: Sequence[CollectNode], *,
                 dest: str, jobs: int, fsync: bool,
                 on_start: Callable[[subprocess.Popen[bytes]], None] | None = None) -> None:
        self.method, self.transport, self.nodes = method, transport, list(nodes)
        self.dest, self.jobs, self.fsync, self.on_start = dest, jobs, fsync, on_start
        self.failed: dict[str, str] = {}
        self.sessions: dict[str, NodeSession] = {}
        self.routes: dict[str, Route] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StreamSource:
        self.sessions = self._stack.enter_context(open_sessions(self.nodes, self.failed))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.__exit__(kind, exc, tb)

    def listings(self, tag: str | None) -> list[NodeListing]:
        """Every node's listing, asked in parallel on its session."""
        def one(item: tuple[int, CollectNode]) -> NodeListing:
            index, node = item
            session = self.sessions.get(node.name)
            if session is None:
                return NodeListing(node.name, index, node.root,
                                   error=self.failed.get(node.name, "?"))
            try:
                msg = session.wait_for("listing", session.request(
                    "list", LIST_TIMEOUT_S + session.startup_s, tag=tag))
            except SessionError as exc:
                return NodeListing(node.name, index, node.root, error=_cannot_list(session, exc))
            return parse_listing(node.name, index, node.root, json.dumps(msg.get("listing")))

        with cf.ThreadPoolExecutor(max_workers=min(64, len(self.nodes) or 1)) as pool:
            found = list(pool.map(one, enumerate(self.nodes)))
        self.method = self._carried()  # each session chose its path at its first answer
        return self._explain(found, tag)

    def _explain(self, listings: list[NodeListing], tag: str | None) -> list[NodeListing]:
        """OpenSSH's words carry each node's address, so equal failures would not fold;
        the paramiko transport classifies them (refused, auth, timeout, ...) like every
        other verb does. Asked only for the nodes whose session failed, and never for
        nodes reached through Slurm (no SSH there)."""
        bad = [n for n, ls in zip(self.nodes, listings, strict=True)
               if ls.error and n.via is None]
        if not bad or all(n.target.local for n in bad):
            return listings
        again = {ls.node: ls for ls in list_nodes(self.transport, bad, tag)}
        return [dataclasses.replace(again[ls.node], index=ls.index)
                if ls.error and ls.node in again and again[ls.node].error else ls
                for ls in listings]

    def _units(self, logical: set[str]) -> dict[str, list[str]]:
        """Session (node name) -> the logical nodes whose files it reads, its own first:
        a part completed from a replica is read on its holder's session, after the
        holder's own files (one request at a time per session)."""
        out: dict[str, list[str]] = {}
        for n in self.nodes:
            if n.name in logical and n.name not in self.routes:
                out.setdefault(n.name, []).append(n.name)
        for name in sorted(logical & set(self.routes)):
            out.setdefault(self.routes[name].holder, []).append(name)
        return out

    def _label(self, logical: str) -> str:
        """How progress names a node's files: whose they are, and where they are read."""
        route = self.routes.get(logical)
        return f"{logical} (replica on {route.holder})" if route is not None else logical

    def _base(self, logical: str) -> str:
        route = self.routes.get(logical)
        return route.base if route is not None else ""

    def hashes(self, plan: CollectPlan) -> tuple[NodeHashes, list[str]]:
        """sha256 of every copy of every planned file, on its node, before any copy."""
        by_node = copies_by_node(plan)
        units = self._units(set(by_node))

        def one(holder: str) -> list[tuple[str, dict[str, Hashed], dict[str, str], str]]:
            session = self.sessions[holder]
            out: list[tuple[str, dict[str, Hashed], dict[str, str], str]] = []
            for logical in units[holder]:
                base = self._base(logical)
                try:
                    msg = session.wait_for("hashes", session.request(
                        "hash", HASH_TIMEOUT_S,
                        files=[at(base, r) for r in by_node[logical]]))
                    files, errors = parse_hashes(json.dumps(msg))
                except (SessionError, ValueError, KeyError, TypeError) as exc:
                    out.append((logical, {}, {}, str(exc)))
                    continue
                out.append((logical, {rel_under(base, k): v for k, v in files.items()},
                            {rel_under(base, k): v for k, v in errors.items()}, ""))
            return out

        with cf.ThreadPoolExecutor(max_workers=min(64, len(units) or 1)) as pool:
            answers = [a for batch in pool.map(one, list(units)) for a in batch]
        hashes: NodeHashes = {}
        problems = folded_lines([(name, f"cannot hash ({why})")
                                 for name, _, _, why in answers if why],
                                [name for name, _, _, _ in answers])
        for name, files, errors, _ in answers:
            problems += [f"{name}: cannot read {rel}: {why}" for rel, why in errors.items()]
            hashes.update({(name, rel): h for rel, h in files.items()})
        return hashes, problems

    def copy(self, wanted: Sequence[Wanted], hash_only: Mapping[str, Sequence[str]],
             sink: ProgressSink) -> tuple[dict[str, NodeResult], NodeHashes, list[str]]:
        """Stream what is not yet verified at DEST, ``--jobs`` nodes at once; each node
        also hashes its ``hash_only`` files meanwhile."""
        state = DestState(self.dest)
        results: dict[str, NodeResult] = {}
        per_node = grouped(todo(wanted, state, sink, results))
        sink.begin({self._label(n): sum(w.size for w in ws) for n, ws in per_node.items()})
        units = self._units({n for n in per_node} | {n for n, rels in hash_only.items() if rels})
        hashes: NodeHashes = {}
        problems: list[str] = []

        def work(holder: str) -> None:
            session = self.sessions[holder]
            if self.on_start is not None:
                self.on_start(session.proc)
            for name in units[holder]:
                result = results.setdefault(name, NodeResult(name))
                t0 = time.monotonic()
                receiver = Receiver(self.dest, state, sink, self._label(name), result,
                                    self.fsync)
                got = stream_node(session, per_node.get(name, []), hash_only.get(name, ()),
                                  receiver, self._base(name))
                result.seconds = time.monotonic() - t0
                hashes.update({(name, rel): h for rel, h in got.hashes.items()})
                problems.extend(f"{name}: cannot hash {rel}: {why}"
                                for rel, why in got.hash_errors.items())

        pool = cf.ThreadPoolExecutor(max_workers=max(1, min(self.jobs, len(units) or 1)),
                                     thread_name_prefix="clusterkit-collect")
        try:
            list(pool.map(work, list(units)))
        except BaseException:
            for s in self.sessions.values():  # readers blocked on a session return at once
                s.kill("collect-ckpt stopped")
            raise
        finally:
            pool.shutdown(wait=True)
            state.flush()
            sink.end()
        return results, hashes, problems

    def _carried(self) -> str:
        """What carried the bytes, for the report's "via ...": through Slurm, a socket
        per node, or srun's stdout where a node could not connect back (and why)."""
        if self.method != "slurm":
            return self.method
        slow = [(name, s.fallback) for name, s in sorted(self.sessions.items()) if s.fallback]
        if not slow:
            return "slurm (a socket per node)"
        lines = folded_lines([(name, f"srun's stdout, slower: {why}") for name, why in slow],
                             [name for name, _ in slow])
        return "slurm (" + "; ".join(lines) + ")"


def _cannot_list(session: NodeSession, exc: SessionError) -> str:
    """The listing error; srun's words get what to do about them (no SSH to re-ask)."""
    text = f"cannot list ({session.carrier}): {exc}"
    hint = srun_hint(text) if session.via is not None else None
    return f"{text} — {hint}" if hint else text
