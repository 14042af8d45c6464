"""What every node of a job must agree on, and the one rule that judges agreement.

The package table is read by the node programs (``facts.gatefacts``: the launch gate's
facts; ``probe``: doctor's) and by the launcher's judges (``launch/gate.py``,
``checks/rules_parity.py``), so the gate and doctor compare the same packages with
the same rule. Standard library only: it ships to the nodes (ship.py).

The rule: the majority value is the reference, a tie goes to the earliest node in
rank order. With two nodes that is the first node; with more, one odd node is named
as the odd one (comparing against the first node blamed every other node when the
first one was the odd one). docs/doctor.md and docs/launch.md say the same.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

# What a version mismatch across nodes means, per package (name as on PyPI).
MUST = "must"  # the ranks break on it: the launch gate refuses, doctor FAILs
SHOULD = "should"  # doctor WARNs; the gate says nothing
READ = "read"  # read for another check only (ninja: doctor's toolchain check)

PACKAGES: dict[str, str] = {
    "torch": MUST,
    "deepspeed": MUST,
    "accelerate": MUST,
    "transformers": SHOULD,
    "numpy": SHOULD,
    "ninja": READ,
}

T = TypeVar("T", bound=Hashable)


def packages(*kinds: str) -> tuple[str, ...]:
    """The table's names of these kinds (all of them without ``kinds``), in table order."""
    return tuple(name for name, kind in PACKAGES.items() if not kinds or kind in kinds)


def majority(values: Mapping[str, T], order: Sequence[str]) -> T:
    """Most common value; a tie goes to the value of the earliest node in ``order``."""
    counts = Counter(values.values())
    best = max(counts.values())
    rank = {h: i for i, h in enumerate(order)}
    for host in sorted(values, key=lambda h: rank.get(h, len(rank))):
        if counts[values[host]] == best:
            return values[host]
    raise ValueError("majority of no values")


def holders(values: Mapping[str, T], value: T, order: Sequence[str]) -> list[str]:
    """The nodes holding ``value``, in ``order`` (the report names them)."""
    return [h for h in order if h in values and values[h] == value]
