"""A synced directory on disk: its manifest, its digest, what a node still needs, partials.

Shared by the node program ``dist`` (shipped, ``node/ship.py``) and the launcher
(``clusterkit.remote.distribute``, which imports the same definitions), so both ends
read one spelling of the layout, the chunk size and the digest. Standard library
only, Python >= 3.8 on the node.

Layout under a synced directory ``DEST``::

    DEST/.clusterkit-sync/manifest.json   what this node holds (written last, atomically)
    DEST/.clusterkit-sync/partial/<sha>   a file being received, by its sha256 (kept
                                          across runs: its verified chunks are reused)

A file is one or more **chunks** of :data:`CHUNK` bytes (the last one shorter); the
source's manifest gives each chunk's sha256, and a receiver checks every chunk against
it on arrival. A file of one chunk: its chunk sha256 is the file's sha256.

The **digest** of a directory (:func:`tree_digest`) is the sha256 of its sorted
``(path, size, sha256)`` rows: equal digests, equal contents (mode and mtime are not
part of it). The launcher computes it from the source, each node from its manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Any

STATE_DIR = ".clusterkit-sync"
MANIFEST = STATE_DIR + "/manifest.json"
PARTIAL_DIR = STATE_DIR + "/partial"
MANIFEST_VERSION = 1
CHUNK = 64 << 20  # per-chunk sha256: a cut-short 14 GB file resumes within 64 MiB
READ = 1 << 20

# A source entry, as the launcher sends it: [rel, size, mtime_ns, mode, sha256, [chunk sha256]].
REL, SIZE, MTIME, MODE, SHA, CHUNKS = range(6)


def chunk_count(size: int) -> int:
    return max(1, -(-size // CHUNK))


def chunk_len(size: int, index: int) -> int:
    return max(0, min(CHUNK, size - index * CHUNK))


def tree_digest(rows: Any) -> str:
    """``rows``: ``(rel, size, sha256)``; the one digest both ends compute."""
    h = hashlib.sha256()
    for rel, size, sha in sorted((str(r), int(s), str(d)) for r, s, d in rows):
        h.update(f"{rel}\0{size}\0{sha}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def entries_digest(entries: Any) -> str:
    """The digest of a source manifest (its entries, as the launcher sends them)."""
    return tree_digest((e[REL], e[SIZE], e[SHA]) for e in entries)


def safe_rel(rel: Any) -> bool:
    """A relative path a node may write: no absolute path, no ``..``, never the state dir."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    parts = rel.split("/")
    return not any(p in ("", ".", "..") for p in parts) and parts[0] != STATE_DIR


def inside(dest: str, rel: str) -> str:
    if not safe_rel(rel):
        raise ValueError(f"refusing a path outside the destination: {rel!r}")
    return os.path.join(dest, rel)


def hash_file(path: str, size: int | None = None) -> tuple[str, list[str]]:
    """The file's sha256 and its chunks' (one read)."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    part = hashlib.sha256()
    in_part = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(READ)
            if not block:
                break
            whole.update(block)
            part.update(block)
            in_part += len(block)
            if in_part == CHUNK:
                chunks.append(part.hexdigest())
                part, in_part = hashlib.sha256(), 0
    if in_part or not chunks:
        chunks.append(part.hexdigest())
    return whole.hexdigest(), chunks


def read_manifest(dest: str) -> dict[str, Any] | None:
    """The node's manifest (``{"v", "digest", "files": {rel: [size, mtime_ns, mode, sha]}}``),
    or None when there is none or it is unreadable (then nothing counts as held)."""
    try:
        with open(os.path.join(dest, MANIFEST), encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("v") != MANIFEST_VERSION \
            or not isinstance(doc.get("files"), dict):
        return None
    return doc


def write_manifest(dest: str, files: dict[str, list[Any]]) -> str:
    """Write the manifest atomically (temp + fsync + rename); its digest."""
    digest = tree_digest((rel, f[0], f[3]) for rel, f in files.items())
    state = os.path.join(dest, STATE_DIR)
    os.makedirs(state, exist_ok=True)
    tmp = os.path.join(state, f"manifest.json.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"v": MANIFEST_VERSION, "digest": digest, "files": files}, fh,
                  sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(dest, MANIFEST))
    return digest


def stat_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return st.st_size, st.st_mtime_ns


def held(dest: str, doc: dict[str, Any] | None, rel: str, size: int, sha: str,
         rehash: bool = True) -> bool:
    """The node's copy of ``rel`` is ``sha``: by the manifest when the file's size and
    mtime are still what it recorded, else (``rehash``) by hashing a same-size file."""
    path = os.path.join(dest, rel)
    key = stat_key(path)
    if key is None or key[0] != size:
        return False
    rec = (doc or {}).get("files", {}).get(rel)
    if isinstance(rec, list) and len(rec) == 4 and rec[3] == sha and [rec[0], rec[1]] == list(key):
        return True
    return rehash and hash_file(path)[0] == sha


def partial_path(dest: str, sha: str) -> str:
    return os.path.join(dest, PARTIAL_DIR, sha)


def verified_chunks(path: str, entry: list[Any]) -> set[int]:
    """Chunks of a kept partial file that already match the source (hashed again: a
    partial written before a crash may hold anything)."""
    out: set[int] = set()
    try:
        have = os.path.getsize(path)
        fh = open(path, "rb")  # noqa: SIM115 (closed by the with below)
    except OSError:
        return out
    with fh:
        for i, want in enumerate(entry[CHUNKS]):
            n = chunk_len(int(entry[SIZE]), i)
            if (i * CHUNK + n > have) or n == 0:
                continue
            fh.seek(i * CHUNK)
            h = hashlib.sha256()
            left = n
            while left:
                block = fh.read(min(READ, left))
                if not block:
                    break
                h.update(block)
                left -= len(block)
            if not left and h.hexdigest() == want:
                out.add(i)
    return out


def walk(dest: str) -> list[str]:
    """Regular files under ``dest`` (relative, sorted), the state dir left out."""
    out = []
    for d, dirs, names in os.walk(dest):
        rel_dir = os.path.relpath(d, dest)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        dirs[:] = sorted(x for x in dirs if rel_dir + x != STATE_DIR)
        for n in sorted(names):
            if stat_key(os.path.join(d, n)) is not None:
                out.append(rel_dir + n)
    return out


def check(dest: str, source_digest: str | None = None, deep: bool = False) -> dict[str, Any]:
    """What a synced directory holds against its manifest: its digest and the files that
    differ (stat changed and content changed, or missing); ``deep``: hash every file."""
    if not os.path.isdir(dest):
        return {"state": "absent", "digest": None, "differ": [], "files": 0}
    doc = read_manifest(dest)
    if doc is None:
        return {"state": "no-manifest", "digest": None, "differ": [], "files": 0}
    differ = []
    for rel, rec in sorted(doc["files"].items()):
        if not held(dest, None if deep else doc, rel, int(rec[0]), str(rec[3])):
            differ.append(rel)
    digest = str(doc.get("digest"))
    state = "differs" if differ else (
        "ok" if source_digest in (None, digest) else "other")
    return {"state": state, "digest": digest, "differ": differ, "files": len(doc["files"])}
