"""What every doctor check produces: per-host :class:`Finding`s, grouped into host ranges.

Checks return one finding per host (and per subject) so nothing is lost; the
report folds identical ``(check, status, detail, fix)`` results into one line
with a host range, like ClusterShell's ``clubak -b``:
``FAIL python-version  node7: torch 2.3.1 ≠ 2.4.0 on node[1-6]``.
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
class Finding:
    check: str  # stable id, e.g. "version-parity.torch", "names.loopback"
    status: Status
    host: str  # inventory name; "" for cluster-wide findings
    detail: str  # what was found, one line
    fix: str | None = None  # what to do, one line; None for PASS


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


def group_findings(findings: Iterable[Finding],
                   host_order: Sequence[str] | None = None) -> list[FindingGroup]:
    """Fold findings with identical (check, status, detail, fix) into one group.

    Groups keep first-seen order; hosts inside a group follow ``host_order``
    (inventory = rank order) when given, else first-seen order.
    """
    order = {h: i for i, h in enumerate(host_order or ())}
    buckets: dict[tuple[str, Status, str, str | None], list[str]] = {}
    for f in findings:
        hosts = buckets.setdefault((f.check, f.status, f.detail, f.fix), [])
        if f.host not in hosts:
            hosts.append(f.host)
    groups = []
    for (check, status, detail, fix), hosts in buckets.items():
        hosts.sort(key=lambda h: order.get(h, len(order)))
        groups.append(FindingGroup(check, status, tuple(hosts), detail, fix))
    return groups


def worst(findings: Iterable[Finding]) -> Status:
    return max((f.status for f in findings), default=Status.PASS)


def hosts_text(hosts: Iterable[str]) -> str:
    """``node[1-6]`` for use inside a detail line."""
    return fold(hosts)
