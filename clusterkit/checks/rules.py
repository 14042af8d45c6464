"""Doctor rules: node facts in, findings out. Pure: no I/O, no clock, no environment.

Every rule has the signature ``(facts, ctx) -> list[Finding]`` where ``facts``
maps inventory host name -> :class:`NodeFacts` (in inventory order) and ``ctx``
is the :class:`DoctorContext` (what the inventory and the launching machine
say). Rules report one finding per host (and subject) so the report can fold
identical results into host ranges; parity rules name the majority value and
the hosts that hold it. Nodes whose probe failed are skipped by every rule but
:func:`check_probe`, which reports them once.
"""

from __future__ import annotations

import functools
import ipaddress
import statistics
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Measure, Status
from clusterkit.checks.infiniband import parse_nccl_ib_hca, unmatched_hca_entries
from clusterkit.hostrange import fold
from clusterkit.launchers import BACKENDS
from clusterkit.node.parity import MUST, PACKAGES, SHOULD, majority
from clusterkit.node.parity import holders as holders_of

GiB = 1024**3
SHM_MIN_BYTES = 1 * GiB
STORAGE_MIN_FREE_BYTES = 64 * 1024**2  # below this a checkpoint dir counts as full
NOFILE_MIN = 65536
SKEW_WARN_S = 2.0
SKEW_FAIL_S = 30.0
# Doctor modes whose launcher runs its own sys.executable on every node: DeepSpeed's
# runner from the launching machine ("pdsh") or from node 0 (the registry's "deepspeed").
SAME_PYTHON_BACKENDS = ("pdsh", *sorted({b.doctor for b in BACKENDS.values() if b.doctor != "ssh"}))
# Interfaces that never carry inter-node traffic.
VIRTUAL_IFACE_PREFIXES = ("lo", "docker", "virbr", "veth", "br-", "cni", "flannel", "tun", "tap")


@dataclass(frozen=True)
class DoctorContext:
    """What the checks compare facts against (from the inventory and the launching machine)."""

    hosts: tuple[str, ...]  # inventory order = rank order
    slots: Mapping[str, int] = field(default_factory=dict)
    gpus: Mapping[str, int] = field(default_factory=dict)  # GPUs the inventory declares
    backend: str = "pdsh"  # pdsh | ssh | torchrun | slurm | accelerate
    head_tools: Mapping[str, str | None] = field(default_factory=dict)  # which() on the head
    head_python: str | None = None  # sys.executable of the launcher (pdsh reuses it)
    checkpoint_bytes: int | None = None  # estimated size of one checkpoint on a node
    # Local clock (time.time()) just before sending / after receiving each node's probe.
    probe_windows: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # Every node is this machine (the embedded default's virtual nodes, or loopback
    # addresses): the ranks talk over loopback, so how names resolve for *other*
    # machines cannot matter and those checks only inform (see one_machine()).
    one_machine: bool = False


Rule = Callable[[Mapping[str, NodeFacts], DoctorContext], list[Finding]]
T = TypeVar("T", bound=Hashable)


# ----------------------------------------------------------------------------- helpers


def _ok(facts: Mapping[str, NodeFacts]) -> list[NodeFacts]:
    return [f for f in facts.values() if f.ok]


def _show(value: object) -> str:
    return "not installed" if value is None else str(value)


def parity(check: str, label: str, values: Mapping[str, T], ctx: DoctorContext,
           bad: Status, fix: Callable[[str, T], str]) -> list[Finding]:
    """One finding per host: PASS for the majority value, ``bad`` for the odd ones."""
    if not values:
        return []
    common = majority(values, ctx.hosts)  # the gate's rule too (node/parity.py)
    holders = fold(holders_of(values, common, ctx.hosts))
    out = []
    for host, value in values.items():
        if value == common:
            out.append(Finding(check, Status.PASS, host, f"{label} {_show(value)}"))
        else:
            out.append(Finding(check, bad, host,
                               f"{label} {_show(value)} ≠ {_show(common)} on {holders}",
                               fix(host, common)))
    return out


def _python(facts: Mapping[str, NodeFacts], host: str) -> str:
    return facts[host].python_executable or "python"


@functools.lru_cache(maxsize=4096)
def _is_loopback(addr: str) -> bool:
    # Asked for every (node, peer) pair: 32k times at 128 nodes, ~0.7 s of ipaddress
    # parsing uncached; the distinct addresses are only the peers'.
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def one_machine(transports_and_addresses: Iterable[tuple[str, str]]) -> bool:
    """True when every node is this machine: ``local`` transport or a loopback address."""
    nodes = list(transports_and_addresses)
    return bool(nodes) and all(t == "local" or _is_loopback(a) or a == "localhost"
                               for t, a in nodes)


