"""The remote probe of ``clusterkit doctor``: one self-contained, stdlib-only script.

This file is shipped as **stdin** to the interpreter named in the inventory and
run there as ``<python> - <mode> [args]``; it must therefore import nothing from
clusterkit, nothing outside the standard library, and never ``import torch``
(doctor has to stay fast: importing torch + deepspeed costs seconds per node).
Facts are read from package metadata and files instead.

Modes (argv selects; every mode prints JSON lines on stdout and exits 0 — a
failure is reported as data, never as a traceback):

``facts [--workdir P] [--ckpt-dir P]... [--peer NAME_OR_ADDR]... [--master H:P [--master-wait S]]``
    One JSON object with every fact the rules need (schema: ``SCHEMA_VERSION``,
    documented in docs/doctor.md). Each section catches its own exceptions and
    records them under ``errors[section]``.
``listen PORT SECONDS [--bind ADDR]``
    Bind PORT, print ``{"event": "ready", ...}`` (or an error), accept
    connections for SECONDS, then print the summary (the LAST line is the
    result): how many connected and which probe hosts said hello.
``connect HOST PORT [--timeout S]``
    Try one TCP connection, say hello, print ``{"ok": ..., "error_kind": ...}``.

Python >= 3.7 on the remote side: no ``match``, no walrus, annotations are strings.

One file because: the probe is also run by hand, copied alone to a node, when doctor
cannot read its answer (docs/doctor.md, kind ``probe``); every mode must then work
from this file, so its imports of the shipped node modules (sitepaths, parity,
gatefacts) are optional and only add facts.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import resource
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Dict  # noqa: UP035 - see JSON below

SCHEMA_VERSION = 1
TOOLS = ("ninja", "pdsh", "nvidia-smi", "ibstat", "ibv_devinfo", "nvcc", "ip")
ENV_PREFIXES = ("NCCL_", "GLOO_", "TP_SOCKET_", "UCX_", "CUDA_", "TORCH_", "MASTER_")
ENV_NAMES = ("PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PDSH_RCMD_TYPE")
# Modules whose presence in sys.modules means the probe got slow by accident.
HEAVY_MODULES = ("torch", "deepspeed", "numpy", "accelerate", "transformers")
CMD_TIMEOUT_S = 15.0  # `nvidia-smi topo -m` has been seen taking minutes (NCCL#557)
RESOLVE_TIMEOUT_S = 5.0
HELLO = b"clusterkit-probe "
DONE_HELLO = "!done"  # a connect with this hello ends a listener early (doctor's phase end)
# Tests only: one namespace node cannot have its own clock, so the fault-injection
# tests shift the time the probe reports instead (documented in docs/doctor.md).
CLOCK_OFFSET_ENV = "CLUSTERKIT_PROBE_CLOCK_OFFSET_S"

# typing.Dict, not dict[...]: this file must also run on a Python 3.8 node.
JSON = Dict[str, Any]  # noqa: UP006


# ----------------------------------------------------------------------------- helpers


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _run(argv: Sequence[str], timeout: float = CMD_TIMEOUT_S) -> JSON:
    """Run a local command; output and failure are both data."""
    try:
        proc = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"rc": None, "stdout": "", "stderr": "", "error": f"timeout after {timeout:.0f}s"}
    except OSError as exc:
        return {"rc": None, "stdout": "", "stderr": "", "error": _err(exc)}
    return {
        "rc": proc.returncode,
        "stdout": proc.stdout.decode("utf-8", "replace"),
        "stderr": proc.stderr.decode("utf-8", "replace")[-2000:],
        "error": None,
    }


def _writable_dir(path: str) -> bool:
    # os.access lies on root-squashed NFS; creating a file is the real test.
    try:
        fd, tmp = _mkstemp_in(path)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return True


def _mkstemp_in(path: str) -> tuple[int, str]:
    import tempfile  # local: only needed here, keeps startup lean

    return tempfile.mkstemp(prefix=".clusterkit-probe-", dir=path)


def _nearest_existing(path: str) -> str:
    cur = os.path.abspath(path)
    while not os.path.exists(cur):
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    return cur


# ----------------------------------------------------------------------------- sections


def section_host() -> JSON:
    uname = os.uname()
    return {
        "hostname": socket.gethostname(),
        "kernel": uname.release,
        "machine": uname.machine,
        "time": time.time() + _clock_offset(),
        "pid": os.getpid(),
        "user": os.environ.get("USER") or os.environ.get("LOGNAME"),
        "cwd": os.getcwd(),
    }


def _clock_offset() -> float:
    try:
        return float(os.environ.get(CLOCK_OFFSET_ENV, "0") or 0)
    except ValueError:
        return 0.0


def section_python() -> JSON:
    return {
        "executable": sys.executable,
        "realpath": os.path.realpath(sys.executable) if sys.executable else None,
        "version": ".".join(str(p) for p in sys.version_info[:3]),
        "implementation": sys.implementation.name,
        "prefix": sys.prefix,
        "base_prefix": sys.base_prefix,
    }


def section_workdir(path: str | None) -> JSON:
    if not path:
        return {"path": None}
    exists = os.path.isdir(path)
    return {"path": path, "exists": exists, "writable": exists and _writable_dir(path)}


_DISTS: dict[str, tuple[str, str]] | None = None


def _site_paths() -> None:
    """Shipped under ``python -S``: the site directories, as a normal start has them."""
    try:
        from clusterkit.node.facts import sitepaths
    except ImportError:  # a probe copied by hand runs with site already
        return
    sitepaths.add()


def _key_packages() -> tuple[str, ...]:
    """The packages doctor compares across nodes (node/facts/parity.py's table, shipped
    beside the probe); a probe copied by hand, run for its errors, reads none."""
    try:
        from clusterkit.node.facts.parity import packages
    except ImportError:
        return ()
    return packages()


def _distributions() -> dict[str, tuple[str, str]]:
    """:func:`_scan_distributions`, once per run (packages and clusterkit both need it)."""
    global _DISTS
    if _DISTS is None:
        _DISTS = _scan_distributions()
    return _DISTS


def _scan_distributions() -> dict[str, tuple[str, str]]:
    """name(normalized) -> (version, location), first on sys.path wins like import.

    Reading directory names instead of every METADATA file keeps this at a few ms
    for hundreds of packages (what `pip freeze` spends most of its time on). The
    few key packages (:func:`_key_packages`) get their version from METADATA, which is authoritative (a
    dist-info directory can be renamed or copied; the metadata is what pip wrote).
    """
    found: dict[str, tuple[str, str]] = {}
    dirs: dict[str, str] = {}
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for name in sorted(names):
            parsed = _parse_dist_dirname(name)
            if parsed is None:
                continue
            key, version = parsed
            if key not in found:
                found[key] = (version, entry)
                dirs[key] = os.path.join(entry, name)
    for key in _key_packages():
        if key in found:
            meta = _metadata_version(dirs[key])
            if meta:
                found[key] = (meta, found[key][1])
    return found


def _metadata_version(dist_dir: str) -> str | None:
    """``Version:`` from a dist-info METADATA / egg-info PKG-INFO header (None if unreadable)."""
    for fname in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(dist_dir, fname), encoding="utf-8", errors="replace") as fh:
                for _ in range(64):  # the header comes first; never read a long description
                    line = fh.readline()
                    if not line or not line.strip():
                        break
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip() or None
        except OSError:
            continue
    return None


_DIST_RE = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._]*?)-(?P<ver>[0-9][^-]*?)"
    r"(-py[0-9.]+)?(-[^-]+)?\.(dist-info|egg-info)$"
)


def _parse_dist_dirname(dirname: str) -> tuple[str, str] | None:
    m = _DIST_RE.match(dirname)
    if m is None:
        return None
    return _normalize(m.group("name")), m.group("ver")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def section_clusterkit() -> JSON:
    """The clusterkit importable here (version, source digest), for parity with the launcher.

    From the shipped gatefacts module; a probe copied by hand has none: empty.
    """
    try:
        from clusterkit.node.facts.gatefacts import clusterkit_facts
    except ImportError:
        return {}
    # The version from the dist-info directory name (as `packages`): importing
    # importlib.metadata for it cost ~50 ms of the probe's CPU.
    dists = _distributions()
    found = clusterkit_facts(lambda name: dists[name][0] if name in dists else None)
    return {"version": found["clusterkit"], "digest": found["clusterkit_digest"]}


def section_packages() -> JSON:
    dists = _distributions()
    items = sorted(f"{name}=={ver}" for name, (ver, _loc) in dists.items())
    digest = hashlib.sha256("\n".join(items).encode()).hexdigest()
    key = {name: (dists[name][0] if name in dists else None) for name in _key_packages()}
    nccl = None
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        if name in dists:
            nccl = dists[name][0]
            break
    torch_loc = dists["torch"][1] if "torch" in dists else None
    return {
        "versions": key,
        "freeze": {"sha256": digest, "count": len(items), "items": items},
        "nvidia_nccl_dist": nccl,
        "torch_location": torch_loc,
    }


_TORCH_VERSION_KEYS = ("__version__", "cuda", "git_version", "hip", "debug")


def section_torch_build(torch_location: str | None) -> JSON:
    """torch/version.py is a generated text file: read it, never import torch."""
    if not torch_location:
        return {"present": False}
    path = os.path.join(torch_location, "torch", "version.py")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    out: JSON = {"present": True, "version_py": path}
    for key in _TORCH_VERSION_KEYS:
        m = re.search(rf"^{re.escape(key)}\s*(?::[^=]*)?=\s*(.+?)\s*$", text, re.MULTILINE)
        out[key.strip("_")] = _literal(m.group(1)) if m else None
    lib = os.path.join(torch_location, "torch", "lib")
    out["lib_dir"] = lib if os.path.isdir(lib) else None
    out["lib_nccl"] = _first_match(lib, "libnccl.so") if out["lib_dir"] else None
    return out


def _literal(src: str) -> Any:
    import ast  # local: cheap, only when torch exists

    try:
        return ast.literal_eval(src)
    except (ValueError, SyntaxError):
        return src


def _first_match(directory: str | None, prefix: str) -> str | None:
    if not directory or not os.path.isdir(directory):
        return None
    try:
        for name in sorted(os.listdir(directory)):
            if name.startswith(prefix):
                return os.path.join(directory, name)
    except OSError:
        return None
    return None


def section_envstate() -> JSON:
    """`clusterkit nodes env`'s record of this environment, what changed since, and
    DeepSpeed's JIT build locks (node/facts/envfacts.py, node/provision/jitops.py, shipped beside the
    probe; a probe copied by hand has neither and reports nothing here)."""
    try:
        from clusterkit.node.facts import envfacts
        from clusterkit.node.provision import jitops
    except ImportError:
        return {}
    return {"env": envfacts.env_state(sys.prefix, changes=True), "jit_locks": jitops.settled()}


def section_tools() -> JSON:
    return {name: shutil.which(name) for name in TOOLS}


def section_cuda(torch_location: str | None) -> JSON:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates: list[tuple[str, str]] = []  # (source, directory)
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if d:
            candidates.append(("LD_LIBRARY_PATH", d))
    if cuda_home:
        candidates += [("CUDA_HOME", os.path.join(cuda_home, "lib64")),
                       ("CUDA_HOME", os.path.join(cuda_home, "lib"))]
    if torch_location:
        candidates.append(("torch/lib", os.path.join(torch_location, "torch", "lib")))
        candidates.append(("nvidia-cuda-runtime", os.path.join(
            torch_location, "nvidia", "cuda_runtime", "lib")))
    candidates.append(("/usr/local/cuda", "/usr/local/cuda/lib64"))
    cudart = source = None
    for src, d in candidates:
        hit = _first_match(d, "libcudart.so")
        if hit:
            cudart, source = hit, src
            break
    if cudart is None:
        cudart = _ldconfig_lookup("libcudart.so")
        source = "ldconfig" if cudart else None
    nvcc = shutil.which("nvcc")
    if nvcc is None and cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
    return {
        "cuda_home": cuda_home,
        "cuda_home_exists": bool(cuda_home) and os.path.isdir(cuda_home or ""),
        "nvcc": nvcc,
        "libcudart": cudart,
        "libcudart_source": source,
    }


def _ldconfig_lookup(prefix: str) -> str | None:
    # ctypes.util.find_library would fall back to running gcc (slow); ldconfig -p is enough.
    exe = shutil.which("ldconfig") or "/sbin/ldconfig"
    if not os.path.exists(exe):
        return None
    res = _run([exe, "-p"], timeout=5.0)
    for line in res["stdout"].splitlines():
        line = line.strip()
        if line.startswith(prefix) and "=>" in line:
            return str(line.split("=>", 1)[1].strip())
    return None


def section_gpu(tools: JSON) -> JSON:
    smi = tools.get("nvidia-smi")
    if not smi:
        return {"nvidia_smi": None}
    jobs = {
        "query": [smi, "--query-gpu=index,name,driver_version,memory.total",
                  "--format=csv,noheader"],
        "topo": [smi, "topo", "-m"],
        "p2p": [smi, "topo", "-p2p", "n"],
    }
    calls: dict[str, Callable[[], Any]] = {k: _bind_run(argv) for k, argv in jobs.items()}
    results = _parallel(calls, CMD_TIMEOUT_S + 2)
    return {"nvidia_smi": smi, **results}


def _bind_run(argv: list[str]) -> Callable[[], JSON]:
    return lambda: _run(argv)


def section_ib(tools: JSON) -> JSON:
    jobs: dict[str, Callable[[], Any]] = {"sysfs": _sysfs_infiniband}
    if tools.get("ibstat"):
        jobs["ibstat"] = lambda: _run([tools["ibstat"]])
    if tools.get("ibv_devinfo"):
        jobs["ibv_devinfo"] = lambda: _run([tools["ibv_devinfo"]])
    return _parallel(jobs, CMD_TIMEOUT_S + 2)


def _sysfs_infiniband() -> list[JSON]:
    """Port state straight from sysfs: works even without infiniband-diags installed."""
    base = "/sys/class/infiniband"
    ports: list[JSON] = []
    if not os.path.isdir(base):
        return ports
    for dev in sorted(os.listdir(base)):
        pdir = os.path.join(base, dev, "ports")
        if not os.path.isdir(pdir):
            continue
        for port in sorted(os.listdir(pdir)):
            row: JSON = {"device": dev, "port": port}
            for attr in ("state", "phys_state", "link_layer", "rate"):
                try:
                    with open(os.path.join(pdir, port, attr), encoding="utf-8") as fh:
                        row[attr] = fh.read().strip()
                except OSError:
                    row[attr] = None
            ports.append(row)
    return ports


def section_storage(paths: Sequence[str]) -> list[JSON]:
    out: list[JSON] = []
    for path in paths:
        row: JSON = {"path": path, "exists": os.path.isdir(path)}
        probe_at = path if row["exists"] else _nearest_existing(path)
        row["measured_at"] = probe_at
        try:
            st = os.statvfs(probe_at)
            row["free_bytes"] = st.f_bavail * st.f_frsize
            row["total_bytes"] = st.f_blocks * st.f_frsize
        except OSError as exc:
            row["error"] = _err(exc)
        row["writable"] = _writable_dir(probe_at)
        out.append(row)
    return out


def section_shm() -> JSON:
    st = os.statvfs("/dev/shm")
    return {"path": "/dev/shm", "total_bytes": st.f_blocks * st.f_frsize,
            "free_bytes": st.f_bavail * st.f_frsize}


def section_limits() -> JSON:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    return {"nofile_soft": None if soft == inf else soft,
            "nofile_hard": None if hard == inf else hard}


def section_env() -> JSON:
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def _resolve(name: str) -> JSON:
    infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    addrs: list[str] = []
    for _fam, _t, _p, _c, sockaddr in infos:
        addr = str(sockaddr[0])
        if addr not in addrs:
            addrs.append(addr)
    return {"addresses": addrs}


def _reverse(addr: str) -> JSON:
    host, aliases, _ = socket.gethostbyaddr(addr)
    return {"name": host, "aliases": list(aliases)}


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # every failure is data here
        return {"error": _err(exc)}


# Name lookups are I/O waits; a few threads overlap them. One thread per peer (256 at
# 128 nodes) cost ~45 ms of CPU per node in thread start-up alone.
PARALLEL_WORKERS = 16


def _parallel(jobs: dict[str, Callable[[], Any]], timeout: float) -> JSON:
    """Run jobs on up to PARALLEL_WORKERS daemon threads; a job not finished at the
    deadline (running or still queued) is reported, not awaited.

    Daemon threads matter: a getaddrinfo stuck on a dead DNS server cannot be
    cancelled, and the probe must still answer (and exit) in time.
    """
    results: JSON = {}
    queue = iter(list(jobs.items()))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                item = next(queue, None)
            if item is None:
                return
            results[item[0]] = _safe(item[1])

    threads = [threading.Thread(target=worker, daemon=True)
               for _ in range(min(PARALLEL_WORKERS, len(jobs)))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out = dict(results)
    for key in jobs:
        if key not in out:
            out[key] = {"error": f"timeout after {timeout:.0f}s"}
    return out


def _bind(fn: Callable[[str], JSON], arg: str) -> Callable[[], JSON]:
    return lambda: fn(arg)


def section_names(peers: Sequence[str]) -> JSON:
    own = socket.gethostname()
    names = [own, *[p for p in peers if p != own]]
    forward = _parallel({n: _bind(_resolve, n) for n in names}, RESOLVE_TIMEOUT_S)
    addrs = sorted({a for r in forward.values() for a in r.get("addresses", [])})
    reverse = _parallel({a: _bind(_reverse, a) for a in addrs}, RESOLVE_TIMEOUT_S)
    return {"self": own, "forward": forward, "reverse": reverse}


def section_interfaces(tools: JSON) -> list[JSON]:
    if tools.get("ip"):
        res = _run([tools["ip"], "-j", "-4", "addr", "show"], timeout=5.0)
        if res["rc"] == 0:
            rows = []
            for item in json.loads(res["stdout"] or "[]"):
                rows.append({
                    "name": item.get("ifname"),
                    "up": "UP" in (item.get("flags") or []),
                    "ipv4": [a.get("local") for a in item.get("addr_info", []) if a.get("local")],
                })
            return rows
    return _interfaces_ioctl()


def _interfaces_ioctl() -> list[JSON]:
    import fcntl
    import struct

    rows = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _idx, name in socket.if_nameindex():
            packed = struct.pack("256s", name.encode()[:15])
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, packed)  # SIOCGIFADDR
                addrs = [socket.inet_ntoa(raw[20:24])]
            except OSError:
                addrs = []
            rows.append({"name": name, "up": None, "ipv4": addrs})
    return rows


def section_routes(peer_addrs: Sequence[str], interfaces: Sequence[JSON]) -> JSON:
    """Which local address/interface the kernel would use to reach each peer.

    A UDP connect() sends nothing; it only asks the routing table for a source.
    """
    by_addr = {a: i["name"] for i in interfaces for a in i.get("ipv4", [])}
    out: JSON = {}
    for addr in peer_addrs:
        if ":" in addr:
            continue  # IPv4 only for now: NCCL/gloo interface selection is what matters
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((addr, 9))
                src = s.getsockname()[0]
            out[addr] = {"src": src, "ifname": by_addr.get(src)}
        except OSError as exc:
            out[addr] = {"error": _err(exc)}
    return out


# ----------------------------------------------------------------------------- modes


def collect_facts(workdir: str | None, ckpt_dirs: Sequence[str], peers: Sequence[str],
                  master: str | None = None, master_wait: float = 0.0) -> JSON:
    t0 = time.perf_counter()
    _site_paths()  # before "python" (a venv's prefix) and "packages" (site-packages)
    facts: JSON = {"schema": SCHEMA_VERSION, "mode": "facts"}
    errors: dict[str, str] = {}

    def sect(name: str, fn: Callable[[], Any], default: Any = None) -> Any:
        try:
            value = fn()
        except Exception as exc:  # one broken section must not hide the rest
            errors[name] = _err(exc)
            value = default
        facts[name] = value
        return value

    sect("host", section_host, {})
    sect("python", section_python, {})
    sect("workdir", lambda: section_workdir(workdir), {})
    pkgs = sect("packages", section_packages, {})
    torch_loc = (pkgs or {}).get("torch_location")
    sect("torch_build", lambda: section_torch_build(torch_loc), {"present": None})
    tools = sect("tools", section_tools, {}) or {}
    sect("cuda", lambda: section_cuda(torch_loc), {})
    sect("storage", lambda: section_storage(ckpt_dirs), [])
    sect("shm", section_shm, {})
    sect("limits", section_limits, {})
    sect("env", section_env, {})
    sect("clusterkit", section_clusterkit, {})
    sect("envstate", section_envstate, {})
    # The slow, I/O-bound sections run side by side.
    slow = _parallel({
        "gpu": lambda: section_gpu(tools),
        "ib": lambda: section_ib(tools),
        "names": lambda: section_names(peers),
        "interfaces": lambda: section_interfaces(tools),
    }, CMD_TIMEOUT_S + RESOLVE_TIMEOUT_S + 5)
    for key, value in slow.items():
        if isinstance(value, dict) and set(value) == {"error"}:
            errors[key] = value["error"]
            facts[key] = None
        else:
            facts[key] = value
    peer_addrs = sorted({a for n, r in ((facts.get("names") or {}).get("forward") or {}).items()
                         if n != (facts.get("names") or {}).get("self")
                         for a in (r or {}).get("addresses", [])})
    sect("routes", lambda: section_routes(peer_addrs, facts.get("interfaces") or []), {})
    if master:
        host, _, port = master.rpartition(":")
        sect("master_port", lambda: connect_with_retry(host, int(port), 3.0, master_wait), {})
    facts["errors"] = errors
    facts["probe"] = {
        "elapsed_ms": round((time.perf_counter() - t0) * 1000, 1),
        "heavy_modules_imported": sorted(m for m in HEAVY_MODULES if m in sys.modules),
    }
    return facts


def do_listen(port: int, seconds: float, bind: str, expect: int = 0) -> list[JSON]:
    """Accept for ``seconds``, until ``expect`` hellos arrived (0: no limit), until a
    ``!done`` hello, or until our stdout is closed (the caller closed the SSH channel).

    Every hello is also printed at once as ``{"event": "hello"}``, so the caller can
    read the arrivals and just close the channel instead of waiting for the result.
    """
    lines: list[JSON] = []
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Same as torch's TCPStore: TIME_WAIT leftovers must not read as "port busy".
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind((bind, port))
        srv.listen(1024)
    except OSError as exc:
        srv.close()
        return [{"mode": "listen", "event": "result", "bound": False, "port": port,
                 "error": _err(exc), "errno": exc.errno, "accepted": 0, "hellos": []}]
    accepted, hellos = 0, []
    try:
        _emit({"mode": "listen", "event": "ready", "port": port, "bind": bind})
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not _stdout_closed():
            ready, _, _ = select.select([srv], [], [], min(0.2, deadline - time.monotonic()))
            if not ready:
                continue
            conn, peer = srv.accept()
            hello = _read_hello(conn)
            if hello == DONE_HELLO:
                break
            accepted += 1
            hellos.append({"addr": peer[0], "hello": hello})
            _emit({"mode": "listen", "event": "hello", "addr": peer[0], "hello": hello})
            if expect and sum(1 for h in hellos if h["hello"] is not None) >= expect:
                break
    except (BrokenPipeError, OSError):
        return []  # the caller went away: nobody to report to
    finally:
        srv.close()
    lines.append({"mode": "listen", "event": "result", "bound": True, "port": port,
                  "accepted": accepted, "hellos": hellos})
    return lines


def _stdout_closed() -> bool:
    """True once the reader of our stdout is gone (POLLERR/POLLHUP on the write end)."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), 0)  # errors and hang-ups are always reported
    return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in poller.poll(0))


