"""Move verified bytes from nodes to DEST: hashing on the source, streaming, checking on arrival.

Data path (chosen by measurement, see docs/collect-ckpt.md): one OpenSSH ``ssh``
process per stream runs ``tar -c`` of the stream's files on the node and we read the
tar stream here. OpenSSH does the crypto in C with AES-GCM, which paramiko's
pure-Python packet loop cannot match once several nodes stream at once; the
paramiko transport still does every listing/hashing command. ``method="sftp"``
(paramiko SFTP via :meth:`Transport.get`) is the fallback when no ``ssh`` binary
exists; ``transport: local`` hosts are read with a local ``tar``.

Every file is written to ``.<name>.ckpart`` next to its final name, hashed while it
is written, and renamed only when size and sha256 match what the source node
computed before the copy started. A file whose final name exists is therefore
always complete and verified; a killed run leaves only ``.ckpart`` files, which the
next run overwrites. Verified files are recorded in a state file, so a re-run skips
them without re-reading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from clusterkit.errors import CheckpointError
from clusterkit.fsutil import atomic_write_text
from clusterkit.node.ship import NodeCommand, node_command
from clusterkit.remote.base import DEFAULT_CONNECT_TIMEOUT_S, SSHTarget, Transport
from clusterkit.remote.command import remote_command

CHUNK = 1 << 20
PART_SUFFIX = ".ckpart"
STATE_FILE = ".clusterkit-collect-state.json"
# Fastest first: AES-GCM uses AES-NI/PMULL; chacha20 is OpenSSH's default but ~2x slower
# per core on x86 with AES-NI. Every OpenSSH since 6.2 offers one of these.
SSH_CIPHERS = ("aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,"
               "aes128-ctr,aes256-ctr")
SERVER_ALIVE_S = 5
# A stream that delivers no byte for this long is killed (a hung disk or tar on the node;
# a dead peer is already caught by ServerAlive* within ~20 s).
STALL_TIMEOUT_S = 300.0
TAR_BLOCKING = 2048  # 512-byte blocks per record: 1 MiB writes into the pipe



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
    raw = json.loads(stdout.strip().splitlines()[-1])
    files = {rel: Hashed(int(v[0]), float(v[1]), str(v[2])) for rel, v in raw["files"].items()}
    return files, {str(k): str(v) for k, v in raw["errors"].items()}


class PendingHashes:
    """Source checksums that are still being computed while the streams already run.

    A received file waits here (as ``.ckpart``) until its node reported the sha256;
    the copy is renamed into place only if it matches, exactly as when the hash was
    known up front.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self.hashes: dict[tuple[str, str], Hashed] = {}
        self.problems: list[str] = []

    def resolve(self, hashes: Mapping[tuple[str, str], Hashed], problems: Sequence[str]) -> None:
        self.hashes, self.problems = dict(hashes), list(problems)
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def get(self, node: str, relpath: str) -> Hashed | None:
        self._done.wait()
        return self.hashes.get((node, relpath))


