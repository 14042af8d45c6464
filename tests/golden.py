"""Golden files: exact comparison, explicit regeneration, a missing golden is a failure.

Regenerate on purpose with ``CLUSTERKIT_UPDATE_GOLDEN=1 pytest tests/unit/test_render_golden.py``
and review the diff like code.

Each distinct content is stored once (issue 36: 139 golden files held 61 contents): a
golden equal to one already written in the same regeneration is a relative symlink to
it, so a change that reaches many renders shows in one file's diff, and a render that
stops being equal to its twin becomes a file of its own when regenerated. Comparison
reads through the link; a dangling link is a missing golden.
"""

from __future__ import annotations

import difflib
import hashlib
import os
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE_ENV = "CLUSTERKIT_UPDATE_GOLDEN"


def updating() -> bool:
    return os.environ.get(UPDATE_ENV) == "1"


# This regeneration's files by content digest: the first path written with each content.
_written: dict[str, Path] = {}


def _write_golden(path: Path, actual: str) -> None:
    """Write a golden, or link it to the file already written with the same content."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()  # never write through an old link into its target
    digest = hashlib.sha256(actual.encode("utf-8")).hexdigest()
    first = _written.setdefault(digest, path)
    if first == path:
        path.write_text(actual, encoding="utf-8")
    else:
        path.symlink_to(os.path.relpath(first, path.parent))


def assert_golden(relpath: str, actual: str) -> None:
    path = GOLDEN_DIR / relpath
    if updating():
        _write_golden(path, actual)
        return
    if not path.is_file():
        pytest.fail(f"golden file {path} is missing; create it with {UPDATE_ENV}=1 and review it")
    expected = path.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True),
                                            actual.splitlines(keepends=True),
                                            fromfile=f"golden/{relpath}", tofile="rendered", n=2))
        pytest.fail(f"{relpath} differs from its golden file ({UPDATE_ENV}=1 to accept):\n{diff}")
