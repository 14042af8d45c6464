"""One node's checkpoint root as the node program :mod:`clusterkit.node.ckpt.listing` reports
it: the command that asks for it and the parse of its JSON into a :class:`NodeListing`.
:mod:`clusterkit.checkpoints.collect.discover` verifies the listings of every node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.node.ckpt.listing import LISTING_VERSION
from clusterkit.node.protocol import answer_of
from clusterkit.ship import NodeCommand, node_command


@dataclass(frozen=True)
class FileInfo:
    size: int
    mtime: float
    whole: bool | None = None  # .pt files: ends with the zip end record (None: not a zip)


def _file_info(v: Sequence[Any]) -> FileInfo:
    return FileInfo(int(v[0]), float(v[1]), None if len(v) < 3 or v[2] is None else bool(v[2]))


@dataclass(frozen=True)
class ReplicaCopy:
    """One copy a node holds of node index ``source``'s ``tag``
    (``<root>.replicas/node<N>/<tag>/``). ``files`` are relative to that dir
    (``<tag>/...``, for node 0 also ``latest`` and the recovery scripts); ``manifest`` is
    the manifest's text, None while the copy has none (never complete then)."""

    source: int
    tag: str
    files: Mapping[str, FileInfo]
    manifest: str | None
    markers: Mapping[str, str]  # relpath -> the text of a completion marker in the copy


@dataclass(frozen=True)
class NodeReplicas:
    """What a node holds of node index ``source``: its copies by tag (None: a tag the
    listing named but did not walk) and how many copies are still in progress."""

    source: int
    copies: Mapping[str, ReplicaCopy | None] = field(default_factory=dict)
    partial: int = 0


@dataclass(frozen=True)
class NodeListing:
    """One node's checkpoint root. ``index`` is the node's position in the selection."""

    node: str
    index: int
    root: str
    exists: bool = False
    top: Mapping[str, FileInfo] = field(default_factory=dict)
    latest: str | None = None
    tags: Mapping[str, Mapping[str, FileInfo] | None] = field(default_factory=dict)
    markers: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    error: str | None = None  # unreachable / listing failed
    # tag -> relpath -> the text of ``latest``, ``latest_universal`` and a universal marker
    # one level down in that tag dir (node/ckpt/listing.py: HF's checkpoint-N)
    texts: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # The replica area beside ``root``: what this node holds of other nodes, by source index.
    replicas: Mapping[int, NodeReplicas] = field(default_factory=dict)

    def replica(self, source: int, tag: str) -> ReplicaCopy | None:
        """This node's copy of node index ``source``'s ``tag``, if listed."""
        held = self.replicas.get(source)
        return held.copies.get(tag) if held is not None else None


def parse_listing(node: str, index: int, root: str, stdout: str) -> NodeListing:
    """Parse the listing script's JSON; a malformed answer becomes ``error``."""
    try:
        raw = answer_of(stdout, "the listing")
        if not isinstance(raw, dict) or raw.get("v") != LISTING_VERSION:
            raise ValueError("unexpected listing format")
        tags: dict[str, dict[str, FileInfo] | None] = {}
        for tag, files in raw["tags"].items():
            tags[tag] = None if files is None else {rel: _file_info(v) for rel, v in files.items()}
        return NodeListing(
            node=node, index=index, root=root, exists=bool(raw["exists"]),
            top={n: _file_info(v) for n, v in raw["top"].items()},
            latest=raw["latest"], tags=tags,
            markers={t: dict(m) for t, m in raw["markers"].items()},
            texts={t: dict(m) for t, m in (raw.get("texts") or {}).items()},
            replicas=_replicas(raw.get("replicas") or {}))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        return NodeListing(node=node, index=index, root=root,
                           error=f"unreadable listing ({exc}): {stdout[:200]!r}")


def _replicas(raw: Mapping[str, Any]) -> dict[int, NodeReplicas]:
    out: dict[int, NodeReplicas] = {}
    for key, entry in raw.items():
        source = int(key)
        copies: dict[str, ReplicaCopy | None] = {}
        for tag, c in entry["tags"].items():
            copies[tag] = None if c is None else ReplicaCopy(
                source=source, tag=tag,
                files={rel: _file_info(v) for rel, v in c["files"].items()},
                manifest=c["manifest"], markers=dict(c["markers"]))
        out[source] = NodeReplicas(source, copies, int(entry.get("partial", 0)))
    return out


def listing_command(python: str, root: str, tag: str | None) -> NodeCommand:
    """The node program :mod:`clusterkit.node.ckpt.listing` for one node's root."""
    return node_command(python, "ckpt.listing", [root, tag or ""])
