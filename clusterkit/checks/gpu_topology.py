"""Pure parsers for ``nvidia-smi`` output: ``topo -m``, ``topo -p2p``, ``--query-gpu`` CSV.

Text in, frozen dataclasses out; no I/O. The probe ships the raw text back and
the caller parses it here, so a parser fix never needs a new probe on the nodes.
Tested on real pasted outputs in tests/fixtures/gpu (see SOURCES.md there).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# Link codes of `nvidia-smi topo -m` (SOC is the pre-2017 spelling of SYS).
PCIE_LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")
_LINK_RE = re.compile(r"^(X|PIX|PXB|PHB|NODE|SYS|SOC|NV\d+)$")
_CPU_LIST_RE = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
_EXTRA_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


class TopoParseError(ValueError):
    """The text is not an ``nvidia-smi topo`` matrix we understand (line is 1-based)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line


@dataclass(frozen=True)
class TopoMatrix:
    """``nvidia-smi topo -m``: devices (GPUs then NICs, in header order) and their links."""

    devices: tuple[str, ...]
    links: Mapping[tuple[str, str], str]
    cpu_affinity: Mapping[str, str | None] = field(default_factory=dict)
    numa_affinity: Mapping[str, str | None] = field(default_factory=dict)
    nic_names: Mapping[str, str] = field(default_factory=dict)  # NIC0 -> mlx5_0

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(d for d in self.devices if re.fullmatch(r"GPU\d+", d))

    @property
    def nics(self) -> tuple[str, ...]:
        """NIC device names (``mlx5_0``), resolved through the NIC Legend when present."""
        return tuple(self.nic_names.get(d, d) for d in self.devices if d not in self.gpus)

    def link(self, a: str, b: str) -> str:
        return self.links[(a, b)]

    def gpu_pairs(self) -> list[tuple[str, str, str]]:
        gpus = self.gpus
        return [(a, b, self.links[(a, b)]) for i, a in enumerate(gpus) for b in gpus[i + 1:]]

    @property
    def has_nvlink(self) -> bool:
        return any(link.startswith("NV") for _a, _b, link in self.gpu_pairs())

    def pairs_with(self, *codes: str) -> list[tuple[str, str]]:
        return [(a, b) for a, b, link in self.gpu_pairs() if link in codes]

    def numa_nodes(self) -> set[str]:
        return {v for g in self.gpus if (v := self.numa_affinity.get(g)) not in (None, "N/A")}


def _is_header(tokens: list[str]) -> bool:
    # The GPU0 *row* has "X" as its first cell; the header has GPU1/NIC0/CPU there.
    return len(tokens) >= 2 and tokens[0] == "GPU0" and tokens[1] != "X"


def _extra_columns(header_line: str) -> list[str]:
    return [c for c in _EXTRA_COLUMNS if c in header_line]


def _split_device_header(tokens: list[str]) -> list[str]:
    devices: list[str] = []
    for tok in tokens:
        if tok in ("CPU", "NUMA", "GPU") and devices:
            break
        devices.append(tok)
    return devices


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse ``nvidia-smi topo -m`` (space- or tab-separated, with or without legends)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if _is_header(ln.split())), None)
    if start is None:
        raise TopoParseError("no 'GPU0 ...' header line found")
    devices = _split_device_header(lines[start].split())
    extras = _extra_columns(lines[start])
    links: dict[tuple[str, str], str] = {}
    cpu: dict[str, str | None] = {}
    numa: dict[str, str | None] = {}
    seen: set[str] = set()
    for lineno, line in enumerate(lines[start + 1:], start=start + 2):
        tokens = line.split()
        if not tokens or tokens[0] not in devices:
            if seen and tokens[:1] == ["Legend:"]:
                break
            continue
        row = tokens[0]
        cells = tokens[1:1 + len(devices)]
        if len(cells) < len(devices):
            raise TopoParseError(f"row {row} has {len(cells)} cells, expected {len(devices)}",
                                 lineno)
        for col, cell in zip(devices, cells, strict=True):
            if not _LINK_RE.match(cell):
                raise TopoParseError(f"unknown link {cell!r} in row {row}", lineno)
            links[(row, col)] = cell
        _affinity(row, tokens[1 + len(devices):], extras, cpu, numa)
        seen.add(row)
    missing = [d for d in devices if d not in seen]
    if missing:
        raise TopoParseError(f"no row for {', '.join(missing)}")
    return TopoMatrix(tuple(devices), links, cpu, numa, _nic_legend(lines))


