"""What the checkpoint-replica unit tests share (tests/process/test_replica.py, test_replica_proc.py,
test_slurm_restore.py): a job id per test, ZeRO-2 tag dirs of whole zip archives, and the
config of two services that replicate each other on loopback."""

from __future__ import annotations

import os
import secrets
import zipfile
from pathlib import Path
from typing import Any


def fresh_job_id(prefix: str) -> str:
    """A job id, hence replica ports, of its own: the servers of parallel tests (xdist),
    or their sockets lingering in TIME_WAIT, never answer for this test."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"


def zip_archive(path: Path, payload: bytes) -> None:
    """A whole zip archive, as torch.save writes (a .pt file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("data.pkl", payload)


def zero2_tag(root: Path, tag: str, ranks: list[int], size: int = 300_000) -> None:
    """A ZeRO-2 tag dir of one node (its ranks' optimizer shards, the model states)."""
    d = root / tag
    zip_archive(d / "mp_rank_00_model_states.pt", os.urandom(size))
    for r in ranks:
        zip_archive(d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", os.urandom(size))


def ring_pair(tmp_path: Path, secret: str) -> list[dict[str, Any]]:
    """``AgentSpec.replica`` of nodes n0 and n1 (checkpoint dirs under ``tmp_path``), each
    the other's target and source, completion by markers."""
    out = []
    for i in (0, 1):
        other = 1 - i
        ckpt = tmp_path / f"n{i}" / "ckpt"
        ckpt.mkdir(parents=True)
        out.append({"index": i, "address": "127.0.0.1", "ckpt_dir": str(ckpt), "ranks": [i],
                    "markers": True, "sources": [other], "secret": secret,
                    "targets": [{"node": f"n{other}", "index": other, "address": "127.0.0.1"}]})
    return out