ONE_MACHINE_NOTE = "fine here: every node is this machine (a FAIL on an inventory of several machines)"


def _short(name: str) -> str:
    return name.split(".", 1)[0].lower()


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


# ----------------------------------------------------------------------------- reachability


# What to do for each way the probe can fail to answer (TransportError kinds, docs/ssh.md).
_PROBE_FIXES = {
    "refused": "start sshd on the node (`systemctl start ssh`) or fix the port in the inventory",
    "timeout": "the node is down, firewalled or the address is wrong: check `ping` and the "
               "inventory address",
    "resolve": "fix the inventory address (or HostName in the ssh config), /etc/hosts or DNS",
    "auth": "put your public key in ~/.ssh/authorized_keys on the node, or set identity_file",
    "hostkey-unknown": "verify the fingerprint, then `ssh` to the node once or rerun with "
                       "--accept-new-host-keys",
    "hostkey-changed": "the node was reinstalled or this is a man-in-the-middle: after "
                       "verifying, `ssh-keygen -R <address>` and connect once",
    "command-timeout": "the probe did not finish: a login shell blocked in ~/.bashrc (e.g. "
                       "a `pyenv init` lock), a stuck nvidia-smi or NFS mount; time "
                       "`ssh <host> true` and run the probe by hand",
    "interpreter": "the inventory's python does not exist on this node: install it at that path "
                   "or set `python:` for this host",
    "probe": "copy clusterkit/node/probe.py to the node and run `<python> probe.py facts` there "
             "to see the error",
}


