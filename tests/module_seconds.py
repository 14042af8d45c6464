"""The measured cost of each test module, for the order the xdist workers take them in.

``tests/module_seconds.json`` maps a module's path to the seconds its tests took (setup,
call and teardown summed) in one whole-suite run; tests/conftest.py hands modules out
longest first from it, so the run ends on short modules that fill both workers instead
of one worker alone with a long one. Refresh it after a change that moves a module's
cost a lot (a new training test, a test made cheap)::

    python -m pytest --durations=0 | tee durations.log
    python -m tests.module_seconds durations.log   # rewrites tests/module_seconds.json

A module not in the file (new since) is placed by its markers (``estimate``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

TABLE = Path(__file__).with_name("module_seconds.json")
# `--durations=0` lines: "12.34s call     tests/test_x.py::test_y[param]"
DURATION = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+(\S+?)::")
# Seconds for a module the table does not know yet, by its costliest marker.
MARKER_SECONDS = (("slow", 60.0), ("slurm", 30.0), ("testbed", 10.0))


def from_durations(lines: Iterable[str]) -> dict[str, float]:
    """Per-module seconds from pytest's ``--durations=0`` report."""
    total: dict[str, float] = {}
    for line in lines:
        m = DURATION.match(line)
        if m:
            total[m.group(2)] = total.get(m.group(2), 0.0) + float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(total.items())}


def load() -> dict[str, float]:
    try:
        data = json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()}


def estimate(markers: Iterable[str]) -> float:
    names = set(markers)
    return next((s for m, s in MARKER_SECONDS if m in names), 0.0)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.module_seconds DURATIONS_LOG", file=sys.stderr)
        return 2
    table = from_durations(Path(argv[0]).read_text(errors="replace").splitlines())
    if not table:
        print(f"{argv[0]}: no --durations=0 lines found", file=sys.stderr)
        return 1
    tmp = TABLE.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tmp.replace(TABLE)
    print(f"{TABLE}: {len(table)} modules, {sum(table.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
