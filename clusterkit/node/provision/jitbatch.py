"""Node program ``provision.jitbatch``: the batch script's JIT ops step, on each node of a Slurm job.

Standard library only (shipped with :mod:`clusterkit.node.provision.jitops`, ship.py); deepspeed
is imported only to build (jitops.build). ``provision.jitbatch NODE``: stdin holds the sources, then
one JSON line ``{"ops": [builder names], "ds_config": {}, "accelerator": "cuda"}`` (the
plan's ops and the accelerator it assumed, render/sbatch.py). Prints one line for the
job's output and exits 0 (ready), 2 (a stale lock: its path and the fix) or 1 (a failed
build); docs/sbatch.md, "JIT ops".
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any, Dict, List  # noqa: UP035 - runs on Python 3.8 nodes

from clusterkit.node.provision.buildowner import here
from clusterkit.node.provision.jitops import (
    assigned,
    build_request,
    check,
    describe,
    ops_for_config,
    package_dir,
)


def accelerator_here(torch_dir: str | None = None) -> str:
    """DeepSpeed's accelerator on this node as its ranks will find it, without importing
    torch: ``DS_ACCELERATOR``, else ``cuda`` when torch is a CUDA/ROCm build and a GPU
    device is there, else ``cpu`` ("" without torch)."""
    if os.environ.get("DS_ACCELERATOR"):
        return os.environ["DS_ACCELERATOR"]
    torch_dir = torch_dir or package_dir("torch")
    if torch_dir is None:
        return ""
    version = assigned(os.path.join(torch_dir, "version.py"))
    gpu = glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")
    return "cuda" if (version.get("cuda") or version.get("hip")) and gpu else "cpu"


def batch(req: Dict[str, Any], node: str) -> int:  # noqa: UP006
    """The batch script's build step on one node (docs/sbatch.md, "JIT ops"): one line
    for the job's output, exit 0 (ready), 2 (a stale lock: its path and the fix) or
    1 (a failed build)."""
    ops = [str(op) for op in req.get("ops") or []]
    planned, here_acc, note = str(req.get("accelerator") or ""), accelerator_here(), ""
    if planned and here_acc and here_acc != planned:
        # The plan guessed from the inventory (gpus: N -> cuda); the ranks' DeepSpeed will
        # find this node's own (fake GPUs in a test cluster, a CPU-only torch): build what
        # that one builds at every start, not the guessed kernels it cannot build.
        ops = ops_for_config({}, here_acc)
        req = {**req, "ops": ops}
        note = f" (planned for {planned}; this node's accelerator is {here_acc})"
    try:
        # Files first (no deepspeed import, a tenth of a second): a job whose ops are
        # built and unlocked starts at once; deepspeed is imported only to build.
        pre = check(ops)
        if pre["deepspeed"] and not pre["stale"] and not pre["live"] and all(
                state == "built" for state in pre["ops"].values()):
            out: Dict[str, Any] = {  # noqa: UP006
                "accelerator": here_acc or "?",
                "ops": {op: {"state": "built", "was": "built"} for op in ops}}
        else:
            out = build_request(req)
    except (OSError, ValueError, ImportError) as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    head = f"clusterkit: DeepSpeed's JIT ops on {node}: "
    if out.get("error"):
        line, code = f"{head}failed: {out['error']} (deepspeed must be importable by the job's python)", 1
    elif out.get("stale"):
        paths = " ".join(str(lk["path"]) for lk in out["stale"])
        line, code = (f"{head}stale build lock {paths} (no live process there holds it and no "
                      "builder recorded it): every DeepSpeed start would wait on it; check "
                      f"that no build runs on {node} or a node sharing the directory "
                      f"(`fuser {paths}`, `ps aux | grep ninja`), then `rm {paths}` (or "
                      "`clusterkit nodes build-ops --remove-stale-locks`)"), 2
    else:
        failed = [op for op, r in (out.get("ops") or {}).items() if r.get("state") == "failed"]
        line, code = head + describe(out, timed=True) + note, 1 if failed else 0
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return code


def main(argv: List[str] | None = None) -> int:  # noqa: UP006
    args = list(sys.argv[1:] if argv is None else argv)
    req = json.loads(sys.stdin.buffer.readline().decode("utf-8") or "{}")
    return batch(req, args[0] if args else here()["host"])
