"""DeepSpeed's JIT ops: which ops a config builds, and stale build locks (doctor's check)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit.node import jitops


def test_ops_for_the_bundled_workloads_configs() -> None:
    cpu = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert jitops.ops_for_config(cpu, "cpu") == ["ShareMemCommBuilder"]
    gpu = {"optimizer": {"type": "AdamW", "params": {}}}
    assert jitops.ops_for_config(gpu, "cuda") == ["FusedAdamBuilder"]
    off = {"optimizer": {"type": "Adam"},
           "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert jitops.ops_for_config(off, "cuda") == ["CPUAdamBuilder"]
    nvme = {"optimizer": {"type": "Adam"},
            "zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
    assert jitops.ops_for_config(nvme, "cuda") == ["CPUAdamBuilder", "AsyncIOBuilder"]
    assert jitops.ops_for_config({}, "cuda") == []


def _lock(root: Path, op: str = "fused_adam") -> Path:
    d = root / "py311_cpu" / op
    d.mkdir(parents=True)
    (d / "lock").write_bytes(b"")
    return d / "lock"


def test_a_lock_nobody_holds_is_stale_one_held_open_is_not(tmp_path: Path) -> None:
    lock = _lock(tmp_path)
    found = jitops.locks([str(tmp_path)])
    assert [f["path"] for f in jitops.stale(found)] == [str(lock)]
    # FileBaton keeps the O_EXCL fd open for the whole build: a live builder holds it.
    holder = subprocess.Popen([sys.executable, "-c",
                               f"import os,time; fd=os.open({str(lock)!r}, os.O_RDONLY); "
                               "print('ready', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        found = jitops.locks([str(tmp_path)])
        assert found[0]["holders"] == [holder.pid] and jitops.stale(found) == []
    finally:
        holder.kill()
        holder.wait()


def test_extension_roots_follow_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/x/ext")
    assert jitops.extension_roots()[0] == "/x/ext"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert jitops.extension_roots() == [os.path.expanduser("~/.cache/torch_extensions")]
