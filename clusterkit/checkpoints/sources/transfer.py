"""Move verified bytes from nodes to DEST: hashed as read on the node, checked on arrival.

Data path (chosen by measurement, see docs/collect-ckpt.md): one session per node
(:mod:`clusterkit.checkpoints.sources.session`, one OpenSSH ``ssh`` running the node program
:mod:`clusterkit.node.ckpt.stream`) lists, hashes and streams. The node reads each file
once, hashing it as it sends; we hash what arrives as we write it. A file is renamed
into place only when both digests, the size and the listing's mtime agree (or, when
the source checksum was taken before the copy — re-runs, ``--dry-run`` — equal that
one). ``method="sftp"`` (paramiko SFTP via :meth:`Transport.get`) is the fallback when
no ``ssh`` binary exists.

Every file is written to ``.<name>.ckpart`` next to its final name and renamed only
once verified, after an fsync (done off the stream's thread, so the next file keeps
arriving). A file whose final name exists is therefore always complete and verified;
a killed run leaves only ``.ckpart`` files, which the next run overwrites. Verified
files are recorded in a state file, so a re-run skips them without re-reading.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from clusterkit.checkpoints.sources.session import NodeSession, SessionError
from clusterkit.errors import CheckpointError
from clusterkit.fsutil import atomic_write_text
from clusterkit.node.hashing import sha256_file
from clusterkit.node.protocol import answer_of
from clusterkit.remote.base import SSHTarget, Transport
from clusterkit.ship import NodeCommand, node_command

CHUNK = 1 << 20
PART_SUFFIX = ".ckpart"
STATE_FILE = ".clusterkit-collect-state.json"
# A stream that delivers no byte for this long is killed (a hung disk on the node;
# a dead peer is already caught by ServerAlive* within ~20 s).
STALL_TIMEOUT_S = 300.0
HASH_TIMEOUT_S = 3600.0  # sha256 of one node's files, done on the node
STATE_EVERY_S = 2.0


@dataclass(frozen=True)
class Hashed:
    size: int
    mtime: float
    sha256: str


def hash_command(python: str, root: str, relpaths: Sequence[str], threads: int = 4
                 ) -> NodeCommand:
    """The node program :mod:`clusterkit.node.hashing` over ``relpaths`` under ``root``."""
    return node_command(python, "hashing", [root, json.dumps(list(relpaths)), str(threads)])


def parse_hashes(stdout: str) -> tuple[dict[str, Hashed], dict[str, str]]:
    raw = answer_of(stdout, "hashing")
    files = {rel: Hashed(int(v[0]), float(v[1]), str(v[2])) for rel, v in raw["files"].items()}
    return files, {str(k): str(v) for k, v in raw["errors"].items()}


@dataclass(frozen=True)
class Wanted:
    """One file to bring to DEST from ``node`` (``relpath`` relative to both roots).
    ``sha256`` is empty while the source checksum is still pending."""

    node: str
    relpath: str
    size: int
    sha256: str
    mtime: float = 0.0  # at listing; a pending checksum taken at another mtime is refused
    # Set when ``sha256`` is a replica manifest's: what a different digest means.
    mismatch: str = ""


@dataclass
class NodeResult:
    node: str
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # relpath -> why
    bytes_copied: int = 0
    seconds: float = 0.0


class ProgressSink(Protocol):
    """Receives transfer events from worker threads (implementations must be thread-safe)."""

    def begin(self, per_node_bytes: Mapping[str, int]) -> None: ...

    def advance(self, node: str, nbytes: int) -> None: ...

    def file_done(self, node: str, relpath: str, size: int, status: str, detail: str = "") -> None: ...

    def end(self) -> None: ...


class NullProgress:
    def begin(self, per_node_bytes: Mapping[str, int]) -> None:
        return None

    def advance(self, node: str, nbytes: int) -> None:
        return None

    def file_done(self, node: str, relpath: str, size: int, status: str, detail: str = "") -> None:
        return None

    def end(self) -> None:
        return None


# ------------------------------------------------------------------ DEST state


class DestState:
    """Which DEST files were verified, keyed by relpath; persisted after each file."""

    def __init__(self, dest: str) -> None:
        self.dest = dest
        self.path = os.path.join(dest, STATE_FILE)
        self._lock = threading.Lock()
        self._dirty, self._written = False, 0.0
        self.files: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            with open(self.path, encoding="utf-8") as fh:
                raw = json.load(fh)
            self.files = {str(k): dict(v) for k, v in raw.get("files", {}).items()}

    def is_verified(self, w: Wanted) -> bool:
        """The final file exists, is the one we verified, and had the wanted sha256."""
        final = os.path.join(self.dest, w.relpath)
        try:
            st = os.stat(final)
        except OSError:
            return False
        with self._lock:
            rec = self.files.get(w.relpath)
        if rec and rec.get("sha256") == w.sha256 and rec.get("size") == st.st_size \
                and rec.get("mtime_ns") == st.st_mtime_ns and rec.get("ino") == st.st_ino:
            return True
        # Renamed but not recorded (killed in between), or the record is stale: re-hash.
        if st.st_size != w.size or sha256_file(final) != w.sha256:
            return False
        self.record(w.relpath, w.sha256)
        return True

    def record(self, relpath: str, sha256: str) -> None:
        """Remember a verified file; written out at most every ``STATE_EVERY_S`` (each
        write is an fsync'd file). A file renamed but not yet written here is re-hashed
        by the next run, never trusted blindly."""
        st = os.stat(os.path.join(self.dest, relpath))
        with self._lock:
            self.files[relpath] = {"sha256": sha256, "size": st.st_size,
                                   "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
            self._dirty = True
            if time.monotonic() - self._written >= STATE_EVERY_S:
                self._write()

    def flush(self) -> None:
        with self._lock:
            if self._dirty:
                self._write()

    def _write(self) -> None:
        """Caller holds the lock."""
        text = json.dumps({"v": 1, "files": self.files}, indent=0, sort_keys=True)
        atomic_write_text(self.path, text + "\n")
        self._dirty, self._written = False, time.monotonic()


def part_path(final: str) -> str:
    d, name = os.path.split(final)
    return os.path.join(d, f".{name}{PART_SUFFIX}")


def clean_parts(dest: str, tag: str) -> int:
    """Remove ``.ckpart`` leftovers of a killed run (DEST top level and the tag dir)."""
    removed = 0
    for root in (dest, os.path.join(dest, tag)):
        names = os.listdir(root) if os.path.isdir(root) else []
        for name in names:
            if name.startswith(".") and name.endswith(PART_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(root, name))
                    removed += 1
    return removed


# ------------------------------------------------------------------ receiving


class Receiver:
    """Writes one file to its part name while hashing; verifies, fsyncs and renames it."""

    def __init__(self, dest: str, state: DestState, sink: ProgressSink, node: str,
                 result: NodeResult, fsync: bool) -> None:
        self.dest, self.state, self.sink, self.node = dest, state, sink, node
        self.result, self.fsync = result, fsync
        self.lock = threading.Lock()  # result lists: the stream and the finisher thread

    def receive_exact(self, w: Wanted, src: IO[bytes], size: int, session: NodeSession,
                      buf: bytearray) -> tuple[str, str, str]:
        """Exactly ``size`` bytes of ``src`` into the part file; (part, final, sha256)."""
        final = os.path.join(self.dest, w.relpath)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        part = part_path(final)
        h = hashlib.sha256()
        view = memoryview(buf)
        left = size
        try:
            with open(part, "wb", buffering=0) as out:
                while left:
                    n = src.readinto(view[:min(CHUNK, left)])  # type: ignore[attr-defined]
                    if not n:
                        raise SessionError(f"stream ended inside {w.relpath}")
                    session.expect_within(STALL_TIMEOUT_S)
                    h.update(view[:n])
                    out.write(view[:n])
                    left -= n
                    self.sink.advance(self.node, n)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        return part, final, h.hexdigest()

    def finish(self, w: Wanted, part: str, final: str, got: int, digest: str,
               expected: tuple[int, str] | str) -> None:
        """Rename into place when ``expected`` (size, sha256) matches, else discard.
        ``expected`` is a reason string when there is nothing to match."""
        if isinstance(expected, str) or got != expected[0] or digest != expected[1]:
            with contextlib.suppress(OSError):
                os.unlink(part)
            why = (expected if isinstance(expected, str) else
                   f"{w.mismatch}: read sha256 {digest[:16]}…, the manifest has "
                   f"{expected[1][:16]}…" if w.mismatch and got == expected[0] else
                   f"size mismatch: source had {expected[0]} bytes when hashed, received {got}"
                   if got != expected[0] else
                   f"sha256 mismatch: source {expected[1][:16]}… when hashed on {w.node}, "
                   f"received {digest[:16]}… (changed on the node after hashing, or "
                   "corrupted in transit)")
            self.failed(w.relpath, why, got)
            return
        if self.fsync:
            with open(part, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(part, final)
        self.state.record(w.relpath, digest)
        with self.lock:
            self.result.copied.append(w.relpath)
            self.result.bytes_copied += got
        self.sink.file_done(self.node, w.relpath, got, "copied")

    def failed(self, rel: str, why: str, got: int = 0) -> None:
        with self.lock:
            self.result.failed[rel] = why
        self.sink.file_done(self.node, rel, got, "failed", why)


def expected_from(w: Wanted, end: Mapping[str, Any], digest: str, src: str = ""
                  ) -> tuple[int, str] | str:
    """What the received copy must equal, from the node's end-of-file frame (``src``:
    the path the node was asked for, when not ``w.relpath``)."""
    if end.get("t") != "end" or end.get("rel") != (src or w.relpath):
        return f"protocol error: expected the end of {w.relpath}, got {str(end)[:120]}"
    if w.sha256:  # checksummed before the copy (re-run, --dry-run, test hook): must match
        if w.mismatch and str(end.get("sha256")) != digest:  # not the disk: the way here
            return (f"corrupted in transit: {w.node} read {str(end.get('sha256'))[:16]}…, "
                    f"received {digest[:16]}…")
        return w.size, w.sha256
    if end.get("changed"):
        return f"changed on {w.node} while it was being sent (size/mtime moved)"
    if int(end["size"]) != w.size or (w.mtime and float(end["mtime"]) != w.mtime):
        return f"changed on {w.node} since listing (size/mtime differ when sent)"
    if str(end["sha256"]) != digest:
        return (f"corrupted in transit: {w.node} read {str(end['sha256'])[:16]}…, "
                f"received {digest[:16]}…")
    return w.size, digest


@dataclass
class NodeStream:
    """What one node's session answered: sha256 of what it sent or hashed."""

    hashes: dict[str, Hashed] = field(default_factory=dict)
    hash_errors: dict[str, str] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)  # sent files with a file or err frame
    waiting: set[int] = field(default_factory=set)  # request ids without their answer


