"""Every case of the bad-input corpus (tests/badinputs.py, ~420 command lines across every
verb and flag family) gets one clear line and exit 2, and the good ones still run (issue 25:
"one refusal, one line, exit 2", "nothing silently accepted"). In-process and fast: the
launch-like verbs only plan (--dry-run) on the embedded default's local nodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.badinputs import GOOD, Case, bad_cases, grade, make_scratch, run_in_process


@pytest.fixture(scope="module")
def badinputs_scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("badinputs")
    make_scratch(root)
    return root


@pytest.fixture
def in_scratch(badinputs_scratch: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(badinputs_scratch)
    monkeypatch.setenv("CLUSTERKIT_HOME", str(badinputs_scratch / "home"))
    monkeypatch.delenv("CLUSTERKIT_DEBUG", raising=False)
    yield badinputs_scratch


@pytest.mark.parametrize("case", [*bad_cases(), *GOOD], ids=lambda c: c.name or "(no words)")
def test_corpus_case(case: Case, in_scratch: Path) -> None:
    code, stderr = run_in_process(case)
    verdict = grade(case, code, stderr)
    assert verdict.ok, f"{verdict.why}: {stderr.strip()[-400:]}"