def _affinity(row: str, rest: list[str], extras: list[str],
              cpu: dict[str, str | None], numa: dict[str, str | None]) -> None:
    if not row.startswith("GPU") or not extras:
        return
    # Empty CPU/NUMA cells collapse under whitespace splitting; they are the
    # leading ones (unknown affinity), so align the values to the right.
    kept: list[str | None] = list(rest[-len(extras):]) if rest else []
    values = [None] * (len(extras) - len(kept)) + kept
    by_col = dict(zip(extras, values, strict=True))
    c = by_col.get("CPU Affinity")
    cpu[row] = c if c is not None and _CPU_LIST_RE.match(c) else None
    numa[row] = by_col.get("NUMA Affinity")


def _nic_legend(lines: list[str]) -> dict[str, str]:
    names: dict[str, str] = {}
    in_legend = False
    for line in lines:
        if line.strip() == "NIC Legend:":
            in_legend = True
            continue
        m = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)
        if in_legend and m:
            names[m.group(1)] = m.group(2)
    return names


# ----------------------------------------------------------------------------- topo -p2p

P2P_CODES = {
    "OK": "Status Ok", "CNS": "Chipset not supported", "GNS": "GPU not supported",
    "TNS": "Topology not supported", "NS": "Not supported", "DR": "Disabled by regkey",
    "U": "Unknown",
}


@dataclass(frozen=True)
class P2PMatrix:
    gpus: tuple[str, ...]
    status: Mapping[tuple[str, str], str]

    def not_ok(self) -> list[tuple[str, str, str]]:
        gpus = self.gpus
        return [(a, b, self.status[(a, b)]) for i, a in enumerate(gpus) for b in gpus[i + 1:]
                if self.status[(a, b)] != "OK"]


def parse_p2p(text: str) -> P2PMatrix:
    """Parse ``nvidia-smi topo -p2p {r,w,n,a,p}``."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.split()[:1] == ["GPU0"]
                  and "X" not in ln.split()), None)
    if start is None:
        raise TopoParseError("no 'GPU0 ...' header line found")
    gpus = tuple(t for t in lines[start].split() if re.fullmatch(r"GPU\d+", t))
    status: dict[tuple[str, str], str] = {}
    for lineno, line in enumerate(lines[start + 1:], start=start + 2):
        tokens = line.split()
        if not tokens or tokens[0] not in gpus:
            continue
        cells = tokens[1:1 + len(gpus)]
        if len(cells) != len(gpus):
            raise TopoParseError(f"row {tokens[0]} has {len(cells)} cells", lineno)
        for col, cell in zip(gpus, cells, strict=True):
            if cell != "X" and cell not in P2P_CODES:
                raise TopoParseError(f"unknown p2p status {cell!r}", lineno)
            status[(tokens[0], col)] = cell
    if len({r for r, _c in status}) != len(gpus):
        raise TopoParseError("incomplete p2p matrix")
    return P2PMatrix(gpus, status)


# ----------------------------------------------------------------------------- --query-gpu


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    driver_version: str
    memory_mib: int | None


def parse_query_gpu(text: str) -> list[GpuInfo]:
    """Parse ``--query-gpu=index,name,driver_version,memory.total --format=csv,noheader``."""
    gpus: list[GpuInfo] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            raise TopoParseError(f"not a GPU CSV row: {line.strip()!r}", lineno)
        # A GPU name may itself contain commas: index is first, the last two are fixed.
        name = ", ".join(parts[1:-2])
        mem = re.match(r"^(\d+)\s*MiB$", parts[-1])
        gpus.append(GpuInfo(int(parts[0]), name, parts[-2], int(mem.group(1)) if mem else None))
    return gpus