def stream_node(session: NodeSession, files: Sequence[Wanted], hash_only: Sequence[str],
                receiver: Receiver, base: str = "") -> NodeStream:
    """``files`` over ``session`` into DEST while the node hashes ``hash_only`` (copies
    we do not send, or everything before a phased copy). Files not received are marked
    failed with the session's last words (ssh's stderr, exit status). ``base``: the
    files are read under that dir on the node (a replica), not under its root; the
    answers are keyed by relpath all the same."""
    st = NodeStream()
    wanted = {at(base, w.relpath): w for w in files}
    if hash_only:
        st.waiting.add(session.request("hash", HASH_TIMEOUT_S,
                                       files=[at(base, r) for r in hash_only]))
    if files:
        st.waiting.add(session.request("send", STALL_TIMEOUT_S, files=list(wanted)))
    buf = bytearray(CHUNK)
    with cf.ThreadPoolExecutor(1, thread_name_prefix=f"clusterkit-fsync-{session.name}") as fin:
        try:
            while st.waiting:
                _one_message(session, wanted, receiver, st, buf, fin)
        except (SessionError, OSError, ValueError, KeyError) as exc:
            session.kill()
            why = f"not received: {exc}"
            for src, w in wanted.items():
                if src not in st.answered:
                    receiver.failed(w.relpath, why)
            for rel in hash_only:
                if at(base, rel) not in st.hashes:
                    st.hash_errors.setdefault(at(base, rel), why)
    if base:  # answers are keyed by the path asked for: back to relpaths
        st.hashes = {rel_under(base, k): v for k, v in st.hashes.items()}
        st.hash_errors = {rel_under(base, k): v for k, v in st.hash_errors.items()}
    return st


