"""Node program and helper: a Python environment's facts, manifest and record (``nodes env``).

Standard library only (shipped, ship.py). Three modes, each printing one JSON line:

``facts PATH...``
    What decides whether the launcher's environment can be copied here: the CPU
    architecture (``uname -m``), the C library (``os.confstr('CS_GNU_LIBC_VERSION')``),
    the OS release (``/etc/os-release`` ID and VERSION_ID), and for each PATH what is
    there now (``absent``, ``empty``, ``env``: a pyvenv.cfg, conda-meta or bin/python,
    ``tree``: a directory we recorded before, ``other``: anything else) with its record.
``finish DIR``
    After the files travelled: stdin holds the launcher's manifest of DIR (one JSON
    line). Symbolic links are made (the file transfer carries regular files only),
    then every entry is checked against the manifest (sha256; a file whose size and
    mtime equal this node's previous record keeps its recorded sha256). Equal: the
    record is written (temp file + rename) and the digest returned; else the entries
    that differ are listed and no record is written.
``record DIR``
    Write DIR's record from DIR itself (the launcher's own side).

The record lives in ``DIR/.clusterkit/`` (never synced, never deleted):
``env-manifest.json`` (every entry: kind, size, mode, sha256 or link target, mtime)
and ``env-digest.json`` (the digests and the package fingerprint only), which the
launch gate reads on every launch: no hashing at launch time (node/facts/gatefacts.py).

Under test only: ``CLUSTERKIT_TEST_ENVFACTS`` (``KEY=VALUE,...``, e.g. ``machine=aarch64``)
replaces facts this node reports, so a test bed whose nodes all share the host's
kernel and C library can show a node of another machine (docs/getting-nodes-ready.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from typing import Any, Dict, List  # noqa: UP035 - runs on Python 3.8 nodes

from clusterkit.node.contract import ENV_TEST_ENVFACTS, SYNC_STATE_DIR
from clusterkit.node.files import place_link, write_atomic
from clusterkit.node.hashing import sha256_file

ENVFACTS_VERSION = 1
RECORD_DIR = ".clusterkit"
MANIFEST_FILE = "env-manifest.json"
DIGEST_FILE = "env-digest.json"
TEST_OVERRIDE_ENV = ENV_TEST_ENVFACTS
CHUNK = 1 << 20
# Never part of an environment's manifest: bytecode the interpreter writes on each node
# as it imports, and our own record. The same names the sync leaves alone.
SKIP_DIRS = ("__pycache__", ".git")
SKIP_SUFFIXES = (".pyc",)
TOP_SKIP = (RECORD_DIR, SYNC_STATE_DIR)  # ours and clusterkit sync's state, at the top only
# The same, as the gitignore-style rules clusterkit sync's engine takes (provision/envcopy.py).
SKIPPED = (*(f"{d}/" for d in SKIP_DIRS), *(f"*{x}" for x in SKIP_SUFFIXES),
           *(f"/{d}/" for d in TOP_SKIP))

Entry = List[Any]  # noqa: UP006 - ["f", size, mode, sha256, mtime] | ["l", target]
Manifest = Dict[str, Entry]  # noqa: UP006


def record_path(directory: str, name: str = MANIFEST_FILE) -> str:
    return os.path.join(directory, RECORD_DIR, name)


def _read_json(path: str) -> Dict[str, Any] | None:  # noqa: UP006
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_digest(directory: str) -> Dict[str, Any] | None:  # noqa: UP006
    """The small record (digest, fingerprint) of ``directory``, None when never recorded."""
    return _read_json(record_path(directory, DIGEST_FILE))


def _skipped(rel: str, name: str, is_dir: bool) -> bool:
    if is_dir:
        return name in SKIP_DIRS or rel in TOP_SKIP
    return name.endswith(SKIP_SUFFIXES)


def manifest(directory: str, cache: Manifest | None = None) -> Manifest:
    """Every regular file and symbolic link under ``directory`` by POSIX relative path.

    ``cache``: a previous manifest; a file with the same size and mtime keeps its sha256
    (re-reading gigabytes of torch on every run would cost minutes)."""
    out: Manifest = {}
    cache = cache or {}
    for d, dirs, names in os.walk(directory):
        rel_dir = os.path.relpath(d, directory).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        keep = []
        for x in sorted(dirs):
            p = os.path.join(d, x)
            if _skipped(rel_dir + x, x, True):
                continue
            if os.path.islink(p):  # a link to a directory: an entry, not walked
                out[rel_dir + x] = ["l", os.readlink(p)]
            else:
                keep.append(x)
        dirs[:] = keep
        for n in sorted(names):
            rel, p = rel_dir + n, os.path.join(d, n)
            if _skipped(rel, n, False):
                continue
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ["l", os.readlink(p)]
            elif os.path.isfile(p):
                old = cache.get(rel)
                same = (old and old[0] == "f" and old[1] == st.st_size
                        and abs(float(old[4]) - st.st_mtime) < 1e-6)
                sha = old[3] if same and old else sha256_file(p)
                out[rel] = ["f", st.st_size, st.st_mode & 0o7777, sha, st.st_mtime]
    return out


def digest(entries: Manifest) -> str:
    """sha256 over every entry's path, kind, size, mode and content (mtimes left out)."""
    h = hashlib.sha256()
    for rel in sorted(entries):
        e = entries[rel]
        line = [rel, "l", e[1]] if e[0] == "l" else [rel, "f", str(e[1]), f"{e[2]:o}", e[3]]
        h.update(("\0".join(line) + "\n").encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def combine(parts: Dict[str, str]) -> str:  # noqa: UP006
    """One digest for an environment made of several directories (path -> digest)."""
    h = hashlib.sha256()
    for path in sorted(parts):
        h.update(f"{path}\0{parts[path]}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def fingerprint(directory: str) -> str:
    """A cheap sign of change: the names of the installed distributions (name and version
    are in a ``*.dist-info`` directory's name) and the ``.pth`` files of every
    site-packages under ``directory``. A pip install or uninstall changes it."""
    names: list[str] = []
    for sub in ("lib", "lib64", os.path.join("Lib")):
        base = os.path.join(directory, sub)
        try:
            pys = sorted(os.listdir(base))
        except OSError:
            continue
        for py in pys:
            site = os.path.join(base, py, "site-packages")
            try:
                names += [f"{sub}/{py}/{n}" for n in sorted(os.listdir(site))
                          if n.endswith((".dist-info", ".egg-info", ".pth"))]
            except OSError:
                continue
    return hashlib.sha256("\n".join(names).encode("utf-8", "surrogateescape")).hexdigest()


def _atomic_json(path: str, data: Dict[str, Any]) -> None:  # noqa: UP006
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, json.dumps(data, sort_keys=True))


def group_of(rel: str) -> str:
    """The unit doctor names when two records differ: a site-packages entry (one package,
    ``lib/python3.11/site-packages/torch``), else the first two path components."""
    parts = rel.split("/")
    if "site-packages" in parts:
        return "/".join(parts[:parts.index("site-packages") + 2])
    return "/".join(parts[:2])


def group_digests(entries: Manifest) -> Dict[str, str]:  # noqa: UP006
    groups: Dict[str, Manifest] = {}  # noqa: UP006
    for rel, e in entries.items():
        groups.setdefault(group_of(rel), {})[rel] = e
    return {g: digest(m)[:16] for g, m in sorted(groups.items())}


def write_record(directory: str, entries: Manifest, env: Dict[str, Any] | None = None,  # noqa: UP006
                 token: str | None = None) -> Dict[str, Any]:  # noqa: UP006
    """Record ``entries`` as ``directory``'s manifest; ``env``: for an environment's prefix,
    its parts' digests and the combined ``env_digest`` (what the launch gate compares);
    ``token``: the launcher's, new each run: a node that reads it back shares this very
    directory with the launcher (a shared filesystem), which is then left alone."""
    small = {"v": ENVFACTS_VERSION, "dir": directory, "digest": digest(entries),
             "files": len(entries), "fingerprint": fingerprint(directory),
             "groups": group_digests(entries)}
    if token:
        small["token"] = token
    small.update(env or {})
    # The big manifest (megabytes for a torch environment) is written again only when an
    # entry changed, its mtimes included (they key the sha256 cache of the next run).
    small["stat_digest"] = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()
                                          ).hexdigest()
    old = read_digest(directory) or {}
    if old.get("stat_digest") != small["stat_digest"] or not os.path.isfile(
            record_path(directory)):
        _atomic_json(record_path(directory), {"v": ENVFACTS_VERSION, "entries": entries})
    _atomic_json(record_path(directory, DIGEST_FILE), small)
    return small


