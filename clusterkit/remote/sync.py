"""The source side of ``clusterkit sync``: which files travel, and their sha256s.

* :class:`Ignore` / :func:`load_ignore`: ``.clusterkitignore`` (gitignore-style) plus
  what never travels (``.git/``, bytecode, launch's job dirs, checkpoint dirs);
* :func:`manifest`: every regular file under the source that is not ignored (symbolic
  links are not followed and not copied: :func:`manifest` counts them);
* :func:`source_entries`: each file's sha256 and its 64 MiB chunks' (node/dist_store.py),
  from a cache on this machine keyed by (path, size, mtime_ns), so a second run with
  nothing changed hashes nothing.

The transfer itself is :mod:`clusterkit.remote.distribute`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.errors import ClusterkitError
from clusterkit.fsutil import atomic_write_text
from clusterkit.node import dist_store

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
    """What :func:`scan` found: the files, and the symbolic links it left out."""

    files: dict[str, LocalFile] = field(default_factory=dict)
    links: list[str] = field(default_factory=list)


def scan(src: str, ignore: Ignore) -> Scan:
    """Every regular file under ``src`` that is not ignored, by POSIX relative path;
    symbolic links are neither followed nor copied (a loop cannot trap the walk)."""
    out = Scan()
    for d, dirs, names in os.walk(src):
        rel_dir = os.path.relpath(d, src).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        keep = []
        for x in sorted(dirs):
            if ignore.ignored(rel_dir + x, True) or rel_dir + x == dist_store.STATE_DIR:
                continue  # (a synced copy's own state never travels on)
            if os.path.islink(os.path.join(d, x)):
                out.links.append(rel_dir + x)
            else:
                keep.append(x)
        dirs[:] = keep
        for n in sorted(names):
            p = os.path.join(d, n)
            if ignore.ignored(rel_dir + n, False):
                continue
            if os.path.islink(p):
                out.links.append(rel_dir + n)
                continue
            st = os.lstat(p)
            if os.path.isfile(p):
                out.files[rel_dir + n] = LocalFile(st.st_size, st.st_mtime_ns,
                                                   st.st_mode & 0o7777, p)
    return out


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
        and doc.get("chunk") == dist_store.CHUNK and isinstance(doc.get("files"), dict)
    return doc["files"] if ok else {}


def source_entries(files: dict[str, LocalFile], cache_dir: str | None, src: str
                   ) -> tuple[list[list[Any]], int]:
    """The source manifest the nodes get (``[rel, size, mtime_ns, mode, sha256, [chunk
    sha256]]``, node/dist_store.py) and how many bytes had to be hashed now: a file
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
                sha, chunks = dist_store.hash_file(f.path)
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
            {"v": CACHE_VERSION, "chunk": dist_store.CHUNK, "src": os.path.realpath(src),
             "files": fresh}))
    return entries, hashed
