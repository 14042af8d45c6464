"""Host ranges: ``node[01-07]`` ⇄ ``[node01, ..., node07]``.

Pure functions, no I/O. The syntax follows ClusterShell/Slurm nodesets, which is
what our users already type: a bracket group holds comma-separated numbers or
``a-b`` ranges; a bound written with leading zeros pads every number in that
range to the bound's width; several groups expand as a product, left to right.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# A guard against `node[1-100000000]` eating the machine through a typo.
MAX_EXPANSION = 100_000

_GROUP = re.compile(r"\[([^\[\]]*)\]")
_TAIL_NUMBER = re.compile(r"^(.*?)(\d+)(\D*)$")


class HostRangeError(ValueError):
    """The pattern is not a valid host range; the message says why."""


def _expand_group(body: str, pattern: str) -> list[str]:
    if not body.strip():
        raise HostRangeError(f"empty brackets in {pattern!r}")
    out: list[str] = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise HostRangeError(
                f"bad range {part!r} in {pattern!r} (use numbers like [1-7] or [01-07,09])"
            )
        lo_s, hi_s = m.group(1), m.group(2)
        if hi_s is None:
            out.append(lo_s)
            continue
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise HostRangeError(f"range {part!r} in {pattern!r} goes backwards")
        if hi - lo + 1 > MAX_EXPANSION:
            raise HostRangeError(f"range {part!r} in {pattern!r} is too large")
        padded = (lo_s.startswith("0") and len(lo_s) > 1) or len(lo_s) == len(hi_s) > 1
        width = len(lo_s) if padded else 0
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def expand(pattern: str) -> list[str]:
    """Expand one host pattern into names, in order. No brackets → ``[pattern]``."""
    if not pattern or pattern != pattern.strip():
        raise HostRangeError(f"host pattern {pattern!r} is empty or has surrounding spaces")
    pieces: list[list[str]] = []
    pos = 0
    for m in _GROUP.finditer(pattern):
        pieces.append([pattern[pos : m.start()]])
        pieces.append(_expand_group(m.group(1), pattern))
        pos = m.end()
    pieces.append([pattern[pos:]])
    literal = "".join(p[0] for p in pieces if len(p) == 1)
    if "[" in literal or "]" in literal:
        raise HostRangeError(f"unbalanced or nested brackets in {pattern!r}")
    names = [""]
    for choices in pieces:
        names = [n + c for n in names for c in choices]
        if len(names) > MAX_EXPANSION:
            raise HostRangeError(f"{pattern!r} expands to more than {MAX_EXPANSION} names")
    return names


def expand_list(patterns: str) -> list[str]:
    """Expand a comma-separated list of patterns (commas inside brackets belong to the range)."""
    out: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(patterns):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.extend(expand(patterns[start:i].strip()))
            start = i + 1
    out.extend(expand(patterns[start:].strip()))
    return out


def _ranges(numbers: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    return runs


def fold_numbers(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2,5``: rank lists in folded console lines."""
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _ranges(list(numbers)))


def fold(names: Iterable[str]) -> str:
    """Fold names into the shortest readable range list: ``node[1-6,9],gpu7``.

    Only the last number in a name varies. Names are grouped by (prefix, width of
    a zero-padded number, suffix); groups keep the order of first appearance.
    """
    names = list(names)
    parsed = [_TAIL_NUMBER.match(n) for n in names]
    # Widths used with leading zeros, so node10 joins node[01-09] as node[01-10].
    padded_widths = {
        (m.group(1), len(m.group(2)), m.group(3))
        for m in parsed
        if m and m.group(2).startswith("0") and len(m.group(2)) > 1
    }
    groups: dict[tuple[str, int, str], list[int]] = {}
    plain: list[str] = []
    order: list[tuple[str, int, str] | str] = []
    for name, m in zip(names, parsed, strict=False):
        if not m:
            if name not in plain:
                plain.append(name)
                order.append(name)
            continue
        prefix, digits, suffix = m.groups()
        candidate = (prefix, len(digits), suffix)
        key = candidate if candidate in padded_widths else (prefix, 0, suffix)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
    parts: list[str] = []
    for item in order:
        if isinstance(item, str):
            parts.append(item)
            continue
        prefix, width, suffix = item
        runs = _ranges(groups[item])
        if len(runs) == 1 and runs[0][0] == runs[0][1]:
            parts.append(f"{prefix}{str(runs[0][0]).zfill(width)}{suffix}")
            continue
        body = ",".join(
            str(a).zfill(width) if a == b else f"{str(a).zfill(width)}-{str(b).zfill(width)}"
            for a, b in runs
        )
        parts.append(f"{prefix}[{body}]{suffix}")
    return ",".join(parts)


def fold_by_text(pairs: Iterable[tuple[str, str]],
                 order: Iterable[str] | None = None) -> list[tuple[str, str]]:
    """``(host, text)`` pairs → ``(host range, text)``, one per distinct text (``clubak -b``).

    Texts keep first-seen order; hosts inside a row follow ``order`` when given
    (inventory = rank order). Texts must not embed their host's name, or nothing folds.
    """
    rank = {h: i for i, h in enumerate(order or ())}
    rows: dict[str, list[str]] = {}
    for host, text in pairs:
        hosts = rows.setdefault(text, [])
        if host not in hosts:
            hosts.append(host)
    return [(fold(sorted(hosts, key=lambda h: rank.get(h, len(rank)))), text)
            for text, hosts in rows.items()]


def folded_lines(pairs: Iterable[tuple[str, str]], order: Iterable[str] | None = None) -> list[str]:
    """``node[1-7]: text`` lines for a per-host report."""
    return [f"{hosts}: {text}" for hosts, text in fold_by_text(pairs, order)]
