"""Node program: one node's checkpoint root as one JSON line (``collect-ckpt``'s listing).

``ckpt.listing ROOT [TAG]``: the top-level files (``latest``, ``zero_to_fp32.py``),
every tag dir's files with size and mtime (only TAG's when given), the text
of the completion markers, and of the small files that say which DeepSpeed tag a
program's tag dir holds (``latest``, ``latest_universal``, the universal marker one
level down: HF's checkpoint-N after a reshard). A ``.pt`` file also says whether it is a whole zip archive
(``torch.save``'s format ends with the zip end record, so a save cut short lacks it).
Also the replica area beside the root (``<root>.replicas``, node/contract.py): per
source node index and tag, the copy's files, its manifest's text and its markers' text;
copies still in progress (``.partial-*``) only as a count per source.
Parsed by :func:`clusterkit.checkpoints.listing.parse_listing`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from clusterkit.node.contract import (
    LATEST_FILE,
    LATEST_UNIVERSAL_FILE,
    REPLICA_MANIFEST,
    REPLICA_PARTIAL_PREFIX,
    UNIVERSAL_MARKER,
    looks_like_marker,
    parse_replica_source,
    replica_area,
)

LISTING_VERSION = 3
MAX_MARKER_BYTES = 1 << 20
MAX_MANIFEST_BYTES = 16 << 20


ZIP_HEAD = b"PK\x03\x04"
ZIP_END = b"PK\x05\x06"  # end of central directory; torch.save writes no zip comment
ZIP_END_SIZE = 22


def _stat(path: str) -> list[Any]:
    s = os.stat(path)
    entry: list[Any] = [s.st_size, s.st_mtime]
    if path.endswith(".pt"):
        entry.append(whole_zip(path, s.st_size))
    return entry


def whole_zip(path: str, size: int) -> bool | None:
    """True/False for a zip archive that does/does not end with its end record; None when
    the file is not a zip (torch's legacy format) or unreadable: nothing to say then."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != ZIP_HEAD:
                return None
            if size < ZIP_END_SIZE:
                return False
            fh.seek(size - ZIP_END_SIZE)
            return fh.read(4) == ZIP_END
    except OSError:
        return None


def _pointer(rel: str) -> bool:
    """A file whose text says which DeepSpeed tag a program's tag dir holds."""
    head, name = os.path.split(rel)
    return (not head and name in (LATEST_FILE, LATEST_UNIVERSAL_FILE)) or \
        (bool(head) and "/" not in head and name == UNIVERSAL_MARKER)


def _tag(path: str) -> tuple[dict[str, list[float]], dict[str, str], dict[str, str]]:
    """(files, markers, pointer texts) of one tag dir, walked in a stable order."""
    files: dict[str, list[Any]] = {}
    marks: dict[str, str] = {}
    texts: dict[str, str] = {}
    for d, dirs, names in os.walk(path):
        dirs.sort()
        for n in sorted(names):
            f = os.path.join(d, n)
            if not os.path.isfile(f):
                continue
            rel = os.path.relpath(f, path)
            files[rel] = _stat(f)
            if d == path and looks_like_marker(n) and files[rel][0] < MAX_MARKER_BYTES:
                with open(f) as fh:
                    marks[rel] = fh.read()
            elif _pointer(rel.replace(os.sep, "/")):
                text = _read_small(f, MAX_MARKER_BYTES)
                if text is not None:
                    texts[rel.replace(os.sep, "/")] = text
    return files, marks, texts


def _read_small(path: str, limit: int) -> str | None:
    try:
        if os.path.getsize(path) >= limit:
            return None
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def _replica_copy(path: str, tag: str) -> dict[str, Any]:
    """One copy ``node<N>/<tag>/``: its files (relative to it), manifest and markers."""
    files: dict[str, list[Any]] = {}
    for d, dirs, names in os.walk(path):
        dirs.sort()
        for n in sorted(names):
            f = os.path.join(d, n)
            if os.path.isfile(f):
                files[os.path.relpath(f, path)] = _stat(f)
    manifest = (_read_small(os.path.join(path, REPLICA_MANIFEST), MAX_MANIFEST_BYTES)
                if REPLICA_MANIFEST in files else None)
    marks: dict[str, str] = {}
    for rel, st in files.items():
        head, name = os.path.split(rel)
        if head == tag and looks_like_marker(name) and st[0] < MAX_MARKER_BYTES:
            text = _read_small(os.path.join(path, rel), MAX_MARKER_BYTES)
            if text is not None:
                marks[rel] = text
    return {"files": files, "manifest": manifest, "markers": marks}


def replicas(root: str, only: str | None) -> dict[str, Any]:
    """``{"<N>": {"tags": {tag: copy | None}, "partial": count}}`` of ``<root>.replicas``
    (a tag other than ``only`` is None: named, not walked)."""
    area = replica_area(root)
    out: dict[str, Any] = {}
    names = sorted(os.listdir(area)) if os.path.isdir(area) else []
    for name in names:
        index = parse_replica_source(name)
        src = os.path.join(area, name)
        if index is None or not os.path.isdir(src):
            continue
        entry: dict[str, Any] = {"tags": {}, "partial": 0}
        for tag in sorted(os.listdir(src)):
            p = os.path.join(src, tag)
            if tag.startswith(REPLICA_PARTIAL_PREFIX):
                entry["partial"] += 1  # in progress: counted, never read as a copy
            elif os.path.isdir(p):
                entry["tags"][tag] = _replica_copy(p, tag) if only in (None, tag) else None
        out[str(index)] = entry
    return out


def listing(root: str, only: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"v": LISTING_VERSION, "root": root, "exists": os.path.isdir(root),
                           "top": {}, "latest": None, "tags": {}, "markers": {}, "texts": {},
                           "replicas": replicas(root, only)}
    if not out["exists"]:
        return out
    for name in sorted(os.listdir(root)):
        p = os.path.join(root, name)
        if os.path.isfile(p):
            out["top"][name] = _stat(p)
            if name == "latest" and out["top"][name][0] < 4096:
                with open(p) as fh:
                    out["latest"] = fh.read().strip()
        elif os.path.isdir(p) and (only is None or name == only):
            out["tags"][name], out["markers"][name], out["texts"][name] = _tag(p)
        elif os.path.isdir(p):
            out["tags"][name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    root, only = args[0], (args[1] if len(args) > 1 and args[1] else None)
    sys.stdout.write(json.dumps(listing(root, only)) + "\n")
    sys.stdout.flush()
    return 0
