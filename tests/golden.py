"""Golden files: exact comparison, explicit regeneration, a missing golden is a failure.

Regenerate on purpose with ``CLUSTERKIT_UPDATE_GOLDEN=1 pytest tests/test_render_golden.py``
and review the diff like code.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE_ENV = "CLUSTERKIT_UPDATE_GOLDEN"


def updating() -> bool:
    return os.environ.get(UPDATE_ENV) == "1"


def assert_golden(relpath: str, actual: str) -> None:
    path = GOLDEN_DIR / relpath
    if updating():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
        return
    if not path.is_file():
        pytest.fail(f"golden file {path} is missing; create it with {UPDATE_ENV}=1 and review it")
    expected = path.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True),
                                            actual.splitlines(keepends=True),
                                            fromfile=f"golden/{relpath}", tofile="rendered", n=2))
        pytest.fail(f"{relpath} differs from its golden file ({UPDATE_ENV}=1 to accept):\n{diff}")
