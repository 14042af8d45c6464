"""Node program: one collect-ckpt session per node — list, hash and send on one connection.

``ckpt.stream ROOT`` reads requests, one JSON line each, on stdin (after the sources)
and answers on stdout with frames: a JSON header line, for a file frame followed by
exactly ``size`` raw bytes. Requests (``id`` is echoed in the answer):

* ``{"op": "list", "id": k, "tag": T|null}`` -> ``{"t": "listing", "id": k, "listing": {...}}``
  (:func:`clusterkit.node.ckpt.listing.listing`);
* ``{"op": "hash", "id": k, "files": [...]}`` -> ``{"t": "hashes", "id": k, ...}``
  (:func:`clusterkit.node.hashing.hash_files`), computed in a thread so that it
  overlaps a ``send`` that follows;
* ``{"op": "send", "id": k, "files": [...]}`` -> per file ``{"t": "file", "rel", "size"}``
  + bytes + ``{"t": "end", "rel", "sha256", "mtime", "changed"}`` (or ``{"t": "err"}``),
  then ``{"t": "sent", "id": k}``. Each file is read once: hashed as it is sent.
* ``{"op": "socket", "port": P, "secret": S}`` (Slurm: the first request; issue 31):
  connect back to the collecting host (``$SLURM_SRUN_COMM_HOST``, the address srun set
  for its own I/O, so reachable wherever srun is) on port P, prove the per-run secret
  S and check the collector's proof (:func:`socket_proof`), and from then on send every
  answer there instead of on stdout, so the bytes skip srun's I/O forwarding. The answer
  on stdout: ``{"t": "socket", "ok": true}``, or ``{"t": "socket", "ok": false, "why"}``
  and the answers stay on stdout (the slower path, still verified the same way). The
  secret comes on stdin only, never on argv or in the environment.
* ``{"op": "bye"}`` or end of stdin: exit.

Parsed by :mod:`clusterkit.checkpoints.sources.session`. Standard library only (Python >= 3.8).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import sys
import threading
from typing import IO, Any, cast

from clusterkit.node import hashing
from clusterkit.node.ckpt import listing

CHUNK = 1 << 20
ZEROS = bytes(CHUNK)
SOCKET_GREETING = b"CKSTREAM1"
SOCKET_TIMEOUT_S = 10.0  # connect and proofs; then the collector's stall watchdog rules


def socket_proof(secret: str, who: bytes, port: int) -> bytes:
    """What each end of the data socket sends to show it holds the per-run secret:
    ``who`` is b"node" or b"collector" (so neither proof can be echoed back)."""
    return hashing.mac(secret.encode(), who, b"%d" % port).encode()


def connect_back(req: dict[str, Any]) -> socket.socket:
    """The collector's socket, both proofs checked; OSError or ValueError otherwise."""
    host = os.environ.get("SLURM_SRUN_COMM_HOST", "")
    if not host:
        raise ValueError("SLURM_SRUN_COMM_HOST is not set (not started by srun)")
    port, secret = int(req["port"]), str(req["secret"])
    sock = socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_S)
    try:
        sock.sendall(SOCKET_GREETING + b" " + socket_proof(secret, b"node", port) + b"\n")
        got = b""
        while not got.endswith(b"\n") and len(got) < 200:
            piece = sock.recv(200)
            if not piece:
                break
            got += piece
        if not hmac.compare_digest(got.strip(), socket_proof(secret, b"collector", port)):
            raise ValueError("%s:%d did not prove the run's secret" % (host, port))  # noqa: UP031
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


class Out:
    """stdout shared by the sender and the hashing thread: whole frames under a lock."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def msg(self, obj: dict[str, Any], flush: bool = True) -> None:
        with self.lock:
            self.line(obj, flush)

    def line(self, obj: dict[str, Any], flush: bool = False) -> None:
        """Caller holds the lock."""
        self.stream.write(json.dumps(obj).encode() + b"\n")
        if flush:
            self.stream.flush()


def send_file(out: Out, root: str, rel: str, buf: bytearray) -> None:
    """One file frame. The size is fixed at open: a file that shrinks is padded with
    zeros (and flagged), one that grows is cut — the receiver refuses both."""
    try:
        fh = open(os.path.join(root, rel), "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        out.msg({"t": "err", "rel": rel, "why": "%s: %s" % (type(e).__name__, e.strerror or e)})  # noqa: UP031
        return
    with fh, out.lock:
        st = os.fstat(fh.fileno())
        out.line({"t": "file", "rel": rel, "size": st.st_size})
        h = hashlib.sha256()
        left = st.st_size
        view = memoryview(buf)
        while left:
            n = fh.readinto(view[:min(CHUNK, left)])
            if not n:
                break
            h.update(view[:n])
            out.stream.write(view[:n])
            left -= n
        short = left
        while left:  # keep the frame's length: the stream stays parseable
            n = min(CHUNK, left)
            out.stream.write(ZEROS[:n])
            left -= n
        now = os.fstat(fh.fileno())
        changed = bool(short) or now.st_size != st.st_size or now.st_mtime != st.st_mtime
        out.line({"t": "end", "rel": rel, "sha256": h.hexdigest(), "size": st.st_size,
                  "mtime": st.st_mtime, "changed": changed}, flush=True)


def _hash_async(out: Out, root: str, req: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        res = hashing.hash_files(root, list(req["files"]), int(req.get("threads", 2)))
        out.msg({"t": "hashes", "id": req["id"], **res})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def serve(root: str, inp: IO[bytes], stream: IO[bytes]) -> int:
    out = Out(stream)
    buf = bytearray(CHUNK)
    hashers: list[threading.Thread] = []
    sock: socket.socket | None = None
    while True:
        line = inp.readline()
        if not line.strip():
            break
        req = json.loads(line)
        op = req.get("op")
        if op == "list":
            out.msg({"t": "listing", "id": req["id"],
                     "listing": listing.listing(root, req.get("tag"))})
        elif op == "hash":
            hashers.append(_hash_async(out, root, req))
        elif op == "send":
            for rel in req["files"]:
                send_file(out, root, rel, buf)
            out.msg({"t": "sent", "id": req["id"]})
        elif op == "socket" and sock is None:
            try:
                sock = connect_back(req)
            except (OSError, ValueError, KeyError) as e:
                out.msg({"t": "socket", "ok": False, "why": "%s: %s" % (type(e).__name__, e)})  # noqa: UP031
                continue
            out.msg({"t": "socket", "ok": True})
            with out.lock:
                out.stream = cast(IO[bytes], sock.makefile("wb", buffering=CHUNK))
        elif op == "bye":
            break
        else:
            out.msg({"t": "bad", "id": req.get("id"), "why": "unknown op %r" % (op,)})  # noqa: UP031
    for t in hashers:  # answer every request before leaving
        t.join()
    out.stream.flush()
    if sock is not None:  # the collector reads to the end of the stream
        out.stream.close()
        sock.shutdown(socket.SHUT_WR)
        sock.close()
    return 0


def _widen_stdout() -> None:
    """A 1 MiB stdout pipe (sshd reads it): fewer wake-ups per MB. Linux only, best effort."""
    try:
        import fcntl

        fcntl.fcntl(1, getattr(fcntl, "F_SETPIPE_SZ", 1031), CHUNK)
    except (ImportError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    _widen_stdout()
    return serve(args[0], sys.stdin.buffer, sys.stdout.buffer)
