"""Node program: the node half of ``clusterkit sync`` (a code directory to the node).

``sync plan DEST`` reads the launcher's manifest (one JSON line:
``{"files": {rel: [size, mtime]}}``) from stdin and answers, per file, whether
the node's copy is the same by size+mtime, and for those with the same size but
another mtime its sha256 (the launcher compares checksums); plus the files the
node has that the manifest lacks (for ``--delete``).

``sync apply DEST`` reads one JSON header line (``{"files": {rel: [sha256, mtime,
mode]}, "touch": {rel: mtime}, "delete": [rel]}``) and then an uncompressed tar
stream of exactly those files. Each file is written to a temporary name in its
directory, fsynced, checked against its sha256 and renamed into place, so a
reader never sees half a file. Prints one JSON line with what was done.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
from typing import IO, Any

SYNC_VERSION = 1
CHUNK = 1 << 20
TMP_MARK = ".ck-sync-tmp."


def _inside(dest: str, rel: str) -> str:
    """The absolute path of ``rel`` under ``dest``; refuses anything that escapes it."""
    path = os.path.normpath(os.path.join(dest, rel))
    if os.path.isabs(rel) or not path.startswith(os.path.normpath(dest) + os.sep):
        raise ValueError(f"refusing path outside the destination: {rel!r}")
    return path


def _walk(dest: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for d, dirs, names in os.walk(dest):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(d, n)
            if TMP_MARK in n or not os.path.isfile(p) or os.path.islink(p):
                continue
            st = os.stat(p)
            out[os.path.relpath(p, dest)] = [st.st_size, st.st_mtime]
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def plan(dest: str, manifest: dict[str, list[float]]) -> dict[str, Any]:
    have = _walk(dest) if os.path.isdir(dest) else {}
    same, check, send = [], {}, []
    for rel, (size, mtime) in manifest.items():
        got = have.get(rel)
        if got is None or int(got[0]) != int(size):
            send.append(rel)
        elif abs(got[1] - mtime) < 1e-6:
            same.append(rel)
        else:  # same size, other mtime: the launcher decides by checksum
            check[rel] = _sha256(os.path.join(dest, rel))
    extra = sorted(set(have) - set(manifest))
    return {"v": SYNC_VERSION, "same": same, "check": check, "send": send, "extra": extra}


def _write_member(dest: str, tar: tarfile.TarFile, member: tarfile.TarInfo,
                  want: list[Any]) -> int:
    path = _inside(dest, member.name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Unique per writer: on a shared workdir several nodes' syncs meet in one directory.
    tmp = os.path.join(os.path.dirname(path), "%s%s.%d.%s" % (  # noqa: UP031
        TMP_MARK, os.path.basename(path), os.getpid(), os.urandom(4).hex()))
    src = tar.extractfile(member)
    if src is None:
        raise ValueError(f"{member.name}: not a regular file in the stream")
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for block in iter(lambda: src.read(CHUNK), b""):
            h.update(block)
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    if h.hexdigest() != want[0]:
        os.unlink(tmp)
        raise ValueError(f"{member.name}: checksum mismatch after transfer")
    os.chmod(tmp, int(want[2]) & 0o7777)
    os.utime(tmp, (want[1], want[1]))
    os.replace(tmp, path)
    return member.size


def apply(dest: str, header: dict[str, Any], stream: IO[bytes]) -> dict[str, Any]:
    files: dict[str, list[Any]] = header.get("files", {})
    os.makedirs(dest, exist_ok=True)
    written, nbytes = [], 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if member.name not in files or not member.isfile():
                raise ValueError(f"unexpected entry in the stream: {member.name!r}")
            nbytes += _write_member(dest, tar, member, files[member.name])
            written.append(member.name)
    missing = sorted(set(files) - set(written))
    if missing:
        raise ValueError(f"the stream ended before {len(missing)} file(s): {missing[:3]}")
    for rel, mtime in header.get("touch", {}).items():
        os.utime(_inside(dest, rel), (mtime, mtime))
    deleted = []
    for rel in header.get("delete", []):
        path = _inside(dest, rel)
        if os.path.isfile(path):
            os.unlink(path)
            deleted.append(rel)
    return {"v": SYNC_VERSION, "written": written, "bytes": nbytes,
            "touched": sorted(header.get("touch", {})), "deleted": deleted,
            "verified": len(written)}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    mode, dest = args[0], os.path.expanduser(args[1])
    stream = sys.stdin.buffer
    try:
        header = json.loads(stream.readline().decode("utf-8"))
        if mode == "plan":
            out = plan(dest, header["files"])
        elif mode == "apply":
            out = apply(dest, header, stream)
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except (OSError, ValueError, KeyError, tarfile.TarError) as exc:
        out = {"v": SYNC_VERSION, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0 if "error" not in out else 1