def at(base: str, rel: str) -> str:
    """Where the node reads ``rel``: under its root, or under ``base`` (absolute)."""
    return posixpath.join(base, rel) if base else rel


def rel_under(base: str, path: str) -> str:
    """The relpath a node's answer for ``path`` (asked as ``at(base, rel)``) stands for."""
    return path[len(base.rstrip("/")) + 1:] if path.startswith(base.rstrip("/") + "/") else path


def _one_message(session: NodeSession, wanted: Mapping[str, Wanted], receiver: Receiver,
                 st: NodeStream, buf: bytearray, fin: cf.ThreadPoolExecutor) -> None:
    msg = session.read_msg()
    kind = msg.get("t")
    if kind == "file":
        src = str(msg.get("rel"))
        w = wanted.get(src)
        if w is None:  # never write a name we did not ask for
            raise SessionError(f"unexpected file {src[:200]!r}")
        got = int(msg["size"])
        part, final, digest = receiver.receive_exact(w, session.stdout, got, session, buf)
        end = session.read_msg()
        st.answered.add(src)
        st.hashes[src] = Hashed(got, float(end.get("mtime", 0.0)), str(end.get("sha256")))
        fin.submit(receiver.finish, w, part, final, got, digest,
                   expected_from(w, end, digest, src))
    elif kind == "err":
        src = str(msg.get("rel"))
        st.answered.add(src)
        w = wanted.get(src)
        receiver.failed(w.relpath if w else src,
                        f"cannot read on {session.name}: {msg.get('why')}")
    elif kind == "hashes":
        files, errors = parse_hashes(json.dumps(msg))
        st.hashes.update(files)
        st.hash_errors.update(errors)
        st.waiting.discard(int(msg["id"]))
    elif kind == "sent":
        st.waiting.discard(int(msg["id"]))
        session.expect_within(HASH_TIMEOUT_S)  # a hash answer may still be on its way
    else:
        raise SessionError(f"unexpected answer {str(msg)[:200]}")


