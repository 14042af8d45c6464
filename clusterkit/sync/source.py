"""The source side of ``clusterkit sync``: which files travel, and their sha256s.

* :class:`Ignore` / :func:`load_ignore`: ``.clusterkitignore`` (gitignore-style) plus
  what never travels (``.git/``, bytecode, launch's job dirs, checkpoint dirs);
* :func:`scan`: every regular file under the source that is not ignored, and its
  symbolic links (docs/sync.md, "Symbolic links"): a link that resolves inside the
  source travels as a link (:func:`link_text`); one that leads outside is followed and
  what it points at travels as files (rsync's ``--copy-unsafe-links``); a dangling
  link or a loop is listed, not copied;
* :func:`source_entries`: each file's sha256 and its 64 MiB chunks' (node/sync/store.py),
  from a cache on this machine keyed by (path, size, mtime_ns), so a second run with
  nothing changed hashes nothing.

The transfer itself is :mod:`clusterkit.sync.engine`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.errors import ClusterkitError
from clusterkit.fsutil import atomic_write_text
from clusterkit.node.contract import SYNC_STATE_DIR
from clusterkit.node.sync import store

IGNORE_FILE = ".clusterkitignore"
# Never sent, never deleted: VCS data, bytecode, and the job dirs launch keeps in the
# workdir (.clusterkit/jobs/<job>: logs, rendered files) which --delete must not touch.
ALWAYS_IGNORED = (".git/", "__pycache__/", "*.pyc", "/.clusterkit/")
CACHE_VERSION = 1


@dataclass(frozen=True)
class _Rule:
    pattern: str
    negate: bool
    dir_only: bool
    anchored: bool


@dataclass(frozen=True)
class Ignore:
    """gitignore-style rules: ``#``, ``!``, trailing ``/``, leading ``/``, ``*``, ``?``, ``**``."""

    rules: tuple[_Rule, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Ignore:
        rules = []
        for raw in text.splitlines():
            line = raw.rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = line[1:] if negate else line
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            rules.append(_Rule(line.lstrip("/"), negate, dir_only, anchored))
        return cls(tuple(rules))

    def ignored_path(self, rel: str) -> bool:
        """A file path: ignored itself or under an ignored directory."""
        parts = rel.split("/")
        return self.ignored(rel, False) or any(
            self.ignored("/".join(parts[:i]), True) for i in range(1, len(parts)))

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """The last matching rule decides (gitignore semantics)."""
        verdict = False
        for r in self.rules:
            if r.dir_only and not is_dir:
                continue
            target = rel if r.anchored else posixpath.basename(rel)
            if _glob(target, r.pattern):
                verdict = not r.negate
        return verdict


def _glob(path: str, pattern: str) -> bool:
    if "**" in pattern:  # "a/**/b" matches a/b, a/x/b, a/x/y/b
        return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(
            path, pattern.replace("**/", ""))
    return fnmatch.fnmatchcase(path, pattern) and path.count("/") == pattern.count("/")


def load_ignore(src: str, extra: str | None = None, protect: Sequence[str] = ()) -> Ignore:
    """The rules for one sync; ``protect``: destination-relative dirs (checkpoints) to
    leave alone on the nodes (added last: the last match wins, so no ``!`` undoes them)."""
    texts = ["\n".join(ALWAYS_IGNORED)]
    for path in (os.path.join(src, IGNORE_FILE), extra):
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                texts.append(fh.read())
    texts.append("\n".join(f"/{p.strip('/')}/" for p in protect))
    return Ignore.parse("\n".join(texts))


@dataclass(frozen=True)
class LocalFile:
    size: int
    mtime_ns: int
    mode: int
    path: str  # absolute, on this machine


@dataclass
class Scan:
    """What :func:`scan` found: the files, the links kept as links (rel -> the link text
    the nodes make), the links followed out of the source (rel -> where they lead: what
    is there travels as files) and the links not copied (dangling, a loop)."""

    files: dict[str, LocalFile] = field(default_factory=dict)
    links: list[str] = field(default_factory=list)
    symlinks: dict[str, str] = field(default_factory=dict)
    followed: dict[str, str] = field(default_factory=dict)


def scan(src: str, ignore: Ignore, links: bool = True) -> Scan:
    """Every regular file under ``src`` that is not ignored, by POSIX relative path, and
    its symbolic links (module docstring); a link to a directory inside ``src`` is kept
    as a link, never walked, and a followed one is walked only where it does not lead
    back into a directory being walked, so no loop traps the walk. ``links=False``:
    every link is listed in ``links`` and nothing more (``nodes env``)."""
    out = Scan()
    root = os.path.realpath(src)
    _Walk(src, root, ignore, links, out).dir(src, "", (root,), False)
    return out


@dataclass
class _Walk:
    src: str
    root: str  # realpath of src
    ignore: Ignore
    carry: bool
    out: Scan

    def dir(self, path: str, rel_dir: str, ancestors: tuple[str, ...], outside: bool) -> None:
        try:
            names = sorted(os.listdir(path))
        except OSError:
            return  # (as os.walk: an unreadable directory is left out)
        for n in names:
            rel, p = rel_dir + n, os.path.join(path, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                self.link(p, rel, ancestors, outside)
            elif stat.S_ISDIR(st.st_mode):
                if self.ignore.ignored(rel, True) or rel == SYNC_STATE_DIR:
                    continue
                real = os.path.realpath(p)
                if real in ancestors:  # (a followed link's tree that holds it again)
                    self.out.links.append(rel)
                else:
                    self.dir(p, rel + "/", (*ancestors, real), outside)
            elif stat.S_ISREG(st.st_mode) and not self.ignore.ignored(rel, False):
                self.out.files[rel] = LocalFile(st.st_size, st.st_mtime_ns,
                                                st.st_mode & 0o7777, p)

    def link(self, p: str, rel: str, ancestors: tuple[str, ...], outside: bool) -> None:
        is_dir = os.path.isdir(p)
        if self.ignore.ignored(rel, is_dir):
            return
        if not self.carry or not os.path.exists(p):  # (a dangling link, or a loop)
            self.out.links.append(rel)
            return
        real = os.path.realpath(p)
        if not outside and _within(real, self.root):
            text = link_text(rel, os.readlink(p), os.path.abspath(self.src), self.root, real)
            if text is None:
                self.out.links.append(rel)
            else:
                self.out.symlinks[rel] = text
            return
        if is_dir and real in ancestors:
            self.out.links.append(rel)  # leads back into a directory being walked
            return
        if not outside:
            self.out.followed[rel] = real
        if is_dir:
            self.dir(p, rel + "/", (*ancestors, real), True)
            return
        st = os.stat(p)
        if stat.S_ISREG(st.st_mode):
            self.out.files[rel] = LocalFile(st.st_size, st.st_mtime_ns, st.st_mode & 0o7777, real)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def link_text(rel: str, target: str, src_abs: str, root: str, real: str) -> str | None:
    """The link text the nodes make for the link ``rel`` (text ``target``) that resolves
    to ``real`` inside the source (realpath ``root``; ``src_abs`` as given): ``target``
    itself when it is relative and, read as text, leads there without leaving the
    source; else (an absolute path into the source, a detour through ``..`` outside it
    or through another link) the relative path from the link's directory to ``real``,
    so it points at the same thing under any destination. None: it leads into the
    sync's own state (not copied)."""
    rel_real = os.path.relpath(real, root).replace(os.sep, "/")
    if rel_real.split("/")[0] == SYNC_STATE_DIR:
        return None
    base = posixpath.dirname(rel) or "."
    lex: str | None = None
    if not target.startswith("/"):
        lex = posixpath.normpath(posixpath.join(base, target))
    else:
        for prefix in (src_abs, root):
            if _within(target, prefix):
                lex = posixpath.normpath(target[len(prefix):].lstrip("/") or ".")
                break
    if lex is not None and lex != ".." and not lex.startswith("../") \
            and os.path.realpath(os.path.join(root, lex)) == real:
        return target if not target.startswith("/") else posixpath.relpath(lex, base)
    return posixpath.relpath(rel_real, base)


def followed_note(src: str, found: Scan) -> str:
    """The note for the links that lead outside ``src``: what they cost (their targets
    travel as files) and how to leave one out."""
    from clusterkit.sync.plan import fmt_bytes

    out = found.followed
    size = sum(f.size for rel, f in found.files.items()
               if any(rel == k or rel.startswith(k + "/") for k in out))
    shown = ", ".join(f"{k} -> {v}" for k, v in sorted(out.items())[:3])
    more = f" (+{len(out) - 3} more)" if len(out) > 3 else ""
    return (f"{len(out)} link(s) lead outside {src}: copied as what they point at "
            f"({fmt_bytes(size)}): {shown}{more}; to leave one out, list it in "
            f"{os.path.join(src, IGNORE_FILE)}")


def source_digest(src: str, ignore: Ignore, cache_dir: str | None) -> str:
    """The digest of ``src`` as ``clusterkit sync`` sends it: files and kept links
    (``doctor --sync`` compares the nodes' with it)."""
    found = scan(src, ignore)
    entries, _ = source_entries(found.files, cache_dir, src)
    return store.entries_digest(entries, found.symlinks.items())


def manifest(src: str, ignore: Ignore) -> dict[str, LocalFile]:
    """Every regular file under ``src`` that is not ignored, by POSIX relative path."""
    return scan(src, ignore).files


def _cache_file(cache_dir: str, src: str) -> str:
    key = hashlib.sha256(os.path.realpath(src).encode("utf-8", "surrogateescape")).hexdigest()
    return os.path.join(cache_dir, key[:32] + ".json")


def _read_cache(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return {}
    ok = isinstance(doc, dict) and doc.get("v") == CACHE_VERSION \
        and doc.get("chunk") == store.CHUNK and isinstance(doc.get("files"), dict)
    return doc["files"] if ok else {}


def source_entries(files: dict[str, LocalFile], cache_dir: str | None, src: str
                   ) -> tuple[list[list[Any]], int]:
    """The source manifest the nodes get (``[rel, size, mtime_ns, mode, sha256, [chunk
    sha256]]``, node/sync/store.py) and how many bytes had to be hashed now: a file
    whose size and mtime_ns match the cache is not read again."""
    cache_path = _cache_file(cache_dir, src) if cache_dir else None
    cache = _read_cache(cache_path) if cache_path else {}
    fresh: dict[str, Any] = {}
    entries: list[list[Any]] = []
    hashed = 0
    for rel, f in files.items():
        rec = cache.get(rel)
        if not (isinstance(rec, list) and len(rec) == 4 and rec[:2] == [f.size, f.mtime_ns]):
            try:
                sha, chunks = store.hash_file(f.path)
            except OSError as exc:
                raise ClusterkitError(f"cannot read it: {exc.strerror or exc}", path=f.path,
                                      hint="fix its permissions, or exclude it in "
                                      f"{IGNORE_FILE}") from None
            hashed += f.size
            rec = [f.size, f.mtime_ns, sha, chunks]
        fresh[rel] = rec
        entries.append([rel, f.size, f.mtime_ns, f.mode, rec[2], rec[3]])
    if cache_path and fresh != cache:
        atomic_write_text(cache_path, json.dumps(
            {"v": CACHE_VERSION, "chunk": store.CHUNK, "src": os.path.realpath(src),
             "files": fresh}))
    return entries, hashed
