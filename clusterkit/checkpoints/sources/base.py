"""The one interface behind collect-ckpt's data paths, and what every path shares.

A :class:`Source` lists every node, hashes chosen files on their nodes and copies
the chosen copy of each file to DEST. Two implement it:
:class:`~clusterkit.checkpoints.sources.stream.StreamSource` (one ``ckpt.stream`` session
per node, carried by OpenSSH, a local child or ``srun``: methods ``ssh`` and ``slurm``)
and :class:`~clusterkit.checkpoints.sources.sftp.SftpSource` (the transport's
``run_all`` and paramiko SFTP: method ``sftp``). The verb
(:mod:`clusterkit.checkpoints.collect.verb`) speaks only this interface.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from clusterkit.checkpoints.collectplan import CollectPlan
from clusterkit.checkpoints.listing import NodeListing, listing_command, parse_listing
from clusterkit.checkpoints.sources.transfer import DestState, Hashed, NodeResult, ProgressSink, Wanted
from clusterkit.remote.base import SSHTarget, Transport
from clusterkit.ship import NodeCommand
from clusterkit.slurm.steps import SlurmPlace

LIST_TIMEOUT_S = 60.0

# (node, relpath) -> the checksum its node computed.
NodeHashes = dict[tuple[str, str], Hashed]


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
class Route:
    """A node's files read elsewhere: on ``holder``'s session, under ``base`` (its
    replica of the node's part, :mod:`clusterkit.checkpoints.collect.fromreplicas`)."""

    holder: str
    base: str


class Source(Protocol):
    """Where collect-ckpt's bytes come from. Used as a context manager: whatever it
    holds open (one session per node) lives from the listing to the last byte."""

    method: str  # what the report names: ssh, slurm or sftp
    # True when copy() hashes on the node what it sends: the verb then hashes up front
    # only what it must (a dry run, files DEST may already hold).
    hashes_inline: bool
    # Logical node -> where its files are read (parts completed from replicas); set by
    # the verb after the listing. A source that cannot follow routes refuses them.
    routes: dict[str, Route]

    def __enter__(self) -> Source: ...

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...

    def listings(self, tag: str | None) -> list[NodeListing]:
        """Every node's listing, in node order; an unreachable node's carries an error."""
        ...

    def hashes(self, plan: CollectPlan) -> tuple[NodeHashes, list[str]]:
        """sha256 of every copy of every file in ``plan``, on its node: (hashes, problems)."""
        ...

    def copy(self, wanted: Sequence[Wanted], hash_only: Mapping[str, Sequence[str]],
             sink: ProgressSink) -> tuple[dict[str, NodeResult], NodeHashes, list[str]]:
        """``wanted`` into DEST (what is not verified there yet), each node hashing its
        ``hash_only`` files meanwhile: (results per node, node hashes, problems)."""
        ...


def list_nodes(transport: Transport, nodes: Sequence[CollectNode], tag: str | None
               ) -> list[NodeListing]:
    """One ``run_all`` of the listing script; unreachable nodes become listing errors."""
    cmds = {n.name: listing_command(n.python, n.root, tag) for n in nodes}
    group = transport.run_all([n.target for n in nodes], {k: c.argv for k, c in cmds.items()},
                              timeout=LIST_TIMEOUT_S, stdin=shared_stdin(cmds))
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


def shared_stdin(cmds: Mapping[str, NodeCommand]) -> bytes | None:
    """One node program's stdin (its sources), the same for every node."""
    return next(iter(cmds.values())).stdin if cmds else None


def copies_by_node(plan: CollectPlan) -> dict[str, list[str]]:
    """Per node, the relpaths of every copy it holds of the plan's files."""
    by_node: dict[str, list[str]] = {}
    for copies in plan.files.values():
        for c in copies:
            by_node.setdefault(c.node, []).append(c.relpath)
    return by_node


def todo(wanted: Sequence[Wanted], state: DestState, sink: ProgressSink,
         results: dict[str, NodeResult]) -> list[Wanted]:
    """The files not yet verified at DEST (a file with a known sha256 may be)."""
    out: list[Wanted] = []
    for w in wanted:
        results.setdefault(w.node, NodeResult(w.node))
        if w.sha256 and state.is_verified(w):
            results[w.node].skipped.append(w.relpath)
            sink.file_done(w.node, w.relpath, w.size, "skipped")
        else:
            out.append(w)
    return out