def local_manifest(directory: str) -> Manifest:
    """``directory``'s manifest, reusing its own record's sha256s where files are unchanged."""
    old = _read_json(record_path(directory)) or {}
    cache = old.get("entries") if isinstance(old.get("entries"), dict) else None
    return manifest(directory, cache)


# ----------------------------------------------------------------------------- the gate, doctor


def env_state(prefix: str, *, changes: bool = False) -> Dict[str, Any]:  # noqa: UP006
    """What the launch gate (node/facts/gatefacts.py) and doctor read of an environment: its
    recorded digest (no hashing), and whether its packages changed since (``stale``:
    the fingerprint, one listdir per site-packages). ``changes``: doctor's, the entries
    whose size, mtime or link target differ from the record (a stat of every file)."""
    prefix = os.path.realpath(prefix)
    rec = read_digest(prefix)
    if rec is None or not rec.get("env_digest"):
        # Never replicated as an environment (a base or a source tree of another one
        # has a record too, but no environment's digest): nothing to judge.
        return {"prefix": prefix, "digest": None}
    out = {"prefix": prefix, "digest": rec["env_digest"],
           "stale": fingerprint(prefix) != rec.get("fingerprint"),
           "groups": rec.get("groups") or {}}
    if changes:
        out["changed"] = changed_since_record(prefix)
    return out