def check_probe(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in facts.values():
        if not f.ok:
            kind = f.error_kind
            fix = _PROBE_FIXES.get(kind or "") or f.error_hint or (
                "check `ssh -o BatchMode=yes <host> true` and that the inventory's python "
                "exists on the node")
            detail = (f"unreachable ({kind}): {f.probe_error}" if kind
                      else f"no answer from the probe: {f.probe_error}")
            out.append(Finding("ssh", Status.FAIL, f.host, detail, fix))
            continue
        out.append(Finding("ssh", Status.PASS, f.host, "probe answered"))
        for section, err in sorted({**f.section_errors, **f.parse_errors}.items()):
            out.append(Finding(f"probe.{section}", Status.WARN, f.host,
                               f"could not read {section}: {err}", None))
        if f.heavy_modules:
            out.append(Finding("probe.imports", Status.WARN, f.host,
                               f"probe imported {', '.join(f.heavy_modules)} (slow)", None))
    return out


# ----------------------------------------------------------------------------- environment parity


def check_interpreter(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    values = {f.host: f.python_executable or "?" for f in _ok(facts)}
    bad = Status.FAIL if ctx.backend in SAME_PYTHON_BACKENDS else Status.WARN
    why = (" (the DeepSpeed runner starts its own sys.executable on every node)"
           if bad is Status.FAIL else "")
    out = parity("python.path", "interpreter", values, ctx, bad,
                 lambda h, common: f"use the same absolute interpreter path on every node "
                                   f"(e.g. a venv at {common}){why}")
    if ctx.head_python and bad is Status.FAIL and values:
        for host, path in values.items():
            if path != ctx.head_python:
                out.append(Finding("python.head", Status.FAIL, host,
                                   f"interpreter {path} ≠ launcher's {ctx.head_python}",
                                   f"create {ctx.head_python} on this node or launch from "
                                   f"an interpreter at {path}"))
    return out


# The packages compared across nodes and what a mismatch is: the one table
# (node/parity.py), whose MUST packages the launch gate refuses on.
_VERSION_CHECKS: tuple[tuple[str, Status], ...] = tuple(
    (pkg, Status.FAIL if kind == MUST else Status.WARN)
    for pkg, kind in PACKAGES.items() if kind in (MUST, SHOULD))


def check_versions(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    nodes = _ok(facts)
    out = parity("version.python", "python", {f.host: f.python_version for f in nodes}, ctx,
                 Status.FAIL, lambda h, v: f"recreate the environment with Python {v}")
    for pkg, severity in _VERSION_CHECKS:
        values = {f.host: f.versions.get(pkg) for f in nodes}
        if not any(values.values()):
            continue  # nobody has it: nothing to compare

        def fix(host: str, want: str | None, pkg: str = pkg) -> str:
            if want is None:
                return f"{_python(facts, host)} -m pip uninstall {pkg}"
            return f"{_python(facts, host)} -m pip install '{pkg}=={want}'"

        out += parity(f"version.{pkg}", pkg, values, ctx, severity, fix)
    with_torch = [f for f in nodes if f.versions.get("torch")]
    out += parity("version.torch-cuda", "torch CUDA", {f.host: f.torch_cuda or "cpu"
                                                        for f in with_torch}, ctx, Status.FAIL,
                  lambda h, v: f"install the torch build for CUDA {v} "
                               f"(same --index-url as the other nodes)")
    nccl = {f.host: f.nccl_version for f in with_torch}
    if any(nccl.values()):
        out += parity("version.nccl", "NCCL", nccl, ctx, Status.FAIL,
                      lambda h, v: f"install the same NCCL ({v}), e.g. the torch wheel's "
                                   f"nvidia-nccl-cu* pin")
    return out


def _freeze_map(items: Iterable[str]) -> dict[str, str]:
    pairs = (i.split("==", 1) for i in items if "==" in i)
    return {name: ver for name, ver in pairs}


def check_freeze(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    nodes = [f for f in _ok(facts) if f.freeze]
    if not nodes:
        return []
    sets = {f.host: f.freeze for f in nodes}
    common = majority(sets, ctx.hosts)
    holders = fold(h for h in ctx.hosts if sets.get(h) == common)
    first = next((h for h in ctx.hosts if sets.get(h) == common), holders)
    want = _freeze_map(common)
    out = []
    for f in nodes:
        if f.freeze == common:
            out.append(Finding("pip.freeze", Status.PASS, f.host,
                               f"same {len(common)} packages as {holders}"))
            continue
        have = _freeze_map(f.freeze)
        diffs = ([f"{n} {have[n]}≠{want[n]}" for n in sorted(want) if n in have
                  and have[n] != want[n]]
                 + [f"{n} missing" for n in sorted(want) if n not in have]
                 + [f"+{n} {have[n]}" for n in sorted(have) if n not in want])
        shown = ", ".join(diffs[:8]) + (f" (+{len(diffs) - 8} more)" if len(diffs) > 8 else "")
        out.append(Finding("pip.freeze", Status.WARN, f.host,
                           f"{len(diffs)} package(s) differ from {holders}: {shown}",
                           f"`pip freeze` on {first} > req.txt, then "
                           f"`{_python(facts, f.host)} -m pip install -r req.txt` here"))
    return out


def check_workdir(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in _ok(facts):
        if f.workdir is None:
            continue
        if not f.workdir_exists:
            out.append(Finding("workdir", Status.FAIL, f.host, f"{f.workdir} does not exist",
                               "the launcher does `cd <workdir>` on every node: create it or "
                               "sync the code there (same path on all nodes)"))
        elif not f.workdir_writable:
            out.append(Finding("workdir", Status.WARN, f.host, f"{f.workdir} is not writable",
                               "fix ownership/permissions (logs and .deepspeed_env go there)"))
        else:
            out.append(Finding("workdir", Status.PASS, f.host, f"{f.workdir} exists"))
    return out


# ----------------------------------------------------------------------------- build toolchain


def check_ninja(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in _ok(facts):
        py = f.python_executable or "python"
        bindir = py.rsplit("/", 1)[0] if "/" in py else None
        if f.tools.get("ninja"):
            out.append(Finding("ninja", Status.PASS, f.host, "ninja on PATH"))
        elif f.versions.get("ninja") and bindir:
            out.append(Finding("ninja", Status.WARN, f.host,
                               "ninja is installed but not on the PATH remote commands get",
                               f"add PATH={bindir}:$PATH to .deepspeed_env (or the "
                               f"inventory env) so DeepSpeed can JIT-build ops"))
        else:
            out.append(Finding("ninja", Status.WARN, f.host,
                               "ninja not found: DeepSpeed cannot JIT-build ops",
                               f"{py} -m pip install ninja (into the interpreter's env) and "
                               f"make sure its bin dir is on PATH in .deepspeed_env"))
    return out


def _has_gpus(f: NodeFacts, ctx: DoctorContext) -> bool:
    return bool(f.gpu_count) or ctx.gpus.get(f.host, 0) > 0


def check_cuda(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in _ok(facts):
        if not _has_gpus(f, ctx):
            out.append(Finding("cuda", Status.PASS, f.host, "no GPU: CUDA checks skipped"))
            continue
        if not f.libcudart:
            out.append(Finding("cuda.libcudart", Status.FAIL, f.host,
                               "libcudart.so not found (LD_LIBRARY_PATH, CUDA_HOME, torch/lib, "
                               "ldconfig)",
                               "install the CUDA runtime (or a CUDA torch wheel) and add its lib "
                               "dir to LD_LIBRARY_PATH in .deepspeed_env"))
        else:
            out.append(Finding("cuda.libcudart", Status.PASS, f.host, "libcudart found"))
        if f.cuda_home and not f.cuda_home_exists:
            out.append(Finding("cuda.home", Status.FAIL, f.host,
                               f"CUDA_HOME={f.cuda_home} does not exist",
                               "point CUDA_HOME at the CUDA toolkit (dir with bin/nvcc)"))
        elif not f.cuda_home and not f.nvcc:
            out.append(Finding("cuda.home", Status.WARN, f.host,
                               "CUDA_HOME unset and no nvcc on PATH: DeepSpeed JIT ops will fail",
                               "install the CUDA toolkit matching torch's CUDA and set "
                               "CUDA_HOME in .deepspeed_env"))
        else:
            out.append(Finding("cuda.home", Status.PASS, f.host, "CUDA toolkit found"))
    return out


def check_pdsh(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    """pdsh is needed where DeepSpeed's runner runs.

    backend ``pdsh``: the runner runs on the launching machine (``deepspeed --hostfile``
    by hand). backend ``deepspeed`` (clusterkit launch): the runner runs on the first
    selected node and reaches the others through pdsh from there.
    """
    fix = "apt-get install pdsh (or yum install pdsh), or use --backend torchrun"
    if ctx.backend == "pdsh":
        if ctx.head_tools.get("pdsh"):
            return [Finding("pdsh", Status.PASS, "", "pdsh found on the launching machine")]
        return [Finding("pdsh", Status.FAIL, "", "pdsh not found on the launching machine "
                        "(the DeepSpeed runner needs it)", fix)]
    if ctx.backend != "deepspeed" or not ctx.hosts:
        return []
    runner = facts.get(ctx.hosts[0])
    if runner is None or not runner.ok:
        return []
    if runner.tools.get("pdsh"):
        return [Finding("pdsh", Status.PASS, runner.host, "pdsh on PATH (DeepSpeed runner node)")]
    return [Finding("pdsh", Status.FAIL, runner.host,
                    "pdsh not on the PATH remote commands get; the DeepSpeed runner starts "
                    "here (first node) and reaches the others through pdsh", fix)]


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
    nodes = _ok(facts)
    out = [_gpu_finding(f, ctx) for f in nodes]
    drivers = {f.host: f.driver_version for f in nodes if f.driver_version}
    out += parity("gpu.driver", "driver", drivers, ctx, Status.WARN,
                  lambda h, v: f"install driver {v} (mismatched drivers can change NCCL behaviour)")
    return out


def check_topology(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in _ok(facts):
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


# ----------------------------------------------------------------------------- storage and limits


def check_storage(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    need = ctx.checkpoint_bytes
    out = []
    for f in _ok(facts):
        for s in f.storage:
            check = f"storage:{s.path}"
            if not s.writable:
                out.append(Finding(check, Status.FAIL, f.host, f"{s.path} is not writable",
                                   "create it with the right owner (mkdir -p; chown)"))
            elif s.free_bytes is not None and s.free_bytes < STORAGE_MIN_FREE_BYTES:
                out.append(Finding(check, Status.FAIL, f.host,
                                   f"{s.path}: full ({s.free_bytes // 1024**2} MiB free)",
                                   "free space or point the checkpoint dir at a bigger volume"))
            elif need is None or s.free_bytes is None:
                out.append(Finding(check, Status.PASS, f.host, f"{s.path} writable"))
            elif s.free_bytes < need:
                out.append(Finding(check, Status.FAIL, f.host,
                                   f"{s.path}: {_gib(s.free_bytes)} free < {_gib(need)} for one "
                                   f"checkpoint", "free space or point the checkpoint dir at "
                                   "a bigger volume"))
            elif s.free_bytes < 2 * need:
                out.append(Finding(check, Status.WARN, f.host,
                                   f"{s.path}: {_gib(s.free_bytes)} free, room for only one "
                                   f"{_gib(need)} checkpoint", "free space before the second save"))
            else:
                out.append(Finding(check, Status.PASS, f.host,
                                   f"{s.path}: room for 2+ checkpoints"))
    return out


def check_limits(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in _ok(facts):
        if f.shm_total_bytes is not None:
            if f.shm_total_bytes < SHM_MIN_BYTES:
                out.append(Finding("shm", Status.WARN, f.host,
                                   f"/dev/shm is {f.shm_total_bytes // 2**20} MiB (< 1 GiB): "
                                   "NCCL/dataloader shared memory will fail",
                                   "docker run --shm-size=16g, or `mount -o remount,size=16G "
                                   "/dev/shm`"))
            else:
                out.append(Finding("shm", Status.PASS, f.host, "/dev/shm >= 1 GiB"))
        if f.nofile_soft is not None and f.nofile_soft < NOFILE_MIN:
            out.append(Finding("ulimit.nofile", Status.WARN, f.host,
                               f"ulimit -n is {f.nofile_soft} (< {NOFILE_MIN})",
                               "add `* soft nofile 1048576` to /etc/security/limits.conf "
                               "(applied to new ssh sessions via pam_limits)"))
        elif f.nofile_soft is not None or f.shm_total_bytes is not None:
            out.append(Finding("ulimit.nofile", Status.PASS, f.host, f"ulimit -n >= {NOFILE_MIN}"))
    return out


def _clock_offset(t: float, window: tuple[float, float] | None) -> float:
    """How far the node's clock is outside the local send/receive window (0 inside).

    The probe read its clock somewhere between sending and receiving; only a time
    outside that window is provably skew, so slow SSH under load is never blamed.
    """
    if window is None:
        return t
    start, end = window
    return t - start if t < start else t - end if t > end else 0.0


def check_clock(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    offsets: dict[str, float] = {}
    for f in _ok(facts):
        if f.time is not None:
            offsets[f.host] = _clock_offset(f.time, ctx.probe_windows.get(f.host))
    if len(offsets) < 2:
        return []
    mid = statistics.median(offsets.values())
    out = []
    for host, off in offsets.items():
        skew = off - mid
        status = (Status.FAIL if abs(skew) > SKEW_FAIL_S else
                  Status.WARN if abs(skew) > SKEW_WARN_S else Status.PASS)
        if status is Status.PASS:
            out.append(Finding("clock", status, host, f"clock within {SKEW_WARN_S:g} s of median"))
        else:
            out.append(Finding.measured(
                "clock", status, host, Measure("clock {} s from the cluster median", skew,
                                               "+.1f"),
                "enable NTP: `timedatectl set-ntp true` (chrony or systemd-timesyncd)"))
    return out


# ----------------------------------------------------------------------------- names and network


def _own_ip(f: NodeFacts) -> str | None:
    """The address this node uses toward its peers (what its hostname should resolve to)."""
    routed = [i for a, i in f.routes.items() if i and not _is_loopback(a)]
    names = routed + [i for i in f.interfaces if not i.startswith(VIRTUAL_IFACE_PREFIXES)]
    for ifname in names:
        addrs = [a for a in f.interfaces.get(ifname, ()) if not _is_loopback(a)]
        if addrs:
            return addrs[0]
    return None


def check_own_name(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in _ok(facts):
        name = f.self_name or f.hostname or f.host
        addrs = f.forward.get(name)
        if (isinstance(addrs, str) or addrs is None) and ctx.one_machine:
            # torch's gloo falls back to loopback when the hostname does not resolve.
            out.append(Finding("names.self", Status.WARN, f.host,
                               f"own hostname {name} does not resolve: {addrs}; gloo falls back "
                               "to loopback, " + ONE_MACHINE_NOTE,
                               f"add `127.0.1.1 {name}` to /etc/hosts"))
        elif isinstance(addrs, str) or addrs is None:
            out.append(Finding("names.self", Status.FAIL, f.host,
                               f"own hostname {name} does not resolve: {addrs}",
                               f"add `<ip> {name}` to /etc/hosts"))
        elif any(_is_loopback(a) for a in addrs) and ctx.one_machine:
            lo = next(a for a in addrs if _is_loopback(a))
            out.append(Finding("names.self", Status.PASS, f.host,
                               f"own hostname {name} resolves to loopback {lo}: "
                               + ONE_MACHINE_NOTE))
        elif any(_is_loopback(a) for a in addrs):
            ip = _own_ip(f) or "<this node's IP>"
            lo = next(a for a in addrs if _is_loopback(a))
            out.append(Finding(
                "names.self", Status.FAIL, f.host,
                f"own hostname {name} resolves to loopback {lo}: gloo/NCCL advertise it and "
                f"peers cannot connect",
                f"in /etc/hosts replace `{lo} {name}` with `{ip} {name}`"))
        else:
            out.append(Finding("names.self", Status.PASS, f.host,
                               "own hostname resolves to a non-loopback address"))
    return out


def _peer_names(nodes: Sequence[NodeFacts]) -> list[str]:
    names: list[str] = []
    for f in nodes:
        for n in f.forward:
            if n != f.self_name and n not in names:
                names.append(n)
    return names


def check_peer_names(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    nodes = _ok(facts)
    out: list[Finding] = []
    bad_hosts: set[str] = set()
    for name in _peer_names(nodes):
        answers = {f.host: f.forward[name] for f in nodes if name in f.forward}
        good = {h: a[0] for h, a in answers.items() if not isinstance(a, str) and a}
        for host, ans in answers.items():
            if isinstance(ans, str) or not ans:
                out.append(Finding("names.peer", Status.FAIL, host, f"cannot resolve {name}: {ans}",
                                   f"add {name} to /etc/hosts or DNS on this node"))
                bad_hosts.add(host)
        if not good:
            continue
        common = majority(good, ctx.hosts)
        holders = fold(h for h in ctx.hosts if good.get(h) == common)
        for host, addr in good.items():
            if addr != common:
                out.append(Finding("names.peer", Status.FAIL, host,
                                   f"{name} resolves to {addr} here but {common} on {holders}",
                                   f"make /etc/hosts agree: `{common} {name}`"))
                bad_hosts.add(host)
            elif (_is_loopback(addr) and not ctx.one_machine
                  and _short(name) != _short(facts[host].self_name or host)):
                out.append(Finding("names.peer", Status.WARN, host,
                                   f"peer name {name} resolves to loopback {addr}: ranks on "
                                   "other nodes cannot reach it under that name",
                                   "use each node's routable name/address in the inventory"))
                bad_hosts.add(host)
        out += _reverse_findings(name, common, nodes, bad_hosts)
    for f in nodes:
        if f.host not in bad_hosts:
            out.append(Finding("names.peer", Status.PASS, f.host,
                               "peer names resolve consistently"))
    return out


def _reverse_findings(name: str, addr: str, nodes: Sequence[NodeFacts],
                      bad_hosts: set[str]) -> list[Finding]:
    out = []
    try:
        ipaddress.ip_address(name)
        return []  # given as an address: nothing to compare
    except ValueError:
        pass
    for f in nodes:
        back = f.reverse.get(addr)
        if back and _short(back) != _short(name):
            out.append(Finding("names.reverse", Status.WARN, f.host,
                               f"{addr} ({name}) reverse-resolves to {back}",
                               f"put `{addr} {name}` first for that address in /etc/hosts "
                               "(or fix the PTR record)"))
            bad_hosts.add(f.host)
    return out


def ifname_selected(spec: str, ifname: str) -> bool:
    """NCCL_SOCKET_IFNAME semantics: prefix list; ``=`` exact; ``^`` excludes."""
    text = spec.strip()
    exclude = text.startswith("^")
    text = text.removeprefix("^")
    exact = text.startswith("=")
    text = text.removeprefix("=")
    items = [p for p in text.split(",") if p]
    hit = any(ifname == p if exact else ifname.startswith(p) for p in items)
    return not hit if exclude else hit


def _route_ifaces(f: NodeFacts) -> dict[str, str | None]:
    own = {a for addrs in f.interfaces.values() for a in addrs}
    return {a: i for a, i in f.routes.items() if a not in own and not _is_loopback(a)}


# NCCL's own search without NCCL_SOCKET_IFNAME (ncclFindInterfaces), first hit wins:
# ib*, then every interface but docker*/lo, then docker*, then lo. Bridges (br-*,
# virbr*, cni*) are NOT skipped. The bootstrap takes the first match; the socket
# transport takes every match. Interfaces in kernel order (what `ip addr` lists).
NCCL_AUTO_SEARCH = ("ib", "^docker,lo", "docker", "lo")


def nccl_pick(f: NodeFacts) -> list[str]:
    """The interfaces NCCL would use on this node, its bootstrap's first."""
    names = [i for i, addrs in f.interfaces.items() if addrs]
    spec = f.env.get("NCCL_SOCKET_IFNAME")
    for rule in (spec,) if spec else NCCL_AUTO_SEARCH:
        hits = [i for i in names if ifname_selected(rule, i)]
        if hits:
            return hits
    return []


def gloo_pick(f: NodeFacts) -> tuple[str | None, str | None]:
    """(interface, address) gloo binds: GLOO_SOCKET_IFNAME, else its hostname's address."""
    spec = f.env.get("GLOO_SOCKET_IFNAME")
    if spec:
        name = spec.split(",")[0]
        return name, next(iter(f.interfaces.get(name, ())), None)
    addrs = f.forward.get(f.self_name or f.hostname or f.host)
    if isinstance(addrs, str) or not addrs:
        return None, None
    for ifname, own in f.interfaces.items():
        if addrs[0] in own:
            return ifname, addrs[0]
    return None, addrs[0]


def _nccl_prediction(f: NodeFacts, iface: str) -> list[Finding]:
    picks = nccl_pick(f)
    if f.env.get("NCCL_SOCKET_IFNAME") is not None or picks == [iface]:
        return []
    order = ", ".join(picks) or "none"
    if not picks or picks[0] != iface:
        detail = (f"NCCL_SOCKET_IFNAME unset: NCCL would pick {picks[0] if picks else 'nothing'}"
                  f" (its order: ib*, then every interface but docker*/lo as the kernel lists "
                  f"them: {order}), but {iface} is the interface that reaches every peer")
    else:
        detail = (f"NCCL_SOCKET_IFNAME unset: NCCL's socket transport would also use "
                  f"{', '.join(picks[1:])} besides {iface} (it takes every interface but "
                  f"docker*/lo)")
    return [Finding("net.ifname", Status.WARN, f.host, detail,
                    f"set NCCL_SOCKET_IFNAME=={iface} and GLOO_SOCKET_IFNAME={iface} "
                    "in the inventory env")]


def _gloo_prediction(f: NodeFacts, iface: str) -> list[Finding]:
    if f.env.get("GLOO_SOCKET_IFNAME") is not None:
        return []
    ifname, addr = gloo_pick(f)
    if ifname == iface or addr is None or _is_loopback(addr):
        return []  # unresolvable or loopback names: names.self already FAILs
    return [Finding("net.ifname", Status.WARN, f.host,
                    f"GLOO_SOCKET_IFNAME unset: gloo would bind {addr} "
                    f"({ifname or 'no local interface'}), the address of its hostname, but "
                    f"{iface} is the interface that reaches every peer",
                    f"set GLOO_SOCKET_IFNAME={iface} in the inventory env")]


def peer_iface(f: NodeFacts) -> str | None:
    """The one interface this node's routes to every peer use (None: none or several)."""
    used = {i for i in _route_ifaces(f).values()}
    return used.pop() if len(used) == 1 and None not in used else None


def _iface_env_findings(f: NodeFacts, iface: str) -> list[Finding]:
    out = []
    nccl = f.env.get("NCCL_SOCKET_IFNAME")
    gloo = f.env.get("GLOO_SOCKET_IFNAME")
    if nccl is not None and not ifname_selected(nccl, iface):
        out.append(Finding("net.ifname", Status.FAIL, f.host,
                           f"NCCL_SOCKET_IFNAME={nccl} does not select {iface}, the interface "
                           "that reaches the peers", f"NCCL_SOCKET_IFNAME=={iface}"))
    if gloo is not None and iface not in gloo.split(","):
        out.append(Finding("net.ifname", Status.FAIL, f.host,
                           f"GLOO_SOCKET_IFNAME={gloo} is not {iface}",
                           f"GLOO_SOCKET_IFNAME={iface}"))
    out += _nccl_prediction(f, iface) + _gloo_prediction(f, iface)
    if not out:
        out.append(Finding("net.ifname", Status.PASS, f.host,
                           f"NCCL/gloo will use {iface}"))
    return out


def check_interfaces(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out: list[Finding] = []
    chosen: dict[str, str] = {}
    for f in _ok(facts):
        routes = _route_ifaces(f)
        ifaces = sorted({i or "?" for i in routes.values()})
        if not routes:
            continue
        if len(ifaces) > 1:
            out.append(Finding("net.iface", Status.WARN, f.host,
                               f"peers are reached through different interfaces: "
                               f"{', '.join(ifaces)}",
                               "NCCL/gloo use one interface for all peers: fix routes or pick "
                               "one subnet for every node's address"))
            continue
        chosen[f.host] = ifaces[0]
        out.append(Finding("net.iface", Status.PASS, f.host, f"{ifaces[0]} reaches all peers"))
        out += _iface_env_findings(f, ifaces[0])
    if len(set(chosen.values())) > 1:
        by_iface = {i: fold(h for h in ctx.hosts if chosen.get(h) == i)
                    for i in sorted(set(chosen.values()))}
        listing = "; ".join(f"{i} on {hosts}" for i, hosts in by_iface.items())
        out.append(Finding("net.iface-names", Status.WARN, "",
                           f"interface names differ across nodes: {listing}",
                           f"NCCL_SOCKET_IFNAME=={','.join(by_iface)} (exact list) and a "
                           "per-node GLOO_SOCKET_IFNAME"))
    return out


def check_nccl_env(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in _ok(facts):
        out += _nccl_env_findings(f) or [Finding("nccl.env", Status.PASS, f.host,
                                                 "NCCL_* settings consistent with the node")]
        out += _ib_port_findings(f)
    return out


def _nccl_env_findings(f: NodeFacts) -> list[Finding]:
    out = []
    active = [p for p in f.ib_ports if p.active]
    if f.env.get("NCCL_IB_DISABLE", "0") not in ("0", "") and active:
        out.append(Finding("nccl.ib-disable", Status.WARN, f.host,
                           f"NCCL_IB_DISABLE={f.env['NCCL_IB_DISABLE']} while "
                           f"{len(active)} RDMA port(s) are ACTIVE: NCCL uses TCP sockets",
                           "unset NCCL_IB_DISABLE unless RDMA is known broken"))
    if f.env.get("NCCL_P2P_DISABLE", "0") not in ("0", ""):
        out.append(Finding("nccl.p2p-disable", Status.WARN, f.host,
                           f"NCCL_P2P_DISABLE={f.env['NCCL_P2P_DISABLE']}: intra-node "
                           "traffic goes through host memory",
                           "unset NCCL_P2P_DISABLE (only needed for broken P2P; check "
                           "`nvidia-smi topo -p2p r`)"))
    hca = f.env.get("NCCL_IB_HCA")
    if hca:
        spec = parse_nccl_ib_hca(hca)
        missing = [] if spec.exclude else unmatched_hca_entries(spec, f.ib_ports)
        if missing:
            have = ", ".join(p.name for p in f.ib_ports) or "none"
            out.append(Finding("nccl.ib-hca", Status.FAIL, f.host,
                               f"NCCL_IB_HCA={hca} names {', '.join(missing)}, which do not "
                               f"exist (ports: {have})",
                               "list existing devices, e.g. "
                               f"NCCL_IB_HCA=={','.join(p.name for p in active) or 'mlx5_0:1'}"))
    return out


def _ib_port_findings(f: NodeFacts) -> list[Finding]:
    if not f.ib_ports:
        return []
    active = [p for p in f.ib_ports if p.active]
    down = [p for p in f.ib_ports if not p.active]
    out = []
    if not active:
        return [Finding("rdma.ports", Status.WARN, f.host,
                        f"{len(f.ib_ports)} RDMA port(s), none ACTIVE: NCCL falls back to TCP",
                        "check cables/switch and the subnet manager (`ibstat`, opensm) or "
                        "RoCE config")]
    kinds = Counter("RoCE" if p.is_roce else "IB" for p in active)
    out.append(Finding("rdma.ports", Status.PASS, f.host, f"{len(active)} RDMA port(s) ACTIVE ("
                       + ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) + ")"))
    if down:
        names = ", ".join(f"{p.name} {p.state}" + (f"/{p.phys_state}" if p.phys_state else "")
                          for p in down)
        out.append(Finding("rdma.down", Status.WARN, f.host, f"RDMA port(s) not ACTIVE: {names}",
                           "fix the link if it should carry traffic, else exclude it with "
                           "NCCL_IB_HCA"))
    return out


# ----------------------------------------------------------------------------- ports (two-phase)


def check_master_port(master: str, port: int, listen: Mapping[str, Any] | None,
                      connects: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    """Phase 1: ``listen`` result on the master; phase 2: each node's ``connect`` result."""
    check = f"port:{port}"
    if listen is None or not listen.get("bound"):
        err = (listen or {}).get("error", "listener did not start")
        return [Finding(check, Status.FAIL, master, f"cannot listen on {port}: {err}",
                        f"pick another --master-port, or find the owner: "
                        f"`ss -ltnp 'sport = :{port}'`")]
    out = [Finding(check, Status.PASS, master, f"port {port} free on the master")]
    fixes = {
        "refused": "nothing listened where the name points: check the master's name/address",
        "timeout": f"a firewall drops the traffic: open TCP {port} (and the NCCL/gloo ports) "
                   "between nodes",
        "resolve": "the master's name does not resolve here: add it to /etc/hosts",
        "unreachable": "no route to the master: check addresses/subnets",
    }
    for host, res in connects.items():
        if res.get("ok"):
            out.append(Finding(check, Status.PASS, host, f"reaches {master}:{port}"))
        else:
            kind = str(res.get("error_kind") or "unreachable")
            out.append(Finding(check, Status.FAIL, host,
                               f"cannot reach {master}:{port} ({kind}: {res.get('error')})",
                               fixes.get(kind, fixes["unreachable"])))
    return out


# ----------------------------------------------------------------------------- all


ALL_RULES: tuple[Rule, ...] = (
    check_probe, check_interpreter, check_versions, check_freeze, check_workdir,
    check_ninja, check_cuda, check_pdsh, check_gpus, check_topology, check_storage,
    check_limits, check_clock, check_own_name, check_peer_names, check_interfaces,
    check_nccl_env,
)


def run_rules(facts: Mapping[str, NodeFacts], ctx: DoctorContext,
              rules: Sequence[Rule] = ALL_RULES) -> list[Finding]:
    out: list[Finding] = []
    for rule in rules:
        out += rule(facts, ctx)
    return out
