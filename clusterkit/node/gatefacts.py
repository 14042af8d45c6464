"""Node program: what every node of a job must agree on (the pre-launch gate's facts).

Interpreter path, Python version and the versions of the packages every rank
imports, read from package metadata only: importing torch here would cost
seconds on every launch. The agent reports these as its ``facts`` event; run on
its own it prints them as one JSON line. ``clusterkit`` is the version installed
in this interpreter (None when absent: only the bundled workload needs it).
"""

from __future__ import annotations

import json
import sys
from typing import Any

PACKAGES = ("torch", "deepspeed", "accelerate", "clusterkit")


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except Exception:  # any broken metadata reads as "not installed"
        return None


def gate_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"python": sys.executable, "version": sys.version.split()[0]}
    facts.update({name: _version(name) for name in PACKAGES})
    return facts


def main(argv: list[str] | None = None) -> int:
    del argv  # no options
    sys.stdout.write(json.dumps(gate_facts()) + "\n")
    sys.stdout.flush()
    return 0
