"""Helpers the clusterkit sync tests share (tests/test_sync_engine*.py, tests/test_sync_links*.py):
an inventory of local virtual nodes, the CLI run as a user runs it, and a Hugging Face hub
cache's shape."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from clusterkit.cli.main import main
from tests.cli import clusterkit_cli


def local_inventory(tmp_path: Path, n: int = 3) -> Path:
    lines = ["schema_version: 1", "defaults:", "  transport: local", "  slots: 1",
             f"  checkpoint: {{shared_dir: {tmp_path / 'ckpt'}}}", "hosts:"]
    lines += [f"  v{i}: {{workdir: {tmp_path / f'w{i}'}}}" for i in range(n)]
    inv = tmp_path / "inv.yaml"
    inv.write_text("\n".join(lines) + "\n")
    return inv


def run_cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The sync tests' spelling of tests/cli.clusterkit_cli (an argument list)."""
    return clusterkit_cli(*args, cwd=cwd, env=env)


def done_event(out: str) -> dict[str, Any]:
    return next(json.loads(x) for x in reversed(out.splitlines()) if x.startswith('{"event": "done"'))


SHA_CFG = "a" * 40
SHA_W = "b" * 40


def hf_tree(root: Path, outside: Path) -> Path:
    """A hub cache as huggingface_hub lays it out, plus a link out of it (a file and a
    directory), a dangling one and an absolute one into it: ``root/hub``."""
    repo = root / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "snapshots" / "rev1").mkdir(parents=True)
    (repo / "blobs" / SHA_CFG).write_text('{"hidden_size": 8}\n')
    (repo / "blobs" / SHA_W).write_bytes(os.urandom(3000))
    (repo / "refs" / "main").write_text("rev1")
    snap = repo / "snapshots" / "rev1"
    os.symlink(f"../../blobs/{SHA_CFG}", snap / "config.json")
    os.symlink(f"../../blobs/{SHA_W}", snap / "model.safetensors")
    os.symlink(str(repo / "blobs" / SHA_CFG), snap / "abs.json")  # absolute, inside
    os.symlink("rev1", repo / "snapshots" / "latest")  # a directory, inside
    (outside / "dir").mkdir(parents=True)
    (outside / "tokenizer.json").write_text("{}\n")
    (outside / "dir" / "a.txt").write_text("a\n")
    os.symlink(str(outside / "tokenizer.json"), root / "hub" / "tokenizer.json")
    os.symlink(str(outside / "dir"), root / "hub" / "extra")
    os.symlink("../nowhere", root / "hub" / "dangling")
    return root / "hub"


def sync_verb(project: Path, target: str, inv: Path, capsys: pytest.CaptureFixture[str],
              *extra: str, code: int = 0) -> tuple[str, str]:
    """``clusterkit sync TARGET -i INV EXTRA`` in this process from ``project`` (its exit
    code must be ``code``); what it printed, (stdout, stderr)."""
    cwd = os.getcwd()
    os.chdir(project)
    try:
        assert main(["sync", target, "-i", str(inv), *extra]) == code
    finally:
        os.chdir(cwd)
    cap = capsys.readouterr()
    return cap.out, cap.err