def changed_since_record(directory: str, limit: int = 20) -> List[str]:  # noqa: UP006
    old = _read_json(record_path(directory)) or {}
    entries = old.get("entries")
    want: Manifest = entries if isinstance(entries, dict) else {}
    # The cache makes manifest() reuse recorded sha256s: only size/mtime/target count here.
    have = manifest(directory, want)
    return compare(want, have)[:limit]


ENV_FIX = "`clusterkit nodes env` (from the launcher, with --python {prefix}/bin/python)"


def env_problems(facts: Dict[str, Any], here: Any = env_state  # noqa: UP006
                 ) -> Dict[str, str]:  # noqa: UP006
    """node -> why its environment is not the launcher's, from the nodes' ``env`` facts
    and ``here(prefix)`` (the launcher's own env_state of the same path). Nothing to say
    where the launcher holds no record of that path (never replicated from here). One
    text per kind of difference, without the node's name: the lines fold."""
    out: Dict[str, str] = {}  # noqa: UP006
    mine: Dict[str, Any] = {}  # noqa: UP006
    for node, f in facts.items():
        st = f.get("env") if isinstance(f, dict) else None
        if not isinstance(st, dict) or not st.get("prefix"):
            continue
        prefix = str(st["prefix"])
        if prefix not in mine:
            mine[prefix] = here(prefix)
        ours = mine[prefix] or {}
        if not ours.get("digest"):
            continue
        fix = ENV_FIX.format(prefix=prefix)
        if ours.get("stale"):
            out[node] = (f"environment {prefix} changed on the launcher since it was "
                         f"replicated (packages installed or removed): run {fix} again")
        elif not st.get("digest"):
            out[node] = (f"environment {prefix} was not replicated here (no record): "
                         f"run {fix}")
        elif st["digest"] != ours["digest"]:
            out[node] = (f"environment {prefix} differs from the launcher's (digest "
                         f"{str(st['digest'])[:12]} != {str(ours['digest'])[:12]}): run {fix}; "
                         "`clusterkit doctor` names what differs")
        elif st.get("stale"):
            out[node] = (f"environment {prefix} changed on this node since it was replicated "
                         f"(packages installed or removed): run {fix}")
    return out


# ----------------------------------------------------------------------------- facts


def _os_release() -> str | None:
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        try:
            with open(path, encoding="utf-8") as fh:
                kv = dict(line.rstrip("\n").split("=", 1) for line in fh if "=" in line)
        except OSError:
            continue
        ident = kv.get("ID", "").strip('"')
        ver = kv.get("VERSION_ID", "").strip('"')
        return f"{ident} {ver}".strip() or None
    return None


def _glibc() -> str | None:
    try:
        value = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.35"
    except (ValueError, OSError, AttributeError):
        return None
    return value.split()[-1] if value and value.startswith("glibc") else None


