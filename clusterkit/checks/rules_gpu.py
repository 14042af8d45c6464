"""Doctor rules: GPU count against the inventory, driver parity, topology and P2P."""

from __future__ import annotations

from collections.abc import Mapping

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.rules_base import (
    DoctorContext,
    ok_nodes,
    parity,
)

# ----------------------------------------------------------------------------- GPUs


def _gpu_finding(f: NodeFacts, ctx: DoctorContext) -> Finding:
    want = ctx.gpus.get(f.host)
    slots = ctx.slots.get(f.host)
    if f.nvidia_smi is None:
        if want:
            return Finding("gpu.count", Status.FAIL, f.host,
                           f"inventory says {want} GPUs but nvidia-smi is not on PATH",
                           "install the NVIDIA driver, or set gpus: 0 for this host")
        return Finding("gpu.count", Status.PASS, f.host, "no GPU (CPU node)")
    if f.gpus is None:
        return Finding("gpu.count", Status.FAIL, f.host, f"nvidia-smi failed: {f.gpu_error}",
                       "check the driver (`nvidia-smi` by hand; reboot after driver updates)")
    n = len(f.gpus)
    if want is not None and n != want:
        return Finding("gpu.count", Status.FAIL, f.host, f"{n} GPUs found, inventory says {want}",
                       f"set gpus: {n} for this host, or check for a failed GPU (`nvidia-smi`)")
    if slots is not None and slots > n:
        return Finding("gpu.count", Status.FAIL, f.host, f"slots={slots} but only {n} GPUs",
                       f"set slots: {n} (one rank per GPU)")
    if slots is not None and slots < n:
        return Finding("gpu.count", Status.WARN, f.host, f"{n} GPUs but slots={slots}: "
                       f"{n - slots} idle", f"set slots: {n} unless that is intended")
    name = f.gpus[0].name if f.gpus else "GPU"
    return Finding("gpu.count", Status.PASS, f.host, f"{n}x {name}")


def check_gpus(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    nodes = ok_nodes(facts)
    out = [_gpu_finding(f, ctx) for f in nodes]
    drivers = {f.host: f.driver_version for f in nodes if f.driver_version}
    out += parity("gpu.driver", "driver", drivers, ctx, Status.WARN,
                  lambda h, v: f"install driver {v} (mismatched drivers can change NCCL behaviour)")
    return out


def check_topology(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in ok_nodes(facts):
        topo = f.topo
        if topo is None or len(topo.gpus) < 2:
            continue
        nv = [link for _a, _b, link in topo.gpu_pairs() if link.startswith("NV")]
        pairs = len(topo.gpu_pairs())
        if len(nv) == pairs:
            out.append(Finding("gpu.topology", Status.PASS, f.host,
                               f"NVLink between all GPU pairs ({', '.join(sorted(set(nv)))})"))
        elif nv:
            out.append(Finding("gpu.topology", Status.PASS, f.host,
                               f"NVLink on {len(nv)}/{pairs} GPU pairs, the rest over PCIe"))
        else:
            sys_pairs = topo.pairs_with("SYS", "SOC")
            if sys_pairs:
                out.append(Finding(
                    "gpu.topology", Status.WARN, f.host,
                    f"PCIe only (no NVLink); {len(sys_pairs)}/{pairs} GPU pairs cross the CPU "
                    f"interconnect (SYS)",
                    "expect PCIe/UPI-bound intra-node allreduce; leave NCCL_P2P_DISABLE unset; "
                    "check `nvidia-smi topo -p2p r`; prefer fewer GPUs per socket over "
                    "cross-socket groups"))
            else:
                out.append(Finding("gpu.topology", Status.PASS, f.host,
                                   "PCIe only (no NVLink); all GPU pairs under one CPU socket"))
        if f.p2p is not None:
            for a, b, code in f.p2p.not_ok():
                out.append(Finding("gpu.p2p", Status.WARN, f.host,
                                   f"P2P {a}<->{b}: {code}; NCCL stages through host memory",
                                   "check ACS/IOMMU in BIOS; in VMs P2P is often unsupported"))
    return out
