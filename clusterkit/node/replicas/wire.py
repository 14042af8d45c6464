"""Checkpoint replicas, agent to agent: the wire, the receiving server, the sending client.

Part of the node agent (node program ``agent.core``, ``ship.py``; issue 22,
docs/lost-a-node.md). Each node's agent runs a :class:`ReplicaServer` that receives
other nodes' checkpoint files into its replica area (``node/contract.py``:
``<ckpt dir>.replicas/node<N>/<tag>/``) and pushes its own finished checkpoints with
:func:`push` (driven by ``node/replicas/service.py``).

The wire (TCP, one connection per push; every line is ``\\n``-terminated):

1. server -> client: ``CKREP1 {"job_id", "index", "nonce"}`` (its job and node index,
   so the client knows it reached the right server on a shared port list, and a
   fresh random nonce);
2. client -> server: ``<mac> <header JSON>``: ``{"op": "push", "job_id", "source",
   "source_host", "holder", "tag", "files": [[rel, size, mtime], ...], "tags": [...]}``
   (``tags``: the source's current tag list, for pruning) or ``{"op": "bye", ...}``
   (the source is done for this job); ``mac`` = HMAC-SHA256(secret, nonce + header);
3. server -> client: ``OK``, ``HAVE`` (a complete copy of these files is here
   already) or ``ERR <why>``;
4. client -> server (push): every file's bytes in the header's order, exactly its
   size, then ``<mac2> <trailer JSON>``: ``{"sha256": {rel: hex}, "changed": [rel]}``
   (digests computed while the file was read, one read; ``changed``: files whose size
   or mtime moved during the read); ``mac2`` = HMAC(secret, nonce + mac + trailer);
5. server -> client: ``OK`` once the files are fsynced, every digest and the MAC
   checked, the manifest written last and the partial dir renamed into place; else
   ``ERR <why>`` and the partial dir is gone.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from clusterkit.node.contract import (
    LATEST_FILE,
    RECOVERY_SCRIPTS,
    REPLICA_PARTIAL_PREFIX,
    replica_dir,
    replica_ports,
    replica_source_dir,
)
from clusterkit.node.hashing import mac
from clusterkit.node.replicas import priority
from clusterkit.node.replicas.area import (
    commit_copy,
    new_manifest,
    read_manifest,
    safe_rel,
    sweep_partials,
)

GREETING = b"CKREP1"
CHUNK = 1 << 20  # modest buffers: sequential I/O that leaves the ranks the disk
MAX_LINE = 16 << 20  # a header names every file of a tag: bounded all the same
CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 60.0  # no byte for this long: the peer is gone


class ReplicaError(Exception):
    """A push that did not complete (said in the Replica event's ``detail``)."""


_said: set[str] = set()
_said_lock = threading.Lock()


def low_priority(log: Callable[[str], None], path: str) -> None:
    """This thread's CPU and I/O below the ranks' (``node/replicas/priority.py``); what applied
    goes to the node's log once per process (it is the same for every copy thread)."""
    words = priority.lower_this_thread(path)
    with _said_lock:
        if words in _said:
            return
        _said.add(words)
    log(f"replica: copies run at low priority: {words}")


class _Conn:
    """Line and exact-byte reads over a socket: lines through a small buffer, file
    bytes straight into one reused ``CHUNK`` buffer (``recv_into``, no copy per piece)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self._pieces: memoryview | None = None

    def line(self) -> bytes:
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE:
                raise ReplicaError("line too long")
            data = self.sock.recv(65536)
            if not data:
                raise ReplicaError("connection closed")
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def chunks(self, size: int) -> Any:
        """Exactly ``size`` bytes, in pieces; each piece is valid until the next."""
        left = size
        if self._pieces is None:
            self._pieces = memoryview(bytearray(CHUNK))
        while left:
            if self.buf:
                piece, self.buf = self.buf[:left], self.buf[left:]
                left -= len(piece)
                yield piece
                continue
            n = self.sock.recv_into(self._pieces, min(left, CHUNK))
            if not n:
                raise ReplicaError("connection closed inside a file")
            left -= n
            yield self._pieces[:n]

    def send(self, data: bytes | memoryview) -> None:
        self.sock.sendall(data)


def _signed(secret: bytes, nonce: bytes, doc: dict[str, Any], *extra: bytes) -> tuple[str, bytes]:
    body = json.dumps(doc, sort_keys=True).encode()
    m = mac(secret, nonce, *extra, body)
    return m, m.encode() + b" " + body + b"\n"


def _read_signed(conn: _Conn, secret: bytes, nonce: bytes, *extra: bytes) -> tuple[str, dict[str, Any]]:
    m, _, body = conn.line().partition(b" ")
    if not hmac.compare_digest(m.decode("ascii", "replace"), mac(secret, nonce, *extra, body)):
        raise ReplicaError("authentication failed (wrong job secret)")
    doc = json.loads(body.decode())
    if not isinstance(doc, dict):
        raise ReplicaError("malformed message")
    return m.decode(), doc


def _source_mtimes(head: dict[str, Any]) -> dict[str, float | None]:
    """rel -> the file's mtime on the source as the push header states it."""
    return {str(f[0]): (float(f[2]) if len(f) > 2 and isinstance(f[2], (int, float)) else None)
            for f in head["files"]}


class ReplicaServer:
    """Receives other nodes' pushes into this node's replica area (a thread per push).

    ``sources``: the node indexes expected to push here (their BYE ends the wait in
    :meth:`wait_sources`); ``tamper``: a test hook applied to each received piece."""

    def __init__(self, job_id: str, index: int, node: str, ckpt_dir: str, secret: str,
                 address: str = "0.0.0.0", sources: Sequence[int] = (),
                 log: Callable[[str], None] = lambda _m: None) -> None:
        self.job_id, self.index, self.node = job_id, index, node
        self.ckpt_dir = ckpt_dir
        self.secret = secret.encode()
        self.address = address
        self.sources: set[int] = set(sources)
        self.byes: set[int] = set()
        self.log = log
        self.sock: socket.socket | None = None
        self.port: int | None = None
        self._stop = threading.Event()
        self._bye = threading.Condition()
        self._busy: set[tuple[int, str]] = set()  # (source, tag) being received
        self._lock = threading.Lock()

    def start(self) -> int:
        """Sweep stale partial copies, bind the first free port of the job's list, serve."""
        for path in sweep_partials(self.ckpt_dir):
            self.log(f"replica: removed an interrupted copy {path}")
        last: OSError | None = None
        for port in replica_ports(self.job_id, self.index):
            for host in dict.fromkeys((self.address, "0.0.0.0")):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((host, port))
                except OSError as exc:
                    sock.close()
                    last = exc
                    continue
                sock.listen(16)
                self.sock, self.port = sock, port
                threading.Thread(target=self._accept, daemon=True).start()
                return port
        raise ReplicaError(f"no free replica port of {replica_ports(self.job_id, self.index)}: {last}")

    def stop(self) -> None:
        self._stop.set()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()

    def wait_sources(self, timeout: float) -> bool:
        """Until every expected source said BYE (True), or ``timeout`` passed."""
        end = time.monotonic() + timeout
        with self._bye:
            while not self.sources <= self.byes and not self._stop.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._bye.wait(min(left, 0.5))
        return self.sources <= self.byes

    def _accept(self) -> None:
        assert self.sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        low_priority(self.log, self.ckpt_dir)
        sock.settimeout(IO_TIMEOUT_S)
        conn = _Conn(sock)
        nonce = secrets.token_hex(16)
        try:
            conn.send(GREETING + b" " + json.dumps(
                {"job_id": self.job_id, "index": self.index, "nonce": nonce}).encode() + b"\n")
            hmac_, head = _read_signed(conn, self.secret, nonce.encode())
            if head.get("job_id") != self.job_id:
                raise ReplicaError("another job")
            if head.get("op") == "bye":
                self._got_bye(int(head["source"]))
                conn.send(b"OK\n")
            elif head.get("op") == "push":
                self._receive(conn, nonce, hmac_, head)
            else:
                raise ReplicaError(f"unknown op {head.get('op')!r}")
        except (ReplicaError, OSError, ValueError, KeyError, TypeError) as exc:
            self.log(f"replica: refused a push: {exc}")
            with contextlib.suppress(OSError):
                conn.send(b"ERR " + str(exc).encode()[:500].replace(b"\n", b" ") + b"\n")
        finally:
            sock.close()

    def _got_bye(self, source: int) -> None:
        with self._bye:
            self.byes.add(source)
            self._bye.notify_all()

    def _receive(self, conn: _Conn, nonce: str, head_mac: str, head: dict[str, Any]) -> None:
        source, tag = int(head["source"]), str(head["tag"])
        files: list[tuple[str, int]] = [(str(f[0]), int(f[1])) for f in head["files"]]
        if not tag or tag.startswith(".") or "/" in tag or not files \
                or not all(safe_rel(rel, tag) and size >= 0 for rel, size in files):
            raise ReplicaError("bad tag or file list")
        final = replica_dir(self.ckpt_dir, source, tag)
        if self._have(final, files, head):
            conn.send(b"HAVE\n")
            return
        with self._lock:
            if (source, tag) in self._busy:
                raise ReplicaError(f"{tag} of node index {source} is being received already")
            self._busy.add((source, tag))
        partial = os.path.join(replica_source_dir(self.ckpt_dir, source),
                               f"{REPLICA_PARTIAL_PREFIX}{tag}-{nonce}")
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            os.makedirs(partial)
            conn.send(b"OK\n")
            got = self._write_files(conn, partial, files)
            mtimes = _source_mtimes(head)
            _, trailer = _read_signed(conn, self.secret, nonce.encode(), head_mac.encode())
            self._check(trailer, got)
            manifest = new_manifest(self.job_id, tag, source, str(head.get("source_host", "")),
                                    self.node, {rel: (size, got[rel], mtimes.get(rel))
                                                for rel, size in files})
            commit_copy(partial, final, manifest)
            self._prune(source, tag, head.get("tags"))
            conn.send(b"OK\n")
            self.log(f"replica: received {tag} of node index {source}: "
                     f"{sum(size for _, size in files)} bytes in {time.monotonic() - t0:.1f} s, "
                     f"{time.thread_time() - c0:.2f} CPU s")
        finally:
            shutil.rmtree(partial, ignore_errors=True)
            with self._lock:
                self._busy.discard((source, tag))

    def _have(self, final: str, files: list[tuple[str, int]], head: dict[str, Any]) -> bool:
        """A complete copy of exactly these files as the source has them now: the same
        names, sizes and source mtimes (the source's own clock on both sides, so no
        clock skew between the nodes can make a stale copy look current)."""
        m = read_manifest(final)
        if m is None:
            return False
        mtimes = _source_mtimes(head)
        if None in mtimes.values() or len(mtimes) != len(files):
            return False
        have = {r: (int(e.get("size", -1)), e.get("mtime")) for r, e in m["files"].items()}
        return have == {rel: (size, mtimes[rel]) for rel, size in files}

    def _write_files(self, conn: _Conn, partial: str, files: list[tuple[str, int]]) -> dict[str, str]:
        got: dict[str, str] = {}
        for rel, size in files:
            path = os.path.join(partial, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            h = hashlib.sha256()
            with open(path, "wb") as fh:
                for piece in conn.chunks(size):
                    if self._stop.is_set():
                        raise ReplicaError("the agent is stopping")
                    h.update(piece)
                    fh.write(piece)
                fh.flush()
                os.fsync(fh.fileno())
                _drop_cache(fh.fileno())
            got[rel] = h.hexdigest()
        return got

    @staticmethod
    def _check(trailer: dict[str, Any], got: dict[str, str]) -> None:
        if trailer.get("changed"):
            raise ReplicaError("source files changed while they were read: "
                               + ", ".join(map(str, trailer["changed"][:3])))
        sent = trailer.get("sha256") or {}
        bad = [rel for rel, digest in got.items() if sent.get(rel) != digest]
        if bad:
            raise ReplicaError("sha256 mismatch (corrupted in transit): " + ", ".join(bad[:3]))

    def _prune(self, source: int, keep: str, tags: Any) -> None:
        """The source's keep policy: its copies whose tags are gone from the source."""
        if not isinstance(tags, list):
            return
        d = replica_source_dir(self.ckpt_dir, source)
        for name in os.listdir(d):
            if name != keep and name not in tags and not name.startswith("."):
                shutil.rmtree(os.path.join(d, name), ignore_errors=True)
                self.log(f"replica: pruned {name} of node index {source} (gone from the source)")


# ----------------------------------------------------------------- the sending side


def push_files(ckpt_dir: str, tag: str, index: int) -> list[str]:
    """What node ``index`` sends for ``tag`` (relpaths from its checkpoint dir): every
    file under the tag dir and, from node 0, ``latest`` (when it names this tag) and
    the recovery scripts."""
    out = []
    tag_dir = os.path.join(ckpt_dir, tag)
    for d, dirs, names in os.walk(tag_dir):
        dirs.sort()
        out += [os.path.relpath(os.path.join(d, n), ckpt_dir) for n in sorted(names)
                if os.path.isfile(os.path.join(d, n))]
    if index == 0:
        try:
            with open(os.path.join(ckpt_dir, LATEST_FILE), encoding="utf-8") as fh:
                if fh.read().strip() == tag:
                    out.append(LATEST_FILE)
        except OSError:
            pass
        out += [s for s in RECOVERY_SCRIPTS if os.path.isfile(os.path.join(ckpt_dir, s))]
    return out


def _connect(address: str, job_id: str, index: int) -> tuple[_Conn, str]:
    """The target's server: its port list in order, the greeting names job and index."""
    why = "no port answered"
    for port in replica_ports(job_id, index):
        try:
            sock = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            why = f"{address}:{port}: {exc}"
            continue
        sock.settimeout(IO_TIMEOUT_S)
        conn = _Conn(sock)
        try:
            word, _, rest = conn.line().partition(b" ")
            hello = json.loads(rest.decode()) if word == GREETING else {}
        except (ReplicaError, OSError, ValueError) as exc:
            hello, why = {}, f"{address}:{port}: {exc}"
        if hello.get("job_id") == job_id and hello.get("index") == index:
            return conn, str(hello["nonce"])
        sock.close()
    raise ReplicaError(f"no replica server of node index {index} at {address} ({why})")


def _reply(conn: _Conn) -> str:
    line = conn.line().decode("utf-8", "replace")
    if line.startswith("ERR"):
        raise ReplicaError(line[4:] or "refused")
    return line


def say_bye(target: dict[str, Any], job_id: str, source: int, secret: str) -> None:
    """Tell a target this node sends nothing more for this job."""
    conn, nonce = _connect(str(target["address"]), job_id, int(target["index"]))
    try:
        _, line = _signed(secret.encode(), nonce.encode(), {"op": "bye", "job_id": job_id,
                                                             "source": source})
        conn.send(line)
        _reply(conn)
    finally:
        conn.sock.close()


def push(ckpt_dir: str, tag: str, target: dict[str, Any], *, job_id: str, source: int,
         source_host: str, secret: str, tags: Sequence[str],
         stop: threading.Event | None = None,
         tamper: Callable[[bytes], bytes] | None = None) -> int:
    """Send ``tag`` to ``target`` ({"node", "index", "address"}); the bytes sent (0: the
    target had it). Raises :class:`ReplicaError` unless the target acked the copy.
    ``tamper``: a test hook applied to each piece on the wire (after hashing)."""
    rels = push_files(ckpt_dir, tag, source)
    stats = {r: os.stat(os.path.join(ckpt_dir, r)) for r in rels}
    key = secret.encode()
    conn, nonce = _connect(str(target["address"]), job_id, int(target["index"]))
    try:
        head = {"op": "push", "job_id": job_id, "source": source, "source_host": source_host,
                "holder": target["node"], "tag": tag, "tags": list(tags),
                "files": [[r, stats[r].st_size, stats[r].st_mtime] for r in rels]}
        head_mac, line = _signed(key, nonce.encode(), head)
        conn.send(line)
        if _reply(conn) == "HAVE":
            return 0
        digests, changed, sent = _send_files(conn, ckpt_dir, rels, stats, stop, tamper)
        _, line = _signed(key, nonce.encode(), {"sha256": digests, "changed": changed},
                          head_mac.encode())
        conn.send(line)
        _reply(conn)
        return sent
    finally:
        conn.sock.close()


def _drop_cache(fd: int) -> None:
    """A received copy is read only after a node is lost: its pages (clean after the
    fsync) leave the page cache to the ranks. Best effort (posix_fadvise is Linux/BSD)."""
    with contextlib.suppress(AttributeError, OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _send_files(conn: _Conn, ckpt_dir: str, rels: list[str], stats: dict[str, os.stat_result],
                stop: threading.Event | None,
                tamper: Callable[[bytes], bytes] | None) -> tuple[dict[str, str], list[str], int]:
    """Each file read once, into one reused buffer: hashed and sent from it, exactly its
    announced size. (``os.sendfile`` would spare the copy into the socket but not the
    read: the digest needs the bytes here, so it would read every byte twice.)"""
    digests: dict[str, str] = {}
    changed: list[str] = []
    sent = 0
    view = memoryview(bytearray(CHUNK))
    for rel in rels:
        size = stats[rel].st_size
        h = hashlib.sha256()
        left = size
        with open(os.path.join(ckpt_dir, rel), "rb", buffering=0) as fh:
            while left:
                if stop is not None and stop.is_set():
                    raise ReplicaError("the agent is stopping")
                n = fh.readinto(view[:min(CHUNK, left)])
                if not n:
                    raise ReplicaError(f"{rel} shrank while it was read")
                h.update(view[:n])
                conn.send(tamper(bytes(view[:n])) if tamper else view[:n])
                left -= n
                sent += n
            now = os.fstat(fh.fileno())
        if (now.st_size, now.st_mtime_ns) != (size, stats[rel].st_mtime_ns):
            changed.append(rel)
        digests[rel] = h.hexdigest()
    return digests, changed, sent
