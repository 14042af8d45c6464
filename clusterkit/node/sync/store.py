"""A synced directory on disk: its manifest, its digest, what a node still needs, partials.

Shared by the node program ``sync.chain`` (shipped, ``ship.py``) and the launcher
(``clusterkit.sync.engine``, which imports the same definitions), so both ends
read one spelling of the layout, the chunk size and the digest. Standard library
only, Python >= 3.8 on the node.

Layout under a synced directory ``DEST``::

    DEST/.clusterkit-sync/manifest.json   what this node holds (written last, atomically)
    DEST/.clusterkit-sync/partial/<sha>.<host>   a file being received, by its sha256
                                          and the receiving host (kept across runs: its
                                          verified chunks are reused)

A file is one or more **chunks** of :data:`CHUNK` bytes (the last one shorter); the
source's manifest gives each chunk's sha256, and a receiver checks every chunk against
it on arrival. A file of one chunk: its chunk sha256 is the file's sha256.

The **digest** of a directory (:func:`tree_digest`) is the sha256 of its sorted
``(path, size, sha256)`` rows: equal digests, equal contents (mode and mtime are not
part of it). The launcher computes it from the source, each node from its manifest.

**Symbolic links** that stay inside the directory travel as links (``[rel, target]``,
the target relative and, read from the link's own directory, inside the destination:
:func:`safe_link`). Each is a digest row ``(rel, -1, "l:" + target)`` (a tree without
links keeps the digest it had), a ``links`` map in the manifest, and is made on the
node under a temp name and renamed into place (:func:`place_link`). A node asked no
``links`` (``nodes env``, whose links node/facts/envfacts.py makes) leaves links alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import socket
import stat
from typing import Any

from clusterkit.node.contract import SYNC_STATE_DIR
from clusterkit.node.files import place_link, write_atomic

MANIFEST = SYNC_STATE_DIR + "/manifest.json"
PARTIAL_DIR = SYNC_STATE_DIR + "/partial"
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


LINK_SIZE = -1  # a link's digest row: (rel, LINK_SIZE, "l:" + target); no file has it


def link_rows(links: Any) -> list[tuple[str, int, str]]:
    """``links``: ``(rel, target)`` pairs (or a ``{rel: target}`` map's items)."""
    return [(str(rel), LINK_SIZE, "l:" + str(target)) for rel, target in links]


def entries_digest(entries: Any, links: Any = ()) -> str:
    """The digest of a source manifest (its entries and links, as the launcher sends them)."""
    return tree_digest([(e[REL], e[SIZE], e[SHA]) for e in entries] + link_rows(links))


def safe_rel(rel: Any) -> bool:
    """A relative path a node may write: no absolute path, no ``..``, never the state dir."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    parts = rel.split("/")
    return not any(p in ("", ".", "..") for p in parts) and parts[0] != SYNC_STATE_DIR


def safe_link(rel: Any, target: Any) -> bool:
    """A link a node may make: a safe ``rel`` and a relative target that, read from the
    link's directory, stays inside the destination and out of the state dir."""
    if not safe_rel(rel) or not isinstance(target, str) or not target \
            or target.startswith("/") or "\0" in target:
        return False
    lex = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    return lex != ".." and not lex.startswith("../") and lex.split("/")[0] != SYNC_STATE_DIR


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


def write_manifest(dest: str, files: dict[str, list[Any]],
                   links: dict[str, str] | None = None) -> str:
    """Write the manifest atomically (temp + fsync + rename); its digest."""
    digest = tree_digest([(rel, f[0], f[3]) for rel, f in files.items()]
                         + link_rows((links or {}).items()))
    state = os.path.join(dest, SYNC_STATE_DIR)
    os.makedirs(state, exist_ok=True)
    doc: dict[str, Any] = {"v": MANIFEST_VERSION, "digest": digest, "files": files}
    if links:
        doc["links"] = links
    write_atomic(os.path.join(dest, MANIFEST), json.dumps(doc, sort_keys=True))
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


# The receiving host in a partial file's name: nodes whose DEST is one directory (a
# workdir on NFS that the inventory does not call shared) then never write, rename or
# sweep each other's partials (all of them received the same file into partial/<sha>,
# and every rename but the first failed: "No such file or directory").
HOST = socket.gethostname()


def partial_name(sha: str) -> str:
    return f"{sha}.{HOST}"


def partial_path(dest: str, sha: str) -> str:
    return os.path.join(dest, PARTIAL_DIR, partial_name(sha))


def own_partial(name: str) -> bool:
    """A partial file of this host's (or one from before names carried the host)."""
    return name.endswith("." + HOST) or "." not in name


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


def walk(dest: str, links: bool = False) -> list[str]:
    """Regular files under ``dest`` (relative, sorted), the state dir left out; with
    ``links``, symbolic links too (a link to a directory is listed, not walked)."""
    out = []
    for d, dirs, names in os.walk(dest):
        rel_dir = os.path.relpath(d, dest)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        dirs[:] = sorted(x for x in dirs if rel_dir + x != SYNC_STATE_DIR)
        if links:
            out += [rel_dir + x for x in dirs if os.path.islink(os.path.join(d, x))]
        for n in sorted(names):
            p = os.path.join(d, n)
            if stat_key(p) is not None or (links and os.path.islink(p)):
                out.append(rel_dir + n)
    return sorted(out)


# ----------------------------------------------------------------------------- links
def link_held(dest: str, rel: str, target: str) -> bool:
    path = os.path.join(dest, rel)
    return os.path.islink(path) and os.readlink(path) == target


def plan_links(dest: str, links: list[list[Any]], rels: Any, ours: Any = ()
               ) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """What a node does with the source's links: (held: already right, todo: to make at
    the end, refused: rel -> why). First, a link an earlier sync made (``ours``: its
    manifest's) where the source now has a directory (an ancestor of one of ``rels``,
    the source's files and links) is removed, so nothing is written through it into
    another directory. A link someone made on the node stays: writing through it is
    what they made it for (a directory on a bigger disk)."""
    parents = {"/".join(r.split("/")[:i]) for r in rels for i in range(1, r.count("/") + 1)}
    for d in sorted(parents & set(ours)):
        if os.path.islink(os.path.join(dest, d)):
            os.unlink(os.path.join(dest, d))
    held_: dict[str, str] = {}
    todo: dict[str, str] = {}
    refused: dict[str, str] = {}
    for rel, target in ((str(e[0]), e[1]) for e in links):
        if not safe_link(rel, target):
            refused[rel] = f"refusing a link that leads outside the destination: {target!r}"
        elif link_held(dest, rel, str(target)):
            held_[rel] = str(target)
        else:
            todo[rel] = str(target)
    return held_, todo, refused


def make_link(dest: str, rel: str, target: str) -> None:
    """One link into place. A directory where it goes is replaced only when it holds no
    file (``--delete`` removed the files the source lacks); else ValueError."""
    path = inside(dest, rel)
    if os.path.isdir(path) and not os.path.islink(path):
        for d, _dirs, _names in os.walk(path, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        if os.path.isdir(path):
            raise ValueError(f"{rel} is a directory on this node that holds files the source "
                             "lacks (sync --delete removes them)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    place_link(path, target)


def make_links(dest: str, todo: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Every link of ``todo`` made: (made, failed: rel -> why); one failure fails only it."""
    made: dict[str, str] = {}
    failed: dict[str, str] = {}
    for rel, target in sorted(todo.items()):
        try:
            make_link(dest, rel, target)
            made[rel] = target
        except (OSError, ValueError) as exc:
            failed[rel] = f"cannot make the link: {exc}"
    return made, failed


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
    links = doc.get("links")
    links = links if isinstance(links, dict) else {}
    bad_links = [rel for rel, target in sorted(links.items()) if not link_held(dest, rel, target)]
    differ += bad_links
    digest = str(doc.get("digest"))
    state = "differs" if differ else (
        "ok" if source_digest in (None, digest) else "other")
    return {"state": state, "digest": digest, "differ": sorted(differ),
            "links_differ": len(bad_links), "files": len(doc["files"]), "links": len(links)}
