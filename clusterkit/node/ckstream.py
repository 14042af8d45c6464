"""Node program: one collect-ckpt session per node — list, hash and send on one connection.

``ckstream ROOT`` reads requests, one JSON line each, on stdin (after the sources)
and answers on stdout with frames: a JSON header line, for a file frame followed by
exactly ``size`` raw bytes. Requests (``id`` is echoed in the answer):

* ``{"op": "list", "id": k, "tag": T|null}`` -> ``{"t": "listing", "id": k, "listing": {...}}``
  (:func:`clusterkit.node.listing.listing`);
* ``{"op": "hash", "id": k, "files": [...]}`` -> ``{"t": "hashes", "id": k, ...}``
  (:func:`clusterkit.node.hashing.hash_files`), computed in a thread so that it
  overlaps a ``send`` that follows;
* ``{"op": "send", "id": k, "files": [...]}`` -> per file ``{"t": "file", "rel", "size"}``
  + bytes + ``{"t": "end", "rel", "sha256", "mtime", "changed"}`` (or ``{"t": "err"}``),
  then ``{"t": "sent", "id": k}``. Each file is read once: hashed as it is sent.
* ``{"op": "bye"}`` or end of stdin: exit.

Parsed by :mod:`clusterkit.checkpoints.session`. Standard library only (Python >= 3.8).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from typing import IO, Any

from clusterkit.node import hashing, listing

CHUNK = 1 << 20
ZEROS = bytes(CHUNK)


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
        elif op == "bye":
            break
        else:
            out.msg({"t": "bad", "id": req.get("id"), "why": "unknown op %r" % (op,)})  # noqa: UP031
    for t in hashers:  # answer every request before leaving
        t.join()
    stream.flush()
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
