"""Node program: one node's checkpoint root as one JSON line (``collect-ckpt``'s listing).

``listing ROOT [TAG]``: the top-level files (``latest``, ``zero_to_fp32.py``),
every tag dir's files with size and mtime (only TAG's when given), and the text
of the completion markers. A ``.pt`` file also says whether it is a whole zip archive
(``torch.save``'s format ends with the zip end record, so a save cut short lacks it).
Parsed by :func:`clusterkit.checkpoints.listing.parse_listing`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from clusterkit.node.contract import looks_like_marker

LISTING_VERSION = 2
MAX_MARKER_BYTES = 1 << 20


ZIP_HEAD = b"PK\x03\x04"
ZIP_END = b"PK\x05\x06"  # end of central directory; torch.save writes no zip comment
ZIP_END_SIZE = 22


def _stat(path: str) -> list[Any]:
    s = os.stat(path)
    entry: list[Any] = [s.st_size, s.st_mtime]
    if path.endswith(".pt"):
        entry.append(_whole_zip(path, s.st_size))
    return entry


def _whole_zip(path: str, size: int) -> bool | None:
    """True/False for a zip archive that does/does not end with its end record; None when
    the file is not a zip (torch's legacy format) or unreadable: nothing to say then."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != ZIP_HEAD:
                return None
            if size < ZIP_END_SIZE:
                return False
            fh.seek(size - ZIP_END_SIZE)
            return fh.read(4) == ZIP_END
    except OSError:
        return None


def _tag(path: str) -> tuple[dict[str, list[float]], dict[str, str]]:
    """(files, markers) of one tag dir, walked in a stable order."""
    files: dict[str, list[Any]] = {}
    marks: dict[str, str] = {}
    for d, dirs, names in os.walk(path):
        dirs.sort()
        for n in sorted(names):
            f = os.path.join(d, n)
            if not os.path.isfile(f):
                continue
            rel = os.path.relpath(f, path)
            files[rel] = _stat(f)
            if d == path and looks_like_marker(n) and files[rel][0] < MAX_MARKER_BYTES:
                with open(f) as fh:
                    marks[rel] = fh.read()
    return files, marks


def listing(root: str, only: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"v": LISTING_VERSION, "root": root, "exists": os.path.isdir(root),
                           "top": {}, "latest": None, "tags": {}, "markers": {}}
    if not out["exists"]:
        return out
    for name in sorted(os.listdir(root)):
        p = os.path.join(root, name)
        if os.path.isfile(p):
            out["top"][name] = _stat(p)
            if name == "latest" and out["top"][name][0] < 4096:
                with open(p) as fh:
                    out["latest"] = fh.read().strip()
        elif os.path.isdir(p) and (only is None or name == only):
            out["tags"][name], out["markers"][name] = _tag(p)
        elif os.path.isdir(p):
            out["tags"][name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    root, only = args[0], (args[1] if len(args) > 1 and args[1] else None)
    sys.stdout.write(json.dumps(listing(root, only)) + "\n")
    sys.stdout.flush()
    return 0