def fetch_sftp(transport: Transport, target: SSHTarget, root: str, files: Sequence[Wanted],
               dest: str, state: DestState, sink: ProgressSink, result: NodeResult, *,
               fsync: bool = True) -> None:
    """Fallback without an ``ssh`` binary: SFTP each file to its part name, then verify
    against the checksum its node computed before the copy."""
    receiver = Receiver(dest, state, sink, target.name, result, fsync)
    for w in files:
        final = os.path.join(dest, w.relpath)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        part = part_path(final)
        try:
            transport.get(target, posixpath.join(root, w.relpath), part)
            size = os.path.getsize(part)
            sink.advance(target.name, size)
            receiver.finish(w, part, final, size, sha256_file(part), (w.size, w.sha256))
        except CheckpointError:
            raise
        except Exception as exc:  # TransportError and OSError alike: per-file failure
            with contextlib.suppress(OSError):
                os.unlink(part)
            receiver.failed(w.relpath, getattr(exc, "message", None) or str(exc))


def have_ssh_binary() -> bool:
    return shutil.which("ssh") is not None


def grouped(items: Iterable[Wanted]) -> dict[str, list[Wanted]]:
    out: dict[str, list[Wanted]] = {}
    for w in items:
        out.setdefault(w.node, []).append(w)
    return out

