"""Node program ``sync.chain``: one node of a pipelined distribution chain (``clusterkit sync``).

``sync.chain serve`` (started over SSH by ``clusterkit.sync.engine``; stdin: the
sources, then one JSON spec line, then control lines):

1. the spec names the destination, this node's index, the per-run secret (it lives
   only on stdin and in memory: never argv, env or a file) and the source's manifest
   (``[rel, size, mtime_ns, mode, sha256, [chunk sha256]]`` per file, node/sync/store.py)
   and its links (``[rel, target]``; none: links are left alone);
2. the node works out what it lacks (files it holds with the same sha256 are kept,
   a partial file's verified chunks too), listens on a TCP port and says
   ``{"ev": "ready", "port", "need", "need_bytes", "extra", "managed", "addr"}`` on stdout
   (``addr``: its address as the SSH session reached it, "" without SSH);
3. the launcher answers ``{"op": "go", "down": {"node", "address", "port"} | null,
   "delete": [rel]}``: the next node of the chain (or none) and what to delete;
4. an upstream (the launcher or the previous node) connects and streams **records**:
   :data:`HDR` (seq, file index, chunk index, length, number of targets) + the target
   node indexes + the bytes. The node writes a record it needs (each chunk checked
   against the source's sha256, the file renamed into place once complete) and at
   once passes every record a later node needs to its downstream, piece by piece;
5. the END record: the node deletes what ``go`` listed, makes the links it lacks
   (temp name + rename), writes its manifest, says
   ``{"ev": "done", "digest", "got", "failed"}`` and exits.

The wire (the TCP handshake, and the SSH session's stdin as the upstream where the
launcher cannot reach the port): node/sync/wire.py. A new upstream may replace a lost
one at any time: the node answers it the first record it (or its downstream) still lacks.
Events: ``progress``, ``blocked`` (the downstream is unreachable: the launcher feeds it),
``down-lost``, ``up-lost``, ``feed-from``, ``error``. ``sync.chain check
DEST [--deep]``: :func:`sync_store.check`; ``sync.chain ports P``: doctor's port check.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Any

from clusterkit.node.hashing import mac
from clusterkit.node.sync import store as store
from clusterkit.node.sync.wire import (
    CONNECT_TIMEOUT_S,
    CTRL,
    END,
    GREETING,
    HDR,
    IO_TIMEOUT_S,
    PORT_TRIES,
    PROGRESS_S,
    StdinUp,
    WireError,
    dial,
    read_line,
    recv_exact,
)


class Node:
    """One node's receiver, writer and forwarder."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.dest = os.path.abspath(os.path.expanduser(str(spec["dest"])))
        self.index = int(spec["index"])
        self.secret = str(spec["secret"]).encode()
        self.entries: list[list[Any]] = spec["files"]
        self.links: list[list[Any]] | None = spec.get("links")  # None: leave links alone
        self.links_held: dict[str, str] = {}
        self.links_todo: dict[str, str] = {}
        self.links_made: dict[str, str] = {}
        self.links_failed: dict[str, str] = {}  # (also in failed)
        self.port, self.ports = int(spec.get("port") or 0), int(spec.get("ports") or PORT_TRIES)
        self.out_lock = threading.Lock()
        self.relay_lock = threading.Lock()
        self.done = threading.Event()
        self.go = threading.Event()  # the launcher's go (the downstream) came
        self.next_seq = 0
        self.up: Any = None  # a socket, or StdinUp
        self.down: socket.socket | None = None
        self.down_addr: dict[str, Any] | None = None
        self.delete: list[str] = []
        self.need: dict[int, set[int]] = {}
        self.fds: dict[int, int] = {}
        self.got_bytes = 0  # verified
        self.written = 0  # written, verified or not yet (progress)
        self.completed: dict[str, list[Any]] = {}
        self.failed: dict[str, str] = {}
        self.doc: dict[str, Any] | None = None
        self.kept: dict[str, list[Any]] = {}

    # -------------------------------------------------------------- events
    def emit(self, ev: str, **kw: Any) -> None:
        kw["ev"] = ev
        with self.out_lock:
            sys.stdout.write(json.dumps(kw) + "\n")
            sys.stdout.flush()

    # -------------------------------------------------------------- set-up
    def prepare(self, delete_asked: bool) -> socket.socket:
        if os.path.lexists(self.dest) and not os.path.isdir(self.dest):
            raise WireError(f"{self.dest} exists and is not a directory")
        self.doc = store.read_manifest(self.dest)
        if delete_asked and self.doc is None and os.path.isdir(self.dest) and os.listdir(self.dest):
            raise WireError(f"--delete: {self.dest} holds no clusterkit sync manifest "
                            f"({store.MANIFEST}): sync did not fill it; sync once without "
                            "--delete first")
        os.makedirs(os.path.join(self.dest, store.PARTIAL_DIR), exist_ok=True)
        if self.links is not None:
            self.links_held, self.links_todo, refused = store.plan_links(
                self.dest, self.links, [str(x[0]) for x in self.entries + self.links],
                (self.doc or {}).get("links") or {})
            self.failed.update(refused)
            self.links_failed.update(refused)
        seen_sha: set[str] = set()
        for fi, e in enumerate(self.entries):
            rel, size, sha = str(e[store.REL]), int(e[store.SIZE]), str(e[store.SHA])
            path = store.inside(self.dest, rel)
            if store.held(self.dest, self.doc, rel, size, sha):
                self.kept[rel] = self._fix_meta(path, e)
                continue
            chunks = set(range(store.chunk_count(size)))
            if sha not in seen_sha:  # one receiver per partial file
                chunks -= store.verified_chunks(store.partial_path(self.dest, sha), e)
            seen_sha.add(sha)
            self.need[fi] = chunks
        return self._listen()

    def _fix_meta(self, path: str, e: list[Any]) -> list[Any]:
        """A held file's mode and mtime made the source's (content equal already)."""
        mtime, mode = int(e[store.MTIME]), int(e[store.MODE])
        st = os.stat(path)
        if st.st_mtime_ns != mtime:
            os.utime(path, ns=(mtime, mtime))
        if st.st_mode & 0o7777 != mode:
            os.chmod(path, mode)
        return [int(e[store.SIZE]), mtime, mode, str(e[store.SHA])]

    def _listen(self) -> socket.socket:
        why = ""
        for port in ([0] if not self.port else range(self.port, self.port + self.ports)):
            # A fresh socket per port: with SO_REUSEADDR, bind() can succeed where another
            # node program on this host listens and listen() then fails; the socket stays
            # bound and every later bind() on it fails with EINVAL.
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                srv.bind(("0.0.0.0", port))
                srv.listen(8)
                return srv
            except OSError as exc:
                srv.close()
                why = f"port {port}: {exc}"
        raise WireError(f"cannot listen ({why})")

    def need_bytes(self) -> int:
        return sum(store.chunk_len(int(self.entries[fi][store.SIZE]), c)
                   for fi, cs in self.need.items() for c in cs)

    def extras(self) -> list[str]:
        if not os.path.isdir(self.dest):
            return []
        wanted = {str(e[0]) for e in self.entries + (self.links or [])}
        return [r for r in store.walk(self.dest, self.links is not None) if r not in wanted]

    # -------------------------------------------------------------- the wire
    def accept_loop(self, srv: socket.socket) -> None:
        while not self.done.is_set():
            try:
                sock, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=self.serve_conn, args=(sock,), daemon=True).start()

    def serve_conn(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            nonce_s = secrets.token_hex(16).encode()
            sock.sendall(b"%s %s %d\n" % (GREETING, nonce_s, self.index))
            mode, nonce_c, their = read_line(sock).split(b" ")
            if not hmac.compare_digest(their.decode(), mac(self.secret, b"c", nonce_s, nonce_c, mode)):
                raise WireError("authentication failed")
            mine = mac(self.secret, b"s", nonce_c, nonce_s).encode()
            if mode == b"probe":
                sock.sendall(b"%s %d\n" % (mine, self.next_seq))
                sock.close()
                return
            if not self.go.wait(IO_TIMEOUT_S):
                raise WireError("no go from the launcher")
            old = self.up
            self.up = sock
            if old is not None:  # a new upstream replaces a lost (or slow) one
                with contextlib.suppress(OSError):
                    old.shutdown(socket.SHUT_RDWR)
            with self.relay_lock:
                if self.up is not sock:
                    raise WireError("replaced")
                start = min(self.next_seq, self._downstream())
                sock.sendall(b"%s %d\n" % (mine, start))
                sock.settimeout(IO_TIMEOUT_S)
                self.relay(sock, start)
        except (OSError, ValueError, WireError) as exc:
            if not self.done.is_set() and self.up is sock:
                self.emit("up-lost", why=str(exc), seq=self.next_seq)
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _downstream(self) -> int:
        """(Re)connect the downstream; the first record it lacks (ours when none)."""
        if self.down is not None or self.down_addr is None:
            return self.next_seq
        d = self.down_addr
        try:
            self.down, seq = dial(str(d["address"]), int(d["port"]), self.secret.decode())
            return seq
        except (OSError, ValueError, WireError) as exc:
            self.down_addr = None
            self.emit("blocked", down=d["node"], port=int(d["port"]), why=str(exc))
            return self.next_seq

    def _forward(self, data: Any) -> None:
        if self.down is None:
            return
        try:
            self.down.sendall(data)
        except OSError as exc:
            self._drop_down("down-lost", str(exc))

    def _drop_down(self, ev: str, why: str) -> None:
        d, self.down = self.down, None
        if ev != "resync":  # resync: the same downstream, reconnected with the next upstream
            self.down_addr = None
        if d is not None:
            with contextlib.suppress(OSError):
                d.close()
            self.emit(ev, why=why)

    def relay(self, up: Any, start: int) -> None:
        buf = bytearray(store.READ)
        mv = memoryview(buf)
        while True:
            seq, fi, ci, n, nto = HDR.unpack(recv_exact(up, HDR.size))
            raw_to = recv_exact(up, 2 * nto)
            to = struct.unpack(f"!{nto}H", raw_to)
            fwd = self.down is not None and (fi == END or (fi != CTRL and to and max(to) > self.index))
            if fwd:
                self._forward(HDR.pack(seq, fi, ci, n, nto) + raw_to)
            if fi == END:
                self.finish()
                return
            if fi == CTRL:  # a launcher message inside a stdin feed
                if self.op(json.loads(recv_exact(up, n))) == "stop":
                    raise WireError("stopped by the launcher")
                continue
            write = self.index in to and seq >= self.next_seq and ci in self.need.get(fi, ())
            h = hashlib.sha256() if write else None
            fd = self._fd(fi) if write else -1
            off, left = ci * store.CHUNK, n
            try:
                while left:
                    k = up.recv_into(mv[:min(store.READ, left)])
                    if not k:
                        raise WireError("connection closed inside a record")
                    piece = mv[:k]
                    if h is not None:
                        h = self._write(fi, fd, piece, off, h)
                        off += k
                    if fwd:
                        self._forward(piece)
                    left -= k
            except (OSError, WireError):
                if fwd:  # the downstream saw half a record: it reconnects with us
                    self._drop_down("resync", "upstream lost inside a record")
                raise
            if h is not None:
                self._chunk_done(fi, ci, n, h.hexdigest())
            elif write and fi in self.fds:
                os.close(self.fds.pop(fi))
            if seq >= self.next_seq:
                self.next_seq = seq + 1

    def _write(self, fi: int, fd: int, piece: Any, off: int, h: Any) -> Any:
        """One piece to the partial file; a disk error fails this file, the chain goes on."""
        try:
            os.pwrite(fd, piece, off)
        except OSError as exc:
            self.failed[str(self.entries[fi][store.REL])] = f"cannot write: {exc}"
            return None
        h.update(piece)
        self.written += len(piece)
        return h

    def _fd(self, fi: int) -> int:
        fd = self.fds.get(fi)
        if fd is None:
            path = store.partial_path(self.dest, str(self.entries[fi][store.SHA]))
            fd = self.fds[fi] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    def _chunk_done(self, fi: int, ci: int, n: int, got: str) -> None:
        e = self.entries[fi]
        rel = str(e[store.REL])
        if got != e[store.CHUNKS][ci]:
            self.failed[rel] = (f"chunk {ci} differs from the source's sha256 (the source "
                                "file changed during the transfer, or the data was damaged)")
            return
        self.got_bytes += n
        self.need[fi].discard(ci)
        if not self.need[fi] and rel not in self.failed:
            self._place(fi, e)

    def _place(self, fi: int, e: list[Any]) -> None:
        rel, size, mtime, mode = str(e[store.REL]), int(e[store.SIZE]), int(e[store.MTIME]), \
            int(e[store.MODE])
        fd = self._fd(fi)
        try:
            os.ftruncate(fd, size)
            os.fchmod(fd, mode)
            os.utime(fd, ns=(mtime, mtime))
            if size >= store.READ:  # small files are not fsynced (like rsync): a node that
                os.fsync(fd)  # loses power may need `doctor --sync DIR` and a rerun
            final = store.inside(self.dest, rel)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            if os.path.isdir(final) and not os.path.islink(final):
                raise WireError(f"{rel} is a directory on this node")
            os.replace(store.partial_path(self.dest, str(e[store.SHA])), final)
            self.completed[rel] = [size, mtime, mode, str(e[store.SHA])]
        except (OSError, WireError) as exc:
            self.failed[rel] = str(exc)
        finally:
            os.close(self.fds.pop(fi))

    # -------------------------------------------------------------- the end
    def manifest(self) -> str:
        files = dict(self.kept)
        files.update(self.completed)
        links = None if self.links is None else {**self.links_held, **self.links_made}
        return store.write_manifest(self.dest, files, links)

    def finish(self) -> None:
        if self.down is not None:
            with contextlib.suppress(OSError):
                self.down.shutdown(socket.SHUT_WR)
                self.down.settimeout(IO_TIMEOUT_S)
                self.down.recv(1)  # the downstream closes once it is through
        deleted = []
        for rel in self.delete:
            path = store.inside(self.dest, rel)
            with contextlib.suppress(OSError):
                os.unlink(path)
                deleted.append(rel)
        self.links_made, failed = store.make_links(self.dest, self.links_todo)
        self.links_failed.update(failed)
        self.failed.update(failed)
        for fd in self.fds.values():  # files that failed a chunk: kept for the next run
            os.close(fd)
        self.fds.clear()
        digest = self.manifest()
        self._sweep()
        lacking = sorted(str(self.entries[fi][store.REL]) for fi, cs in self.need.items() if cs)
        self.emit("done", digest=digest, got=self.got_bytes, failed=self.failed,
                  lacking=lacking[:20], lacking_count=len(lacking), deleted=deleted,
                  links=len(self.links_made), links_failed=len(self.links_failed))
        self.done.set()

    def _sweep(self) -> None:
        """This host's partial files that no source file needs any more."""
        wanted = {store.partial_name(str(e[store.SHA])) for fi, e in enumerate(self.entries)
                  if self.need.get(fi)}
        part = os.path.join(self.dest, store.PARTIAL_DIR)
        for name in os.listdir(part) if os.path.isdir(part) else []:
            if name not in wanted and store.own_partial(name):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(part, name))

    def ticker(self) -> None:
        while not self.done.wait(PROGRESS_S):
            self.emit("progress", got=self.written, seq=self.next_seq)

    def control(self) -> None:
        """Control lines on stdin; EOF (the launcher went away) ends the node."""
        for raw in sys.stdin.buffer:
            op = self.op(json.loads(raw))
            if op == "stop" or (op == "feed" and not self.feed_stdin()):
                break
        if not self.done.is_set():
            with contextlib.suppress(OSError, ValueError):
                self.manifest()  # what is complete counts at the next run
            self.emit("stopped", got=self.got_bytes)
            self.done.set()

    def op(self, msg: dict[str, Any]) -> str:
        """One launcher message (a control line, or a CTRL record of a stdin feed)."""
        if msg.get("op") == "go":
            self.down_addr = msg.get("down")
            self.delete = [r for r in msg.get("delete", []) if store.safe_rel(r)]
            self.go.set()
        elif msg.get("op") == "cut":  # the downstream is lost: stop feeding it
            self._drop_down("cut", "the launcher re-formed the chain")
        return str(msg.get("op") or "")

    def feed_stdin(self) -> bool:
        """The launcher cannot reach our port: its records come on stdin (node/sync/wire.py),
        written, verified and forwarded as from a TCP upstream. False: the stream ended early."""
        up = StdinUp(sys.stdin.buffer)
        old, self.up = self.up, up
        if old is not None:  # a lost TCP upstream still connected
            with contextlib.suppress(OSError):
                old.shutdown(socket.SHUT_RDWR)
        try:
            with self.relay_lock:
                start = min(self.next_seq, self._downstream())
                self.emit("feed-from", seq=start)
                self.relay(up, start)
            return True
        except (OSError, ValueError, WireError) as exc:
            if not self.done.is_set():
                self.emit("up-lost", why=str(exc), seq=self.next_seq)
            return False


