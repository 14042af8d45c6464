"""Typed view of one node's probe JSON (:class:`NodeFacts`), built without any I/O.

The probe's JSON may come from an older/newer probe or be partly broken; every
accessor here tolerates missing keys and records what it could not parse in
``parse_errors`` (the rules report those instead of crashing).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterkit.checks.gpu_topology import (
    GpuInfo,
    P2PMatrix,
    TopoMatrix,
    TopoParseError,
    parse_p2p,
    parse_query_gpu,
    parse_topo_matrix,
)
from clusterkit.checks.infiniband import IBPort, parse_ibstat, parse_ibv_devinfo, ports_from_sysfs


@dataclass(frozen=True)
class StorageFacts:
    path: str
    exists: bool
    writable: bool
    free_bytes: int | None
    total_bytes: int | None


@dataclass(frozen=True)
class NodeFacts:
    host: str  # inventory name
    probe_error: str | None = None  # the probe could not run / answer at all
    error_kind: str | None = None  # TransportError kind (refused, timeout, auth, hostkey-*, ...)
    error_hint: str | None = None  # the transport's own advice for that failure
    hostname: str | None = None
    time: float | None = None
    python_executable: str | None = None
    python_version: str | None = None
    workdir: str | None = None
    workdir_exists: bool | None = None
    workdir_writable: bool | None = None
    versions: Mapping[str, str | None] = field(default_factory=dict)
    torch_cuda: str | None = None
    nccl_version: str | None = None
    freeze: tuple[str, ...] = ()
    freeze_sha256: str | None = None
    tools: Mapping[str, str | None] = field(default_factory=dict)
    cuda_home: str | None = None
    cuda_home_exists: bool | None = None
    nvcc: str | None = None
    libcudart: str | None = None
    nvidia_smi: str | None = None
    gpus: tuple[GpuInfo, ...] | None = None  # None: unknown (no nvidia-smi or it failed)
    gpu_error: str | None = None
    topo: TopoMatrix | None = None
    p2p: P2PMatrix | None = None
    ib_ports: tuple[IBPort, ...] = ()
    storage: tuple[StorageFacts, ...] = ()
    shm_total_bytes: int | None = None
    nofile_soft: int | None = None
    forward: Mapping[str, tuple[str, ...] | str] = field(default_factory=dict)  # name -> addrs|err
    reverse: Mapping[str, str | None] = field(default_factory=dict)  # addr -> name
    self_name: str | None = None
    interfaces: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # ifname -> ipv4s
    routes: Mapping[str, str | None] = field(default_factory=dict)  # peer addr -> ifname
    env: Mapping[str, str] = field(default_factory=dict)
    section_errors: Mapping[str, str] = field(default_factory=dict)
    parse_errors: Mapping[str, str] = field(default_factory=dict)
    probe_ms: float | None = None
    heavy_modules: tuple[str, ...] = ()
    # clusterkit importable on the node (only the bundled workload needs it) and its
    # source digest: the same digest as the launcher's means the same code.
    clusterkit_version: str | None = None
    clusterkit_digest: str | None = None
    # `clusterkit nodes env`'s record of this interpreter's environment (node/facts/envfacts.py
    # env_state: prefix, digest, stale, groups, changed) and DeepSpeed's JIT build locks
    # (node/provision/jitops.py locks: path, age_s, holders).
    env_state: Mapping[str, Any] = field(default_factory=dict)
    jit_locks: tuple[Mapping[str, Any], ...] = ()

    @property
    def ok(self) -> bool:
        return self.probe_error is None

    @property
    def gpu_count(self) -> int | None:
        return None if self.gpus is None else len(self.gpus)

    @property
    def driver_version(self) -> str | None:
        return self.gpus[0].driver_version if self.gpus else None


def unreachable(host: str, error: str, kind: str | None = None,
                hint: str | None = None) -> NodeFacts:
    """Facts for a node whose probe never answered (SSH failure, timeout, bad interpreter)."""
    return NodeFacts(host=host, probe_error=error, error_kind=kind, error_hint=hint)


def _d(obj: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _s(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _i(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _nccl_from_lib(path: str | None) -> str | None:
    m = re.search(r"libnccl\.so\.(\d+\.\d+\.\d+)", path or "")
    return m.group(1) if m else None


def from_probe_json(host: str, data: Mapping[str, Any]) -> NodeFacts:
    """Build :class:`NodeFacts` from the probe's ``facts`` JSON object."""
    if "fatal" in data:
        return unreachable(host, f"probe crashed: {data['fatal']}", "probe")
    parse_errors: dict[str, str] = {}
    gpus, gpu_error, topo, p2p = _gpu(_d(data, "gpu") or {}, parse_errors)
    pkgs = _d(data, "packages") or {}
    versions = _d(pkgs, "versions") or {}
    storage = tuple(
        StorageFacts(str(r.get("path")), bool(r.get("exists")), bool(r.get("writable")),
                     _i(r.get("free_bytes")), _i(r.get("total_bytes")))
        for r in (_d(data, "storage") or []) if isinstance(r, Mapping))
    return NodeFacts(
        host=host,
        hostname=_s(_d(data, "host", "hostname")),
        time=_d(data, "host", "time") if isinstance(_d(data, "host", "time"), float) else None,
        python_executable=_s(_d(data, "python", "executable")),
        python_version=_s(_d(data, "python", "version")),
        workdir=_s(_d(data, "workdir", "path")),
        workdir_exists=_d(data, "workdir", "exists"),
        workdir_writable=_d(data, "workdir", "writable"),
        versions={str(k): _s(v) for k, v in versions.items()},
        torch_cuda=_s(_d(data, "torch_build", "cuda")),
        nccl_version=_s(_d(pkgs, "nvidia_nccl_dist"))
        or _nccl_from_lib(_s(_d(data, "torch_build", "lib_nccl"))),
        freeze=tuple(str(x) for x in (_d(pkgs, "freeze", "items") or [])),
        freeze_sha256=_s(_d(pkgs, "freeze", "sha256")),
        tools={str(k): _s(v) for k, v in (_d(data, "tools") or {}).items()},
        cuda_home=_s(_d(data, "cuda", "cuda_home")),
        cuda_home_exists=_d(data, "cuda", "cuda_home_exists"),
        nvcc=_s(_d(data, "cuda", "nvcc")),
        libcudart=_s(_d(data, "cuda", "libcudart")),
        nvidia_smi=_s(_d(data, "gpu", "nvidia_smi")),
        gpus=gpus, gpu_error=gpu_error, topo=topo, p2p=p2p,
        ib_ports=_ib_ports(_d(data, "ib") or {}, parse_errors),
        storage=storage,
        shm_total_bytes=_i(_d(data, "shm", "total_bytes")),
        nofile_soft=_i(_d(data, "limits", "nofile_soft")),
        self_name=_s(_d(data, "names", "self")),
        forward=_forward(_d(data, "names", "forward") or {}),
        reverse={str(a): _s(_d(r, "name")) for a, r in (_d(data, "names", "reverse") or {}).items()},
        interfaces={str(i.get("name")): tuple(i.get("ipv4") or ())
                    for i in (_d(data, "interfaces") or []) if isinstance(i, Mapping)},
        routes={str(a): _s(_d(r, "ifname")) for a, r in (_d(data, "routes") or {}).items()},
        env={str(k): str(v) for k, v in (_d(data, "env") or {}).items()},
        section_errors={str(k): str(v) for k, v in (_d(data, "errors") or {}).items()},
        parse_errors=parse_errors,
        probe_ms=_d(data, "probe", "elapsed_ms"),
        heavy_modules=tuple(_d(data, "probe", "heavy_modules_imported") or ()),
        clusterkit_version=_s(_d(data, "clusterkit", "version")),
        clusterkit_digest=_s(_d(data, "clusterkit", "digest")),
        env_state=_d(data, "envstate", "env") or {},
        jit_locks=tuple(lk for lk in (_d(data, "envstate", "jit_locks") or [])
                        if isinstance(lk, Mapping)),
    )


