"""An unknown flag's hint: the verb's own close flag first (a near spelling, else the flag
of the same meaning), then the other verbs that have the flag typed; one line, exit 2."""

from __future__ import annotations

import pytest

from clusterkit.cli.argparser import SAME_MEANING, same_meaning
from clusterkit.cli.main import main


def _hint_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_collect_dest_offers_its_own_to_before_sync(capsys: pytest.CaptureFixture[str]) -> None:
    err = _hint_error(["collect-ckpt", "myjob", "--dest", "/tmp/x"], capsys)
    assert "unknown flag --dest" in err
    mine, theirs = err.index("did you mean --to?"), err.index("--dest is a flag of `clusterkit sync`")
    assert mine < theirs, err


def test_a_near_spelling_still_comes_first_and_no_verb_owns_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    err = _hint_error(["collect-ckpt", "myjob", "--tagg", "x"], capsys)
    assert "did you mean --tag?" in err and "is a flag of" not in err


def test_same_meaning_is_a_rule_over_groups_not_one_flag() -> None:
    assert same_meaning("--dest", ["--to", "--tag"]) == "--to"
    assert same_meaning("--output", ["--out", "--json"]) == "--out"
    assert same_meaning("--dest", ["--tag"]) is None  # nothing of that meaning: no guess
    assert same_meaning("--dest", ["--to", "--out"]) is None  # two: no guess either
    assert same_meaning("--tag", ["--to"]) is None
    assert all(all(f.startswith("--") for f in g) for g in SAME_MEANING)