def serve() -> int:
    spec = json.loads(sys.stdin.buffer.readline())
    node = Node(spec)
    try:
        srv = node.prepare(bool(spec.get("delete")))
    except (OSError, ValueError, WireError) as exc:
        node.emit("error", why=f"{type(exc).__name__}: {exc}")
        return 1
    # Its address as the SSH client reached it: ssh_config aliases are the launcher's names.
    seen = os.environ.get("SSH_CONNECTION", "").split()
    node.emit("ready", port=srv.getsockname()[1], need_bytes=node.need_bytes(),
              need=[[fi, sorted(cs)] for fi, cs in sorted(node.need.items())],
              extra=node.extras(), managed=node.doc is not None,
              addr=seen[2] if len(seen) == 4 else "")
    for fn, args in ((node.accept_loop, (srv,)), (node.ticker, ()), (node.control, ())):
        threading.Thread(target=fn, args=args, daemon=True).start()
    node.done.wait()
    time.sleep(0.05)
    srv.close()
    return 0


def ports(first: int) -> int:
    """``sync.chain ports P``: listen as ``serve`` would (``{"ev": "listening", "port"}``), then try
    each ``{"op": "connect", "address", "port"}`` (``{"ev": "reach", "ok", "why"}``)."""
    node = Node({"dest": ".", "index": 0, "secret": "", "files": [], "port": first})
    try:
        srv = node._listen()
    except WireError as exc:
        node.emit("error", why=str(exc))
        return 1

    def drain() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=drain, daemon=True).start()
    node.emit("listening", port=srv.getsockname()[1])
    for raw in sys.stdin.buffer:
        msg = json.loads(raw)
        try:
            socket.create_connection((str(msg["address"]), int(msg["port"])),
                                     timeout=CONNECT_TIMEOUT_S).close()
            node.emit("reach", ok=True, why="")
        except OSError as exc:
            node.emit("reach", ok=False, why=str(exc))
    srv.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        return serve()
    if args[:1] == ["ports"] and len(args) == 2:
        return ports(int(args[1]))
    if args[:1] == ["check"] and len(args) >= 2:
        dest = os.path.expanduser(args[1])
        want = args[args.index("--digest") + 1] if "--digest" in args else None
        print(json.dumps(store.check(dest, want, deep="--deep" in args)))
        return 0
    print(json.dumps({"ev": "error", "why": "usage: sync.chain serve | sync.chain check DEST "
                                            "[--deep] | sync.chain ports P"}))
    return 2
