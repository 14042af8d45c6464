"""The suite's tiers are directories (docs/testbed.md, "The suite's tiers"): a test module
lives in the tier of the most it needs, and the unit tier's conftest holds its tests to
this process."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from tests.paths import TESTS

TIERS = ("unit", "process", "bed", "bed/slurm")


def test_every_test_module_is_in_a_tier() -> None:
    homes = {TESTS / tier for tier in TIERS}
    strays = [str(p.relative_to(TESTS)) for p in sorted(TESTS.rglob("test_*.py"))
              if p.parent not in homes and "fixtures" not in p.parts]
    assert strays == [], f"test modules outside the tiers {TIERS}: {strays}"


def test_each_tier_has_its_conftest() -> None:
    assert all((TESTS / tier / "conftest.py").is_file() for tier in TIERS)


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"], check=False),
    lambda: os.system("true"),
    lambda: socket.create_connection(("127.0.0.1", 9), timeout=1),
], ids=["subprocess", "system", "socket"])
def test_a_unit_test_cannot_start_a_process_or_reach_the_network(start: object) -> None:
    with pytest.raises(AssertionError, match="belongs in tests/process"):
        start()  # type: ignore[operator]
