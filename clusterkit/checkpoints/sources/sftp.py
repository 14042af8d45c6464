"""collect-ckpt's fallback data path (``--via sftp``, or no ``ssh`` binary here).

The transport does everything in phases: one ``run_all`` of the listing program, one
of the hashing program (every file is hashed on its node before the copy, since SFTP
cannot hash while sending), then paramiko SFTP (:meth:`Transport.get`) per file.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Mapping, Sequence
from types import TracebackType

from clusterkit.checkpoints.collectplan import CollectPlan
from clusterkit.checkpoints.listing import NodeListing
from clusterkit.checkpoints.sources.base import (
    CollectNode,
    NodeHashes,
    Route,
    copies_by_node,
    list_nodes,
    shared_stdin,
    todo,
)
from clusterkit.checkpoints.sources.transfer import (
    HASH_TIMEOUT_S,
    DestState,
    NodeResult,
    ProgressSink,
    Wanted,
    fetch_sftp,
    grouped,
    hash_command,
    parse_hashes,
)
from clusterkit.hostrange import folded_lines
from clusterkit.remote.base import Transport


class SftpSource:
    """The :class:`~clusterkit.checkpoints.sources.base.Source` over the transport alone."""

    method = "sftp"
    hashes_inline = False

    def __init__(self, transport: Transport, nodes: Sequence[CollectNode], *,
                 dest: str, jobs: int, fsync: bool) -> None:
        self.transport, self.nodes = transport, list(nodes)
        self.dest, self.jobs, self.fsync = dest, jobs, fsync
        self.routes: dict[str, Route] = {}  # refused by the verb: --via ssh follows them

    def __enter__(self) -> SftpSource:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None  # nothing held open between the phases

    def listings(self, tag: str | None) -> list[NodeListing]:
        return list_nodes(self.transport, self.nodes, tag)

    def hashes(self, plan: CollectPlan) -> tuple[NodeHashes, list[str]]:
        """sha256 of every copy of every planned file, computed on its node (one run_all)."""
        by_node = copies_by_node(plan)
        involved = [n for n in self.nodes if n.name in by_node]
        cmds = {n.name: hash_command(n.python, n.root, by_node[n.name]) for n in involved}
        group = self.transport.run_all([n.target for n in involved],
                                       {k: c.argv for k, c in cmds.items()},
                                       timeout=HASH_TIMEOUT_S, stdin=shared_stdin(cmds))
        hashes: NodeHashes = {}
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

    def copy(self, wanted: Sequence[Wanted], hash_only: Mapping[str, Sequence[str]],
             sink: ProgressSink) -> tuple[dict[str, NodeResult], NodeHashes, list[str]]:
        """SFTP, ``--jobs`` nodes at once. Every checksum is already known (hashed in
        its own phase), so ``hash_only`` is empty and no hashes come back."""
        state = DestState(self.dest)
        results: dict[str, NodeResult] = {}
        per_node = grouped(todo(wanted, state, sink, results))
        sink.begin({n: sum(w.size for w in ws) for n, ws in per_node.items()})
        by_name = {n.name: n for n in self.nodes}

        def work(name: str) -> None:
            node, t0 = by_name[name], time.monotonic()
            fetch_sftp(self.transport, node.target, node.root, per_node[name], self.dest, state,
                       sink, results[name], fsync=self.fsync)
            results[name].seconds = time.monotonic() - t0

        try:
            with cf.ThreadPoolExecutor(max_workers=max(1, min(self.jobs, len(per_node) or 1)),
                                       thread_name_prefix="clusterkit-collect") as pool:
                list(pool.map(work, per_node))
        finally:
            state.flush()
            sink.end()
        return results, {}, []
