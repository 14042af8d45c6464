"""Node program: sha256 of files under a root, several at once (hashlib releases the GIL).

Also the one sha256-of-a-file helper (:func:`sha256_file`) and the one HMAC helper
(:func:`mac`) of clusterkit: the node modules (the replica wire, the sync chain, the
environment records, the Slurm restore) and the launcher (collect's receiver, the local
transport, the reshard) call these, never a copy (issue 36).

``hashing ROOT JSON_LIST [THREADS]`` prints one JSON line
``{"v": 1, "files": {rel: [size, mtime, sha256]}, "errors": {rel: why}}``, with
size and mtime taken on the open file. Parsed by
:func:`clusterkit.checkpoints.sources.transfer.parse_hashes`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
import threading
from typing import Any

HASH_VERSION = 1
CHUNK = 1 << 20


def sha256_file(path: str) -> str:
    """The sha256 of a file's content, read in CHUNK pieces (OSError when unreadable)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def mac(secret: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 of ``parts`` joined by NUL bytes (hex): what both ends of an
    authenticated node-to-node exchange compute (the replica wire, the sync chain)."""
    return hmac.new(secret, b"\0".join(parts), hashlib.sha256).hexdigest()


def hash_files(root: str, rels: list[str], threads: int = 4) -> dict[str, Any]:
    out: dict[str, list[Any]] = {}
    errs: dict[str, str] = {}
    lock = threading.Lock()
    todo = list(rels)

    def one(rel: str) -> None:
        try:
            h = hashlib.sha256()
            with open(os.path.join(root, rel), "rb") as fh:
                s = os.fstat(fh.fileno())
                for block in iter(lambda: fh.read(CHUNK), b""):
                    h.update(block)
            with lock:
                out[rel] = [s.st_size, s.st_mtime, h.hexdigest()]
        except OSError as e:
            with lock:
                errs[rel] = "%s: %s" % (type(e).__name__, e.strerror or e)  # noqa: UP031

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                rel = todo.pop(0)
            one(rel)

    pool = [threading.Thread(target=worker) for _ in range(max(1, min(threads, len(todo))))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"v": HASH_VERSION, "files": out, "errors": errs}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    threads = int(args[2]) if len(args) > 2 else 4
    sys.stdout.write(json.dumps(hash_files(args[0], json.loads(args[1]), threads)) + "\n")
    sys.stdout.flush()
    return 0