def connect_with_retry(host: str, port: int, timeout: float, wait: float) -> JSON:
    """:func:`do_connect`, retried while refused for up to ``wait`` seconds.

    The doctor starts the master's listener and the nodes' probes at the same
    time; a probe that gets there first sees "refused" for a moment.
    """
    deadline = time.monotonic() + wait
    attempts = 0
    while True:
        attempts += 1
        res = do_connect(host, port, timeout)
        if res.get("error_kind") != "refused" or time.monotonic() >= deadline:
            res["attempts"] = attempts
            return res
        time.sleep(0.05)


def _read_hello(conn: socket.socket) -> str | None:
    conn.settimeout(1.0)
    try:
        data = conn.recv(256)
    except OSError:
        data = b""
    finally:
        conn.close()
    return data[len(HELLO):].decode("utf-8", "replace").strip() if data.startswith(HELLO) else None


def do_connect(host: str, port: int, timeout: float, hello: str | None = None) -> JSON:
    t0 = time.perf_counter()
    out: JSON = {"mode": "connect", "host": host, "port": port}
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            out["local_addr"] = s.getsockname()[0]
            s.sendall(HELLO + (hello or socket.gethostname()).encode() + b"\n")
        out.update(ok=True, error=None, error_kind=None)
    except socket.gaierror as exc:
        out.update(ok=False, error=_err(exc), error_kind="resolve")
    except ConnectionRefusedError as exc:
        out.update(ok=False, error=_err(exc), error_kind="refused")
    except (TimeoutError, socket.timeout) as exc:  # noqa: UP041 - distinct before 3.10
        out.update(ok=False, error=_err(exc), error_kind="timeout")
    except OSError as exc:
        out.update(ok=False, error=_err(exc), error_kind="unreachable")
    out["elapsed_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    return out


def _emit(obj: JSON) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clusterkit-probe", allow_abbrev=False)
    sub = p.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("facts", allow_abbrev=False)
    f.add_argument("--workdir")
    f.add_argument("--ckpt-dir", action="append", default=[])
    f.add_argument("--peer", action="append", default=[])
    f.add_argument("--master", help="HOST:PORT to connect to at the end (the doctor's listener)")
    f.add_argument("--master-wait", type=float, default=0.0,
                   help="keep retrying a refused --master connect this long")
    lst = sub.add_parser("listen", allow_abbrev=False)
    lst.add_argument("port", type=int)
    lst.add_argument("seconds", type=float)
    lst.add_argument("--bind", default="0.0.0.0")
    lst.add_argument("--expect", type=int, default=0)
    c = sub.add_parser("connect", allow_abbrev=False)
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("--timeout", type=float, default=3.0)
    c.add_argument("--hello", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.mode == "facts":
            _emit(collect_facts(args.workdir, args.ckpt_dir, args.peer, args.master,
                                args.master_wait))
        elif args.mode == "listen":
            for line in do_listen(args.port, args.seconds, args.bind, args.expect):
                _emit(line)
        else:
            _emit(do_connect(args.host, args.port, args.timeout, args.hello))
    except Exception as exc:  # last resort: still one JSON answer
        _emit({"mode": args.mode, "fatal": _err(exc)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
