"""Atomic file writes: nothing a user owns is ever half-written or appended to (a file:
:func:`atomic_write_text`; a directory built beside its place: :func:`replace_dir`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from clusterkit.errors import ClusterkitError


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> Path:
    """Write ``text`` to ``path`` via a temp file in the same directory and ``os.replace``.

    A crash leaves either the old file or the new one, never a mix; the temp file
    carries a name no reader would mistake for the final one.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with _suppress_oserror():
            os.unlink(tmp)
        raise
    return target


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)


def replace_dir(tmp: str, final: str) -> None:
    """Swap the finished directory ``tmp`` in as ``final`` (the previous ``final``, if
    any, is moved aside first and removed after): readers see the old or the new one."""
    old = f"{final}.old-{os.getpid()}"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    with contextlib.suppress(OSError):
        shutil.rmtree(old)


def check_writable(path: str, key: str, *, directory: bool = False) -> None:
    """A path the user asked clusterkit to write (``-o FILE``, ``--fix-env FILE``, ``--out
    DIR``, ``--to DEST``), checked before any work, as ``cp`` would: its parent directory
    must exist already (clusterkit never creates parents a typo named), a file must not
    be a directory and a directory not a file, and the place must take a new entry
    (probed with a temporary directory, removed again: permissions, read-only mounts and
    /proc all answer the same way). One :class:`ClusterkitError` naming ``key``.
    """
    if not path:
        raise ClusterkitError("is empty", key=key, hint="give a path")
    target = Path(path)
    if directory and target.exists() and not target.is_dir():
        raise ClusterkitError("is a file, not a directory", path=path, key=key,
                              hint="give a directory (it is created if missing)")
    if not directory and target.is_dir():
        raise ClusterkitError("is a directory, not a file", path=path, key=key,
                              hint=f"name the file to write, e.g. {path.rstrip('/')}/NAME")
    where = target if directory and target.is_dir() else target.parent
    if not where.is_dir():
        raise ClusterkitError(f"directory {where} does not exist", path=path, key=key,
                              hint=f"create it first (mkdir -p {where}); clusterkit does not "
                                   "create parent directories")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".clusterkit-probe-", dir=where))
    except OSError as exc:
        raise ClusterkitError(f"cannot write there: {exc.strerror or exc}", path=path, key=key,
                              hint="choose a place you can write to") from None


def read_json_object(path: str, what: str, error: type[ClusterkitError]) -> dict[str, Any]:
    """Read a JSON file that must hold an object; failures become one-line ``error``s."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise error(f"cannot read {what} ({exc})", path=path) from None
    if not isinstance(data, dict):
        raise error(f"{what} is not a JSON object", path=path)
    return data
