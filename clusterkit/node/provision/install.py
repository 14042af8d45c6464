"""Node program: install a clusterkit wheel sent on stdin into this interpreter, offline.

``install WHEEL_NAME SIZE`` reads exactly SIZE bytes (the wheel) from stdin,
writes them to a private temporary directory under the wheel's own name, runs
``<this python> -m pip install --no-index --no-deps --force-reinstall`` on it
(no package index is contacted: offline clusters are common), removes the file,
and prints one JSON line: pip's exit code and tail, and the facts afterwards
(:func:`clusterkit.node.facts.gatefacts.gate_facts`: the version and source digest now
importable), so the launcher verifies the result.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from clusterkit.node.facts.gatefacts import gate_facts

PIP_TIMEOUT_S = 300


def install(name: str, data: bytes) -> dict[str, Any]:
    if os.sep in name or not name.endswith(".whl"):
        return {"error": f"bad wheel name {name!r}"}
    tmp = tempfile.mkdtemp(prefix="clusterkit-wheel-")
    try:
        path = os.path.join(tmp, name)
        with open(path, "wb") as fh:
            fh.write(data)
        argv = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                "--force-reinstall", "--disable-pip-version-check", "--no-input", path]
        res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, timeout=PIP_TIMEOUT_S, check=False)
        tail = res.stdout.decode("utf-8", "replace").strip().splitlines()[-3:]
        return {"pip_exit": res.returncode, "pip_tail": tail, "facts": gate_facts()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    name, size = args[0], int(args[1])
    data = sys.stdin.buffer.read(size)
    if len(data) != size:
        out: dict[str, Any] = {"error": f"stdin ended after {len(data)} of {size} bytes"}
    else:
        try:
            out = install(name, data)
        except (OSError, subprocess.SubprocessError) as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0 if "error" not in out and out.get("pip_exit") == 0 else 1
