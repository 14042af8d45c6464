"""Node program and helper: DeepSpeed's JIT-built ops, built once per node; stale build locks.

Standard library only at import (shipped, ship.py); ``build`` imports deepspeed
inside the function that must call it.

Why: torch builds a JIT extension under a lock file, ``<build dir>/lock``, created with
O_EXCL and kept open by the builder until the build ends (torch.utils.file_baton).
Every other process waits in ``FileBaton.wait`` until the file is gone. A builder
killed mid-build leaves the file behind and every later DeepSpeed start on that node
waits forever. Building the ops once per node before the ranks start (``clusterkit
nodes build-ops``) means eight ranks never race one build, and ``doctor`` names a
lock that no live process holds (:func:`locks`).

``build``: stdin holds one JSON line ``{"ops": [builder class names], "ds_config":
{...}, "remove_stale": false}``; the ops are the given ones plus :func:`ops_for_config`
of the config (none given: the bundled workload's). Prints
one JSON line: per op, built / not available here / failed (with the last error line).
``locks``: prints the build locks found (:func:`locks`).
``check``: stdin ``{"ops": [builder class names]}``; prints, per op, whether it is built
where this node's ranks will load it (:func:`check`), and the stale locks: no deepspeed or
torch import, so ``clusterkit launch`` asks it of every node before each start.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import importlib.util
import json
import os
import signal
import sys
import time
from typing import Any, Dict, List  # noqa: UP035 - runs on Python 3.8 nodes

from clusterkit.node.provision.buildowner import LIVE, OWNER_SUFFIX, Owner, here, judge, owner_of

JITOPS_VERSION = 1
# Built by DeepSpeed's CPU accelerator at every deepspeed.init_distributed (comm/torch.py).
SHM_COMM = "ShareMemCommBuilder"


def extension_roots() -> List[str]:  # noqa: UP006
    """Where torch puts JIT builds: ``$TORCH_EXTENSIONS_DIR/<op>/`` when set, else
    ``~/.cache/torch_extensions/py<XY>_<cpu|cuXYZ>/<op>/`` (torch.utils.cpp_extension)."""
    roots = []
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        roots.append(os.environ["TORCH_EXTENSIONS_DIR"])
    roots.append(os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions"))
    return roots


# Builder class -> the extension's name (its build dir and ``<name>.so``), the ``NAME`` of
# deepspeed/ops/op_builder; an op not listed here is always handed to ``build``.
OP_NAMES = {SHM_COMM: "deepspeed_shm_comm", "CPUAdamBuilder": "cpu_adam",
            "FusedAdamBuilder": "fused_adam", "CPULionBuilder": "cpu_lion",
            "FusedLionBuilder": "fused_lion", "CPUAdagradBuilder": "cpu_adagrad",
            "AsyncIOBuilder": "async_io"}


def package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)  # finds the package without importing it
    locs = list(spec.submodule_search_locations or []) if spec else []
    return locs[0] if locs else None


def assigned(path: str) -> Dict[str, Any]:  # noqa: UP006
    """The literal top-level assignments of a generated module (torch/version.py,
    deepspeed/git_version_info_installed.py), read without importing it."""
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    out: Dict[str, Any] = {}  # noqa: UP006
    for node in tree.body:
        target: ast.expr
        value: ast.expr | None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and value is not None:
            try:
                out[target.id] = ast.literal_eval(value)
            except ValueError:
                continue
    return out


def build_root(torch_dir: str) -> str:
    """The directory torch builds each extension in (``<root>/<name>/``), as
    torch.utils.cpp_extension._get_build_directory decides it: ``$TORCH_EXTENSIONS_DIR``
    as is, else ``$XDG_CACHE_HOME`` (``~/.cache``) ``/torch_extensions/py<XY>_<acc>``."""
    if os.environ.get("TORCH_EXTENSIONS_DIR") is not None:
        return os.environ["TORCH_EXTENSIONS_DIR"]
    version = assigned(os.path.join(torch_dir, "version.py"))
    acc = (f"rocm{version['hip'].replace('.', '')}" if version.get("hip")
           else f"cu{version['cuda'].replace('.', '')}" if version.get("cuda") else "cpu")
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    py = f"py{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}"
    return os.path.join(os.path.realpath(os.path.join(cache, "torch_extensions")),
                        f"{py}_{acc}")


def job_roots() -> List[str]:  # noqa: UP006
    """Where this process's DeepSpeed would build (and wait on a lock): torch's build
    dir for it; without torch, every root (:func:`extension_roots`)."""
    torch_dir = package_dir("torch")
    return [build_root(torch_dir)] if torch_dir else extension_roots()


def op_state(root: str, name: str, torch_dir: str, lock: bool = True) -> str:
    """``built``: ``<root>/<name>/<name>.so`` is there, no build lock beside it, and its
    build.ninja compiled against this torch (else the ranks' ninja rebuilds it under the
    lock); ``missing`` otherwise; ``building``: a lock is there (``lock`` False: the
    files alone, whoever holds the lock for a moment)."""
    d = os.path.join(root, name)
    if lock and os.path.exists(os.path.join(d, "lock")):
        return "building"
    if not os.path.isfile(os.path.join(d, name + ".so")):
        return "missing"
    try:
        with open(os.path.join(d, "build.ninja"), encoding="utf-8", errors="replace") as fh:
            ninja = fh.read()
    except OSError:
        return "missing"
    return "built" if os.path.join(torch_dir, "include") + " " in ninja else "missing"


def check(ops: List[str]) -> Dict[str, Any]:  # noqa: UP006
    """Which of ``ops`` this node's ranks would have to build (``missing``), from files
    alone: a prebuilt op (DS_BUILD_OPS, deepspeed's installed_ops) counts as built."""
    torch_dir, ds_dir = package_dir("torch"), package_dir("deepspeed")
    if torch_dir is None or ds_dir is None:
        return {"v": JITOPS_VERSION, "deepspeed": False, "ops": {}, "stale": []}
    root = build_root(torch_dir)
    installed = assigned(os.path.join(ds_dir, "git_version_info_installed.py"))
    prebuilt = installed.get("installed_ops") or {}
    states = {}
    for op in ops:
        name = OP_NAMES.get(op)
        states[op] = ("missing" if name is None else "built" if prebuilt.get(name)
                      else op_state(root, name, torch_dir))
    found = settled([root])  # the locks its ranks would wait on
    # A dead one (its record proves it) is not a refusal: the op reads "building", so
    # the launch's build step runs there and removes it; a live one's build is waited for.
    return {"v": JITOPS_VERSION, "deepspeed": True, "root": root, "ops": states,
            "stale": [lk for lk in stale(found) if lk not in dead(found)],
            "live": [lk for lk in found if lk["state"] in LIVE]}


def holders(path: str, proc: str = "/proc") -> List[int]:  # noqa: UP006
    """The pids with ``path`` open (fuser's answer, from ``/proc/<pid>/fd``). Only
    processes this user may see and, in a PID namespace, only that namespace's."""
    return holders_of([path], proc)[os.path.realpath(path)]


def holders_of(paths: List[str], proc: str = "/proc") -> Dict[str, List[int]]:  # noqa: UP006
    """:func:`holders` of several files in one walk of ``/proc`` (each real path -> pids)."""
    want: Dict[str, List[int]] = {os.path.realpath(p): [] for p in paths}  # noqa: UP006
    for fd_dir in glob.glob(os.path.join(proc, "[0-9]*", "fd")) if want else []:
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        pid, seen = int(fd_dir.split(os.sep)[-2]), set()
        for fd in names:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target in want and target not in seen:
                want[target].append(pid)
                seen.add(target)
    return {path: sorted(pids) for path, pids in want.items()}


def locks(roots: List[str] | None = None, now: float | None = None  # noqa: UP006
          ) -> List[Dict[str, Any]]:  # noqa: UP006
    """Every ``lock`` file of a JIT build under the roots: path, age, holders (pids here
    that have it open), and :func:`judge`'s state and why (owner: the record's host)."""
    now = time.time() if now is None else now
    found: Dict[str, float] = {}  # noqa: UP006 - real path -> age
    for root in roots if roots is not None else extension_roots():
        for path in sorted(glob.glob(os.path.join(root, "*", "lock"))
                           + glob.glob(os.path.join(root, "*", "*", "lock"))):
            real = os.path.realpath(path)
            if real in found or not os.path.isfile(real):
                continue
            try:
                found[real] = now - os.stat(real).st_mtime
            except OSError:
                continue
    pids, me, out = holders_of(list(found)), here(), []
    for real, age in found.items():
        owner, owner_age = owner_of(real, now)
        if owner is None and not os.path.exists(real):
            continue  # removed meanwhile (a node sharing the directory proved it dead)
        out.append({"path": real, "age_s": round(age, 1), "holders": pids[real],
                    **judge(pids[real], owner, owner_age, me)})
    return out


def stale(found: List[Dict[str, Any]]) -> List[Dict[str, Any]]:  # noqa: UP006
    """The locks no build holds as far as we can tell (``dead`` or ``unknown``)."""
    return [lk for lk in found if lk.get("state", "held" if lk.get("holders") else "unknown")
            not in LIVE]


def dead(found: List[Dict[str, Any]]) -> List[Dict[str, Any]]:  # noqa: UP006
    """The locks a record proves abandoned: a start removes these by itself."""
    return [lk for lk in found if lk.get("state") == "dead"]


def remove(lk: Dict[str, Any]) -> bool:  # noqa: UP006
    """Remove a lock judged not live, and its record; not when the file was replaced
    since it was judged (another builder's new lock: its age is younger)."""
    path = str(lk["path"])
    try:
        if time.time() - os.stat(path).st_mtime < float(lk.get("age_s") or 0) - 1.0:
            return False
        os.unlink(path)
    except OSError:
        return False
    with contextlib.suppress(OSError):
        os.unlink(path + OWNER_SUFFIX)
    return True


# Every rank that loads an op, built or not, takes the op's lock for as long as ninja
# takes to find nothing to do (a second or two). A rank on another node or in another
# PID namespace that shares this directory (an NFS home) holds it where we cannot see
# it, so a young lock without a holder we can see (nor a record) is given this long to go.
SETTLE_S = 8.0
YOUNG_S = 120.0


def settled(roots: List[str] | None = None, wait_s: float = SETTLE_S,  # noqa: UP006
            poll_s: float = 0.25) -> List[Dict[str, Any]]:  # noqa: UP006
    """:func:`locks`, after waiting up to ``wait_s`` while a young lock nobody is known to
    hold is still there: one that goes is another node's load, not a stale lock."""
    deadline = time.monotonic() + wait_s
    found = locks(roots)
    while (any(lk["state"] == "unknown" and lk["age_s"] < YOUNG_S for lk in found)
           and time.monotonic() < deadline):
        time.sleep(poll_s)
        found = locks(roots)
    return found


def wait_live(lock: str, wait_s: float,
              poll_s: float = 1.0) -> Dict[str, Any] | None:  # noqa: UP006
    """Wait while a build holds ``lock`` (here or on a node sharing the directory); then
    remove it if its record proves it dead. Returns the lock still live at the deadline."""
    deadline, said = time.monotonic() + wait_s, False
    while True:
        found = [lk for lk in locks([os.path.dirname(os.path.dirname(lock))])
                 if lk["path"] == os.path.realpath(lock)]
        if not found:
            return None
        if found[0]["state"] == "dead":
            remove(found[0])
            return None
        if found[0]["state"] not in LIVE or time.monotonic() >= deadline:
            return found[0] if found[0]["state"] in LIVE else None
        if not said:  # on the node's stderr: the batch script's .err file, build-ops' log
            sys.stderr.write(f"jitops: {lock}: {found[0]['why']}: waiting for it\n")
            said = True
        time.sleep(poll_s)


# ----------------------------------------------------------------------------- hang dumps

# A rank's stack dump ends with one such line per build lock when it waits in
# FileBaton.wait (node/agent/hangs.py writes them, launch/stacks.py reads them).
BUILD_LOCK_NOTE = "# build lock: "
STALE = "no live process holds it (stale)"


def waits_on_baton(text: str) -> bool:
    """The dump shows torch's FileBaton.wait (faulthandler: file_baton.py ... in wait;
    py-spy: ``wait (torch/utils/file_baton.py:NN)`` or ``FileBaton.wait``)."""
    return "FileBaton.wait" in text or ("file_baton.py" in text and "wait" in text)


def _environ(pid: int, proc: str = "/proc") -> Dict[str, str]:  # noqa: UP006
    try:
        with open(os.path.join(proc, str(pid), "environ"), "rb") as fh:
            raw = fh.read().split(b"\0")
    except OSError:
        return {}
    pairs = (item.decode("utf-8", "replace").partition("=") for item in raw if b"=" in item)
    return {k: v for k, _, v in pairs}


def roots_of(env: Dict[str, str]) -> List[str]:  # noqa: UP006
    """Where a process with environment ``env`` builds and waits on locks: its
    TORCH_EXTENSIONS_DIR, else its home's cache."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return [env["TORCH_EXTENSIONS_DIR"]]
    home = env.get("HOME") or os.path.expanduser("~")
    return [os.path.join(home, ".cache", "torch_extensions")]


def lock_notes(pid: int) -> List[str]:  # noqa: UP006
    """The build locks the rank ``pid`` can be waiting for (its TORCH_EXTENSIONS_DIR, else
    its home's cache) and who holds each: :data:`BUILD_LOCK_NOTE` lines."""
    out = []
    for lk in locks(roots_of(_environ(pid))):
        pids = [p for p in lk["holders"] if p != pid]
        who = (f"held by pid {', '.join(map(str, pids))}" if pids
               else str(lk["why"]) if lk["state"] == "building" else STALE)
        out.append(f"{BUILD_LOCK_NOTE}{lk['path']}: {who}")
    return out


# ----------------------------------------------------------------------------- which ops


def _dict(value: Any) -> Dict[str, Any]:  # noqa: UP006
    return value if isinstance(value, dict) else {}


def ops_for_config(ds_config: Dict[str, Any], accelerator: str) -> List[str]:  # noqa: UP006
    """The op builders a DeepSpeed job with ``ds_config`` JIT-builds on ``accelerator``
    (``cpu``, ``cuda``...): the CPU accelerator's shared-memory collectives (every
    init), and the optimizer's kernel unless the config asks for torch's own Adam."""
    ops = [SHM_COMM] if accelerator == "cpu" else []
    opt = _dict(ds_config.get("optimizer"))
    kind = str(opt.get("type", "")).lower()
    params = _dict(opt.get("params"))
    off = _dict(_dict(ds_config.get("zero_optimization")).get("offload_optimizer"))
    offload = off.get("device") in ("cpu", "nvme")
    if kind in ("adam", "adamw") and not params.get("torch_adam"):
        ops.append("CPUAdamBuilder" if offload or accelerator == "cpu" else "FusedAdamBuilder")
    elif kind == "lion":
        ops.append("CPULionBuilder" if offload or accelerator == "cpu" else "FusedLionBuilder")
    elif kind == "adagrad":
        ops.append("CPUAdagradBuilder")
    if off.get("device") == "nvme":
        ops.append("AsyncIOBuilder")
    return list(dict.fromkeys(ops))


# ----------------------------------------------------------------------------- build


def _stop(signum: int, frame: Any) -> None:
    # torch releases its build lock in a ``finally``: a SIGTERM/SIGHUP (the SSH session
    # ended, Ctrl-C on the launcher) must unwind through it, not end the process there.
    raise SystemExit(128 + signum)


WAIT_LIVE_S = 1500.0  # another node's build of an op (within build-ops' 1800 s)


def build(ops: List[str], ds_config: Dict[str, Any] | None) -> Dict[str, Any]:  # noqa: UP006
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    import importlib

    # The one import outside the standard library, here only: the op builders are
    # deepspeed's (the other modes and the launcher's imports of this module need none).
    acc = importlib.import_module("deepspeed.accelerator").get_accelerator()
    name = str(getattr(acc, "_name", "") or acc.device_name())
    if ds_config is None:  # the bundled workload's: AdamW, torch's own on CPU nodes
        ds_config = {"optimizer": {"type": "AdamW", "params": {"torch_adam": name == "cpu"}}}
    wanted = list(dict.fromkeys([*ops, *ops_for_config(ds_config, name)]))
    torch_dir = package_dir("torch")
    root = build_root(torch_dir) if torch_dir else extension_roots()[0]
    results: Dict[str, Any] = {}  # noqa: UP006
    for op in wanted:
        t0 = time.monotonic()
        try:
            builder = acc.create_op_builder(op)
            if builder is None or not builder.is_compatible(verbose=False):
                results[op] = {"state": "not available", "why": f"not built on {name}"}
                continue
            lock = os.path.join(root, str(builder.name), "lock")
            # A build of this op on a node sharing the directory: wait for it (a dead
            # one's lock is removed), then load: ninja finds it built.
            busy = wait_live(lock, WAIT_LIVE_S)
            if busy is not None:
                results[op] = {"state": "failed", "why": f"{lock}: {busy['why']} for over "
                                                          f"{WAIT_LIVE_S:.0f} s"}
                continue
            # Built before this load? The files say; a lock there now may be another
            # node's load of the same built op (a second), not a build.
            was = op_state(root, str(builder.name), torch_dir, lock=False) if torch_dir \
                else "missing"
            os.makedirs(os.path.dirname(lock), exist_ok=True)
            with Owner(lock):
                builder.load(verbose=False)
            results[op] = {"state": "built", "name": builder.absolute_name(), "was": was,
                           "seconds": round(time.monotonic() - t0, 1)}
        except Exception as exc:  # a failed op is data; the next op still builds
            tail = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            results[op] = {"state": "failed", "why": f"{type(exc).__name__}: {tail[:300]}"}
    return {"v": JITOPS_VERSION, "accelerator": name, "ops": results}


def build_request(req: Dict[str, Any]) -> Dict[str, Any]:  # noqa: UP006
    """``build``'s answer to one request, stale locks first. Only the locks this node's
    ranks would wait on count: one of another Python's build dir, or one held by a
    process another PID namespace hides, is not ours. A lock whose owner record proves its
    builder gone is removed by itself; one nobody recorded only with ``remove_stale``; a
    live one never (the op's build waits for it: :func:`wait_live`)."""
    found = stale(settled(job_roots()))
    unproven = [lk for lk in found if lk not in dead(found)]
    if unproven and not req.get("remove_stale"):
        return {"v": JITOPS_VERSION, "stale": unproven}
    gone = [lk for lk in found if remove(lk)]
    cfg = req.get("ds_config")
    out = build(list(req.get("ops") or []), dict(cfg) if cfg is not None else None)
    out["removed"] = [f"{lk['path']} ({lk['why']})" for lk in gone]
    return out


def describe(out: Dict[str, Any], timed: bool = False) -> str:  # noqa: UP006
    """One line for a node's ``build`` answer without the node's name. ``nodes build-ops``
    prints it untimed, so equal nodes fold (``cpu: ShareMemCommBuilder built``); the
    batch script's step, one line per node, timed (``cpu: deepspeed_shm_comm built (51
    s)``, ``... already built``)."""
    parts = []
    for op, r in (out.get("ops") or {}).items():
        state = r.get("state")
        if state == "built" and not timed:
            parts.append(f"{op} built")
        elif state == "built":
            was = r.get("was") == "built"
            parts.append(f"{OP_NAMES.get(op, op)} " + ("already built" if was else
                                                       f"built ({r.get('seconds', 0):.0f} s)"))
        else:
            parts.append(f"{OP_NAMES.get(op, op) if timed else op} {state} ({r.get('why')})")
    removed = out.get("removed") or []
    if removed:
        parts.append(f"removed {len(removed)} stale lock(s): {', '.join(removed)}")
    return f"{out.get('accelerator')}: " + ("; ".join(parts) or "no op to build")


def main(argv: List[str] | None = None) -> int:  # noqa: UP006
    args = list(sys.argv[1:] if argv is None else argv)
    mode = args[0] if args else ""
    try:
        if mode == "build":
            out = build_request(json.loads(sys.stdin.buffer.readline().decode("utf-8") or "{}"))
        elif mode == "check":
            req = json.loads(sys.stdin.buffer.readline().decode("utf-8") or "{}")
            out = check([str(op) for op in req.get("ops") or []])
        elif mode == "locks":
            out = {"v": JITOPS_VERSION, "locks": locks()}
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except (OSError, ValueError, ImportError) as exc:
        out = {"v": JITOPS_VERSION, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0 if "error" not in out else 1
