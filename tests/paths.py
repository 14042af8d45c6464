"""Where the suite's files are, for test modules at any depth (tests/unit, tests/process,
tests/bed, tests/bed/slurm: docs/testbed.md, "The suite's tiers"): a module's own
``__file__`` says nothing once modules live one or two directories down."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