def _forward(raw: Mapping[str, Any]) -> dict[str, tuple[str, ...] | str]:
    out: dict[str, tuple[str, ...] | str] = {}
    for name, r in raw.items():
        if isinstance(_d(r, "addresses"), list):
            out[str(name)] = tuple(str(a) for a in r["addresses"])
        else:
            out[str(name)] = str(_d(r, "error") or "unresolved")
    return out


def _cmd_output(res: Any, what: str) -> tuple[str | None, str | None]:
    """(stdout, error) of one probe command result."""
    if not isinstance(res, Mapping):
        return None, None
    if res.get("error"):
        return None, f"{what}: {res['error']}"
    if res.get("rc") != 0:
        first = (str(res.get("stdout") or "") + str(res.get("stderr") or "")).strip()
        return None, f"{what} exited {res.get('rc')}: {first.splitlines()[0] if first else ''}"
    return str(res.get("stdout") or ""), None


def _gpu(raw: Mapping[str, Any], errs: dict[str, str]
         ) -> tuple[tuple[GpuInfo, ...] | None, str | None, TopoMatrix | None, P2PMatrix | None]:
    if not raw.get("nvidia_smi"):
        return None, None, None, None
    out, error = _cmd_output(raw.get("query"), "nvidia-smi --query-gpu")
    gpus: tuple[GpuInfo, ...] | None = None
    if out is not None:
        try:
            gpus = tuple(parse_query_gpu(out))
        except TopoParseError as exc:
            error = f"nvidia-smi --query-gpu: {exc}"
    topo = p2p = None
    topo_out, topo_err = _cmd_output(raw.get("topo"), "nvidia-smi topo -m")
    if topo_out and gpus:
        try:
            topo = parse_topo_matrix(topo_out)
        except TopoParseError as exc:
            errs["topo"] = str(exc)
    elif topo_err:
        errs["topo"] = topo_err
    p2p_out, _ = _cmd_output(raw.get("p2p"), "nvidia-smi topo -p2p n")
    if p2p_out and gpus and len(gpus) > 1:
        try:
            p2p = parse_p2p(p2p_out)
        except TopoParseError as exc:
            errs["p2p"] = str(exc)
    return gpus, error, topo, p2p


def _ib_ports(raw: Mapping[str, Any], errs: dict[str, str]) -> tuple[IBPort, ...]:
    # Prefer sysfs (no tool needed), then ibv_devinfo (rdma-core), then ibstat.
    sysfs = raw.get("sysfs")
    if isinstance(sysfs, list) and sysfs:
        return tuple(ports_from_sysfs(r for r in sysfs if isinstance(r, Mapping)))
    for key, parser in (("ibv_devinfo", parse_ibv_devinfo), ("ibstat", parse_ibstat)):
        out, err = _cmd_output(raw.get(key), key)
        if out:
            return tuple(parser(out))
        if err:
            errs[key] = err
    return ()