def _driver() -> str | None:
    """The NVIDIA driver's version (None: no nvidia-smi): not part of the environment,
    but ``nodes env`` says when nodes differ."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        res = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = res.stdout.split()
    return lines[0] if res.returncode == 0 and lines else None


def path_state(path: str) -> Dict[str, Any]:  # noqa: UP006
    """What is at ``path`` now: absent, empty, env, tree (recorded by us) or other."""
    if not os.path.lexists(path):
        return {"state": "absent"}
    if not os.path.isdir(path) or os.path.islink(path):
        return {"state": "other", "what": "not a directory"}
    small = read_digest(path)
    if any(os.path.exists(os.path.join(path, m))
           for m in ("pyvenv.cfg", "conda-meta", "bin/python", "bin/python3")):
        state = "env"
    elif small is not None:
        state = "tree"
    else:
        try:
            state = "other" if os.listdir(path) else "empty"
        except OSError as exc:
            return {"state": "other", "what": exc.strerror or str(exc)}
    out: Dict[str, Any] = {"state": state}  # noqa: UP006
    if small is not None:  # and what changed since (stat only: a quick rerun skips it)
        out["record"] = small
        out["changed"] = (fingerprint(path) != small.get("fingerprint")
                          or bool(changed_since_record(path, 1)))
    return out


def facts(paths: List[str]) -> Dict[str, Any]:  # noqa: UP006
    out: Dict[str, Any] = {  # noqa: UP006
        "v": ENVFACTS_VERSION, "machine": os.uname().machine, "glibc": _glibc(),
        "os": _os_release(), "python": sys.executable, "driver": _driver(),
        "paths": {p: path_state(p) for p in paths}}
    fake = os.environ.get(TEST_OVERRIDE_ENV)
    if fake:  # tests only (module docstring): "machine=aarch64,glibc=2.17"
        out.update(kv.partition("=")[::2] for kv in fake.split(",") if "=" in kv)
    return out


# ----------------------------------------------------------------------------- finish


def _make_links(directory: str, want: Manifest) -> None:
    for rel, e in sorted(want.items()):
        if e[0] != "l":
            continue
        path = os.path.join(directory, rel)
        if os.path.islink(path) and os.readlink(path) == e[1]:
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        place_link(path, e[1])  # a regular file of the same name is replaced too


def _prune(directory: str, want: Manifest) -> None:
    """Remove empty directories the environment does not hold (what an uninstall leaves,
    e.g. an emptied ``*.dist-info``, which the fingerprint would still count)."""
    keep = {os.path.dirname(rel) for rel in want}
    keep |= {"/".join(d.split("/")[:i]) for d in list(keep) for i in range(1, d.count("/") + 1)}
    for d, _dirs, _names in os.walk(directory, topdown=False):
        rel = os.path.relpath(d, directory).replace(os.sep, "/")
        if rel == "." or rel in keep or any(
                _skipped(p, p.rsplit("/", 1)[-1], True) for p in _prefixes(rel)):
            continue
        with contextlib.suppress(OSError):
            if not os.listdir(d):  # (a child removed just now is gone from ``dirs`` too)
                os.rmdir(d)


def _prefixes(rel: str) -> List[str]:  # noqa: UP006
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def compare(want: Manifest, have: Manifest) -> List[str]:  # noqa: UP006
    """The paths whose entries differ (mtimes aside), sorted: missing, extra, changed."""
    def key(e: Entry) -> tuple[Any, ...]:
        return ("l", e[1]) if e[0] == "l" else ("f", e[1], e[2], e[3])

    return sorted(rel for rel in set(want) | set(have)
                  if rel not in want or rel not in have or key(want[rel]) != key(have[rel]))


def finish(directory: str, want: Manifest, env: Dict[str, Any] | None = None  # noqa: UP006
           ) -> Dict[str, Any]:  # noqa: UP006
    _make_links(directory, want)
    have = local_manifest(directory)
    for rel in [r for r in have if r not in want]:
        # What the environment does not hold (an older package's files, a stale link):
        # the target passed the refusal check (absent, empty, an environment, ours).
        os.unlink(os.path.join(directory, rel))
        del have[rel]
    _prune(directory, want)
    bad = compare(want, have)
    if bad:
        return {"v": ENVFACTS_VERSION, "differ": bad[:50], "ndiffer": len(bad)}
    return {"v": ENVFACTS_VERSION, "record": write_record(directory, have, env)}


def main(argv: List[str] | None = None) -> int:  # noqa: UP006
    args = list(sys.argv[1:] if argv is None else argv)
    mode, rest = (args[0], args[1:]) if args else ("", [])
    try:
        if mode == "facts":
            out = facts(rest)
        elif mode == "finish":
            header = json.loads(sys.stdin.buffer.readline().decode("utf-8"))
            out = finish(rest[0], header["entries"], header.get("env"))
        elif mode == "record":
            out = {"v": ENVFACTS_VERSION, "record": write_record(rest[0], local_manifest(rest[0]))}
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        out = {"v": ENVFACTS_VERSION, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0 if "error" not in out else 1
