"""What every doctor check produces: per-host :class:`Finding`s, grouped into host ranges.

Checks return one finding per host (and per subject) so nothing is lost; the
report folds identical ``(check, status, detail, fix)`` results into one line
with a host range, like ClusterShell's ``clubak -b``:
``FAIL python-version  node7: torch 2.3.1 ≠ 2.4.0 on node[1-6]``.

A finding that carries a measured number (a :class:`Measure`: seconds of start-up,
clock skew) folds with the findings that differ from it only in that number; the
row shows the range of values: ``WARN ssh.startup  node[1-40,52]: 5.2–8.7 s ...``.
Other numbers in a detail (versions, counts) never fold: only a Measure does.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from clusterkit.hostrange import fold


class Status(enum.IntEnum):
    """Ordered by severity so ``max()`` gives the worst status."""

    PASS = 0
    WARN = 1
    FAIL = 2

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Measure:
    """The measured number inside a detail: ``template`` holds ``{}`` where it goes."""

    template: str  # e.g. "{} s passed on the node before the probe ran"
    value: float
    fmt: str = ".1f"  # format spec of one value ("+.1f" for signed offsets)

    def text(self, values: Iterable[float] | None = None) -> str:
        """The detail with this value, or with the range of ``values`` (``5.2–8.7``)."""
        shown = sorted({format(v, self.fmt) for v in (values or [self.value])},
                       key=float)
        span = shown[0] if len(shown) == 1 else f"{shown[0]}–{shown[-1]}"
        return self.template.format(span)


@dataclass(frozen=True)
class Finding:
    check: str  # stable id, e.g. "version-parity.torch", "names.loopback"
    status: Status
    host: str  # inventory name; "" for cluster-wide findings
    detail: str  # what was found, one line
    fix: str | None = None  # what to do, one line; None for PASS
    measure: Measure | None = None  # set by measured(): folds across values

    @classmethod
    def measured(cls, check: str, status: Status, host: str, measure: Measure,
                 fix: str | None = None) -> Finding:
        """A finding whose detail is ``measure`` rendered with its own value."""
        return cls(check, status, host, measure.text(), fix, measure)


@dataclass(frozen=True)
class FindingGroup:
    check: str
    status: Status
    hosts: tuple[str, ...]
    detail: str
    fix: str | None

    @property
    def host_range(self) -> str:
        return fold(h for h in self.hosts if h) if any(self.hosts) else ""

    def one_line(self) -> str:
        where = f"{self.host_range}: " if self.host_range else ""
        text = f"{self.status!s:<4} {self.check}  {where}{self.detail}"
        return f"{text} — fix: {self.fix}" if self.fix else text


# What folds: (check, status, detail, fix), a Measure's template standing for its detail.
_Key = tuple[str, Status, str, str | None, bool]


def _fold_key(f: Finding) -> _Key:
    if f.measure is not None:
        return (f.check, f.status, f.measure.template, f.fix, True)
    return (f.check, f.status, f.detail, f.fix, False)


def group_findings(findings: Iterable[Finding],
                   host_order: Sequence[str] | None = None) -> list[FindingGroup]:
    """Fold findings with identical (check, status, detail, fix) into one group; findings
    with a :class:`Measure` fold when only the value differs (the detail shows the range).

    Groups keep first-seen order; hosts inside a group follow ``host_order``
    (inventory = rank order) when given, else first-seen order.
    """
    order = {h: i for i, h in enumerate(host_order or ())}
    buckets: dict[_Key, list[Finding]] = {}
    for f in findings:
        buckets.setdefault(_fold_key(f), []).append(f)
    groups = []
    for (check, status, detail, fix, _), members in buckets.items():
        hosts = list(dict.fromkeys(f.host for f in members))
        hosts.sort(key=lambda h: order.get(h, len(order)))
        first = members[0].measure
        if first is not None:
            detail = first.text(f.measure.value for f in members if f.measure is not None)
        groups.append(FindingGroup(check, status, tuple(hosts), detail, fix))
    return groups


def worst(findings: Iterable[Finding]) -> Status:
    return max((f.status for f in findings), default=Status.PASS)


def hosts_text(hosts: Iterable[str]) -> str:
    """``node[1-6]`` for use inside a detail line."""
    return fold(hosts)
