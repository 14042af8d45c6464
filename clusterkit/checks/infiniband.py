"""Pure parsers for RDMA port state: ``ibstat``, ``ibv_devinfo`` and the probe's sysfs rows.

All three become the same :class:`IBPort` so the rules do not care which tool a
node happened to have. Tested on real outputs in tests/fixtures/ib (SOURCES.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# ibstat spells states in words, ibv_devinfo as PORT_*, sysfs as "4: ACTIVE".
_STATE_WORDS = {
    "active": "ACTIVE", "down": "DOWN", "initializing": "INIT", "init": "INIT",
    "armed": "ARMED", "active_defer": "ACTIVE_DEFER", "nop": "NOP",
}


@dataclass(frozen=True)
class IBPort:
    device: str  # mlx5_0
    port: int
    state: str  # ACTIVE | DOWN | INIT | ARMED | ... (normalized)
    phys_state: str | None = None  # LinkUp | Disabled | Polling ...
    link_layer: str | None = None  # InfiniBand | Ethernet (RoCE)
    rate_gbps: float | None = None

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def is_roce(self) -> bool:
        return (self.link_layer or "").lower() == "ethernet"

    @property
    def name(self) -> str:
        return f"{self.device}:{self.port}"


def normalize_state(raw: str) -> str:
    text = raw.strip()
    text = re.sub(r"^\d+:\s*", "", text)  # sysfs "4: ACTIVE"
    text = re.sub(r"\s*\(\d+\)$", "", text)  # ibv_devinfo "PORT_ACTIVE (4)"
    text = text.removeprefix("PORT_")
    return _STATE_WORDS.get(text.lower(), text.upper())


def _rate(raw: str | None) -> float | None:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)", raw or "")
    return float(m.group(1)) if m else None


def parse_ibstat(text: str) -> list[IBPort]:
    """Parse ``ibstat`` (all CAs, or one CA). Lines it does not know are skipped."""
    ports: list[IBPort] = []
    ca: str | None = None
    port: int | None = None
    attrs: dict[str, str] = {}

    def flush() -> None:
        if ca is not None and port is not None and "State" in attrs:
            ports.append(IBPort(ca, port, normalize_state(attrs["State"]),
                                attrs.get("Physical state"), attrs.get("Link layer"),
                                _rate(attrs.get("Rate"))))

    for line in text.splitlines():
        m_ca = re.match(r"^CA '([^']+)'", line)
        m_port = re.match(r"^\s+Port (\d+):\s*$", line)
        if m_ca or m_port:
            flush()
            attrs = {}
            port = int(m_port.group(1)) if m_port else None
            ca = m_ca.group(1) if m_ca else ca
            continue
        key, sep, value = line.strip().partition(":")
        if sep and port is not None:
            attrs[key.strip()] = value.strip()
    flush()
    return ports


def parse_ibv_devinfo(text: str) -> list[IBPort]:
    """Parse ``ibv_devinfo`` (plain or ``-v``); "Failed to open device" noise is ignored."""
    ports: list[IBPort] = []
    hca: str | None = None
    port: int | None = None
    attrs: dict[str, str] = {}

    def flush() -> None:
        if hca is not None and port is not None and "state" in attrs:
            ports.append(IBPort(hca, port, normalize_state(attrs["state"]),
                                _phys(attrs.get("phys_state")), attrs.get("link_layer"),
                                None))

    for line in text.splitlines():
        m_hca = re.match(r"^hca_id:\s*(\S+)", line)
        m_port = re.match(r"^\s+port:\s*(\d+)\s*$", line)
        if m_hca or m_port:
            flush()
            attrs = {}
            port = int(m_port.group(1)) if m_port else None
            hca = m_hca.group(1) if m_hca else hca
            continue
        key, sep, value = line.strip().partition(":")
        if sep and port is not None and key.strip() not in attrs:
            attrs[key.strip()] = value.strip()
    flush()
    return ports


def _phys(raw: str | None) -> str | None:
    # ibv_devinfo -v: "LINK_UP (5)" -> "LinkUp" so every source spells it alike.
    if raw is None:
        return None
    word = re.sub(r"\s*\(\d+\)$", "", re.sub(r"^\d+:\s*", "", raw.strip()))
    return {"LINK_UP": "LinkUp", "DISABLED": "Disabled", "POLLING": "Polling",
            "SLEEP": "Sleep", "LINK_ERROR_RECOVERY": "LinkErrorRecovery"}.get(word, word)


def ports_from_sysfs(rows: Iterable[Mapping[str, object]]) -> list[IBPort]:
    """The probe's ``ib.sysfs`` rows (``/sys/class/infiniband/<dev>/ports/<n>/*``)."""
    ports: list[IBPort] = []
    for row in rows:
        state = row.get("state")
        if not isinstance(state, str):
            continue
        phys = row.get("phys_state")
        ll = row.get("link_layer")
        rate = row.get("rate")
        ports.append(IBPort(str(row.get("device")), int(str(row.get("port"))),
                            normalize_state(state), _phys(phys if isinstance(phys, str) else None),
                            ll if isinstance(ll, str) else None,
                            _rate(rate if isinstance(rate, str) else None)))
    return ports


@dataclass(frozen=True)
class HcaSpec:
    """``NCCL_IB_HCA``: ``[^|=]dev[:port][,dev[:port]...]`` (NCCL's own syntax)."""

    exclude: bool
    exact: bool
    entries: tuple[tuple[str, int | None], ...]


def parse_nccl_ib_hca(value: str) -> HcaSpec:
    text = value.strip()
    exclude = text.startswith("^")
    text = text.removeprefix("^")
    exact = text.startswith("=")
    text = text.removeprefix("=")
    entries: list[tuple[str, int | None]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        dev, _, port = item.partition(":")
        entries.append((dev, int(port) if port.isdigit() else None))
    return HcaSpec(exclude, exact, tuple(entries))


def unmatched_hca_entries(spec: HcaSpec, ports: Sequence[IBPort]) -> list[str]:
    """Entries of NCCL_IB_HCA that name no existing device/port (prefix match unless '=')."""
    bad: list[str] = []
    for dev, port in spec.entries:
        hits = [p for p in ports if (p.device == dev if spec.exact else p.device.startswith(dev))]
        if port is not None:
            hits = [p for p in hits if p.port == port]
        if not hits:
            bad.append(dev if port is None else f"{dev}:{port}")
    return bad
