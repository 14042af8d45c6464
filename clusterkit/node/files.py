"""Files written whole on a node: a reader sees the old content or the new, never a part.

A base module (docs/architecture.md, "Node modules"): every room writes such files (the
agent its job files and ``agent.json``, replicas their state, the facts their records,
``clusterkit sync`` its manifest and links, the batch script's programs their plans), so
none of them owns the rule. Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket


def write_atomic(path: str, text: str) -> None:
    """``path`` holds ``text``, written to a temp file beside it, synced, and renamed over.

    The directory may be on a shared filesystem that every node writes at once, and pids
    repeat across hosts (and PID namespaces): the temp name carries the host, the pid and
    a random token."""
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def place_link(path: str, target: str) -> None:
    """``path`` made a symbolic link to ``target`` atomically: created under a temp name
    beside it and renamed over whatever file or link is there (a reader sees the old
    one or the new one, never none)."""
    name = hashlib.sha256(os.path.basename(path).encode("utf-8", "surrogateescape"))
    tmp = os.path.join(os.path.dirname(path), f".ck-link-tmp.{os.getpid()}.{name.hexdigest()[:16]}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