@dataclass(frozen=True)
class Wanted:
    """One file to bring to DEST from ``node`` (``relpath`` relative to both roots).
    ``sha256`` is empty while the source checksum is still pending."""

    node: str
    relpath: str
    size: int
    sha256: str
    mtime: float = 0.0  # at listing; a pending checksum taken at another mtime is refused


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
        st = os.stat(os.path.join(self.dest, relpath))
        with self._lock:
            self.files[relpath] = {"sha256": sha256, "size": st.st_size,
                                   "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
            text = json.dumps({"v": 1, "files": self.files}, indent=0, sort_keys=True)
            atomic_write_text(self.path, text + "\n")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


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


class _Receiver:
    """Writes one file to its part name while hashing, then verifies and renames."""

    def __init__(self, dest: str, state: DestState, sink: ProgressSink, node: str,
                 result: NodeResult, fsync: bool, pending: PendingHashes | None = None) -> None:
        self.dest, self.state, self.sink, self.node = dest, state, sink, node
        self.result, self.fsync, self.pending = result, fsync, pending
        self.last_activity = time.monotonic()

    def receive(self, w: Wanted, src: IO[bytes]) -> None:
        final = os.path.join(self.dest, w.relpath)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        part = part_path(final)
        h = hashlib.sha256()
        got = 0
        try:
            with open(part, "wb") as out:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    got += len(chunk)
                    self.last_activity = time.monotonic()
                    self.sink.advance(self.node, len(chunk))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        self.finish(w, part, final, got, h.hexdigest())

    def _expected(self, w: Wanted) -> tuple[int, str] | str:
        """(size, sha256) the copy must have, or why there is none."""
        if w.sha256:
            return w.size, w.sha256
        if self.pending is not None:
            while not self.pending.wait(5.0):
                self.last_activity = time.monotonic()  # waiting on hashes is not a stall
        h = self.pending.get(w.node, w.relpath) if self.pending is not None else None
        if h is None:
            return "no source checksum (hashing on the node failed)"
        if h.size != w.size or (w.mtime and h.mtime != w.mtime):
            return f"changed on {w.node} since listing (size/mtime differ when hashed)"
        return h.size, h.sha256

    def finish(self, w: Wanted, part: str, final: str, got: int, digest: str) -> None:
        expected = self._expected(w)
        if isinstance(expected, str) or got != expected[0] or digest != expected[1]:
            with contextlib.suppress(OSError):
                os.unlink(part)
            why = (expected if isinstance(expected, str) else
                   f"size mismatch: source had {expected[0]} bytes when hashed, received {got}"
                   if got != expected[0] else
                   f"sha256 mismatch: source {expected[1][:16]}… when hashed on {w.node}, "
                   f"received {digest[:16]}… (changed on the node after hashing, or "
                   "corrupted in transit)")
            self.result.failed[w.relpath] = why
            self.sink.file_done(self.node, w.relpath, got, "failed", why)
            return
        if self.fsync:
            with open(part, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(part, final)
        self.state.record(w.relpath, digest)
        self.result.copied.append(w.relpath)
        self.result.bytes_copied += got
        self.sink.file_done(self.node, w.relpath, got, "copied")


def openssh_argv(target: SSHTarget, command: str,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> list[str]:
    """``ssh`` argv with the target's options as ``-o`` words (:meth:`SSHTarget.options`).

    ssh then reads ~/.ssh/config and /etc/ssh/ssh_config itself, first value wins —
    the same order the paramiko transport follows (clusterkit.remote.sshconfig).
    """
    argv = ["ssh", "-T", "-x", "-a", "-o", "BatchMode=yes", "-o", "Compression=no",
            "-o", f"ConnectTimeout={max(1, int(connect_timeout))}",
            "-o", f"ServerAliveInterval={SERVER_ALIVE_S}", "-o", "ServerAliveCountMax=4",
            "-c", SSH_CIPHERS]
    if target.config_file:
        argv += ["-F", target.config_file]
    for key, value in target.options().items():  # the one mapping paramiko and pdsh use too
        argv += ["-o", f"{key}={value}"]
    return [*argv, "--", target.address, command]


def tar_words(root: str, relpaths: Sequence[str]) -> list[str]:
    return ["tar", "-C", root, "-b", str(TAR_BLOCKING), "-cf", "-", "--", *relpaths]


def _stream_argv(target: SSHTarget, root: str, relpaths: Sequence[str],
                 connect_timeout: float) -> list[str]:
    words = tar_words(root, relpaths)
    if target.local:
        return words
    return openssh_argv(target, remote_command(words), connect_timeout)


def fetch_stream(target: SSHTarget, root: str, files: Sequence[Wanted], dest: str,
                 state: DestState, sink: ProgressSink, result: NodeResult, *,
                 fsync: bool = True, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
                 stall_timeout: float = STALL_TIMEOUT_S,
                 pending: PendingHashes | None = None) -> None:
    """One tar stream of ``files`` from ``target`` into DEST (per-file results in ``result``)."""
    if not files:
        return
    wanted = {w.relpath: w for w in files}
    argv = _stream_argv(target, root, [w.relpath for w in files], connect_timeout)
    receiver = _Receiver(dest, state, sink, target.name, result, fsync, pending)
    broke = ""
    with tempfile.TemporaryFile() as errf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=errf, start_new_session=True)
        if on_start is not None:
            on_start(proc)
        assert proc.stdout is not None
        done = threading.Event()
        watchdog = threading.Thread(target=_watch, args=(proc, receiver, done, stall_timeout),
                                    daemon=True)
        watchdog.start()
        try:
            _read_tar(proc.stdout, wanted, receiver)
        except (tarfile.TarError, OSError) as exc:
            broke = f"stream broke ({exc}); "
        finally:
            done.set()
            with contextlib.suppress(OSError):
                proc.stdout.close()
            code = _reap(proc)
            errf.seek(0)
            stderr = " ".join(errf.read().decode("utf-8", "replace").split())
    stalled = result.failed.pop("<stall>", "")
    for rel in wanted:
        if rel not in result.copied and rel not in result.failed:
            why = (f"not received: {stalled + '; ' if stalled else ''}{broke}exit {code}"
                   + (f": {stderr[-300:]}" if stderr else ""))
            result.failed[rel] = why
            sink.file_done(target.name, rel, 0, "failed", why)


def _watch(proc: subprocess.Popen[bytes], receiver: _Receiver, done: threading.Event,
           stall_timeout: float) -> None:
    """Kill the stream when no byte arrived for ``stall_timeout`` seconds."""
    while not done.wait(min(5.0, stall_timeout)):
        if time.monotonic() - receiver.last_activity > stall_timeout:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            receiver.result.failed.setdefault(
                "<stall>", f"no data for {stall_timeout:.0f}s: stream killed")
            return


def _read_tar(stream: IO[bytes], wanted: Mapping[str, Wanted], receiver: _Receiver) -> None:
    with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK) as tf:
        for member in tf:
            w = wanted.get(member.name)
            if w is None or not member.isfile():
                # Never write a name we did not ask for (tar streams carry paths).
                continue
            src = tf.extractfile(member)
            if src is None:
                continue
            receiver.receive(w, src)


def _reap(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        return proc.wait()


def fetch_sftp(transport: Transport, target: SSHTarget, root: str, files: Sequence[Wanted],
               dest: str, state: DestState, sink: ProgressSink, result: NodeResult, *,
               fsync: bool = True, pending: PendingHashes | None = None) -> None:
    """Fallback without an ``ssh`` binary: SFTP each file to its part name, then verify."""
    receiver = _Receiver(dest, state, sink, target.name, result, fsync, pending)
    for w in files:
        final = os.path.join(dest, w.relpath)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        part = part_path(final)
        try:
            transport.get(target, posixpath.join(root, w.relpath), part)
            size = os.path.getsize(part)
            sink.advance(target.name, size)
            receiver.finish(w, part, final, size, sha256_file(part))
        except CheckpointError:
            raise
        except Exception as exc:  # TransportError and OSError alike: per-file failure
            with contextlib.suppress(OSError):
                os.unlink(part)
            why = getattr(exc, "message", None) or str(exc)
            result.failed[w.relpath] = why
            sink.file_done(target.name, w.relpath, 0, "failed", why)


def split_streams(files: Sequence[Wanted], streams: int) -> list[list[Wanted]]:
    """Spread one node's files over ``streams`` groups of similar byte counts."""
    groups: list[list[Wanted]] = [[] for _ in range(max(1, min(streams, len(files))))]
    sizes = [0] * len(groups)
    for w in sorted(files, key=lambda f: -f.size):
        i = sizes.index(min(sizes))
        groups[i].append(w)
        sizes[i] += w.size
    return [g for g in groups if g]


def have_ssh_binary() -> bool:
    return shutil.which("ssh") is not None and shutil.which("tar") is not None


def grouped(items: Iterable[Wanted]) -> dict[str, list[Wanted]]:
    out: dict[str, list[Wanted]] = {}
    for w in items:
        out.setdefault(w.node, []).append(w)
    return out


def now() -> float:
    return time.monotonic()
