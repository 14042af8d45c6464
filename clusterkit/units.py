"""Sizes and durations as users type them: one rule each, for every verb (docs/units.md).

Sizes: a number (``1.5`` is fine) and an optional unit, case-insensitive, spaces allowed:

- ``KiB MiB GiB TiB`` and the bare letters ``K M G T`` are powers of 1024, as in
  ``df -h``, ``free -g``, ``ulimit`` and Slurm's ``--mem=40G``;
- ``KB MB GB TB`` (``kB`` too) are powers of 1000, as disks, GPU data sheets and the
  Hugging Face ``max_shard_size="5GB"`` count;
- ``B`` or no unit: bytes.

So ``40G == 40GiB`` and ``40GB == 40 * 10**9`` everywhere (doctor, plan, collect-ckpt).

Durations: seconds as a plain number (``90``, ``2.5``), a sum of ``<number><unit>``
terms with units ``s m h d`` (``90s``, ``5m``, ``1h30m``, ``2d``), or Slurm's clock form
``[D-]HH:MM:SS``, ``D-HH:MM`` or ``MM:SS``.

Bottom layer: standard library only, no clusterkit imports beyond the error base.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
from collections.abc import Callable

from clusterkit.errors import ClusterkitError

_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)
_TERM = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([smhd])", re.IGNORECASE)
_CLOCK = re.compile(r"(?:([0-9]+)-)?(?:([0-9]+):)?([0-9]+):([0-9]+)")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
SIZE_HINT = "e.g. 512M or 40G (powers of 1024, = 40GiB), or 40GB (powers of 1000); see docs/units.md"
DURATION_HINT = "e.g. 90, 90s, 5m, 1h30m or 01:30:00; see docs/units.md"


def _multiplier(letter: str, binary: str, byte: str) -> int | None:
    """The unit's factor, or None for a spelling the rule does not give a meaning (``Gi``)."""
    if not letter:
        return 1 if not binary else None
    if binary:
        return _BINARY[letter] if byte else None
    return _DECIMAL[letter] if byte else _BINARY[letter]


def parse_size(text: str, key: str | None = None) -> int:
    """Bytes for ``text`` by the one rule above; :class:`ClusterkitError` naming ``key``."""
    m = _SIZE.fullmatch(text)
    factor = _multiplier(m.group(2).lower(), m.group(3), m.group(4)) if m else None
    if m is None or factor is None:
        raise ClusterkitError(f"{text!r} is not a size", key=key, hint=SIZE_HINT)
    return int(float(m.group(1)) * factor)


def parse_duration(text: str, key: str | None = None) -> float:
    """Seconds for ``text`` (see the module docstring); never negative, never NaN."""
    t = text.strip()
    seconds = None
    for reader in (_plain, _terms, _clock):
        seconds = reader(t)
        if seconds is not None:
            break
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        raise ClusterkitError(f"{text!r} is not a duration", key=key, hint=DURATION_HINT)
    return seconds


def _plain(t: str) -> float | None:
    return float(t) if _NUMBER.fullmatch(t) else None


def _terms(t: str) -> float | None:
    """``1h30m``: each unit once at most, largest first (what people write)."""
    terms = _TERM.findall(t)
    if not terms or "".join(n + u for n, u in terms) != t:
        return None
    units = [u.lower() for _n, u in terms]
    order = [u for u in "dhms" if u in units]
    if units != order:
        return None
    return sum(float(n) * _SECONDS[u.lower()] for n, u in terms)


def _clock(t: str) -> float | None:
    m = _CLOCK.fullmatch(t)
    if m is None:
        return None
    days, hours, minutes, secs = (int(g) if g else 0 for g in m.groups())
    if m.group(2) is None and m.group(1) is not None:  # Slurm's D-HH:MM
        hours, minutes, secs = minutes, secs, 0
    if minutes >= 60 or secs >= 60:
        return None
    return float(((days * 24 + hours) * 60 + minutes) * 60 + secs)


def size_type(flag: str, minimum: int = 0) -> Callable[[str], int]:
    """An argparse ``type=``: a bad size fails while parsing (exit 2), naming ``flag``."""
    def convert(text: str) -> int:
        try:
            value = parse_size(text, flag)
        except ClusterkitError as exc:
            raise argparse.ArgumentTypeError(f"{exc.message} ({exc.hint})") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} bytes, got {text!r}")
        return value
    return convert


@functools.cache
def duration_type(flag: str, *, zero: bool = True, whole: bool = False) -> Callable[[str], float]:
    """The argparse ``type=`` of every duration flag (``--grace``, ``--poll``, ...).

    One rule (:func:`parse_duration`): never NaN, inf or negative. ``zero=False`` where
    0 would mean nothing (a poll interval, a connect timeout), ``whole=True`` where
    the value is handed on as whole seconds (Slurm's ``--signal``): then an ``int``. A refusal fails
    while parsing (exit 2), the flag named by argparse. Cached: a flag's type is one
    object in every verb that has it (tests/unit/test_jobflags.py compares them).
    """
    def convert(text: str) -> float:
        try:
            value = parse_duration(text, flag)
        except ClusterkitError as exc:
            raise argparse.ArgumentTypeError(f"{exc.message} ({exc.hint})") from None
        if not zero and value == 0:
            raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
        if whole:
            if value != int(value):
                raise argparse.ArgumentTypeError(f"must be whole seconds, got {text!r}")
            return int(value)  # handed on as a Slurm argument: 300, not 300.0
        return value
    return convert
