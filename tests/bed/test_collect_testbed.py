"""collect-ckpt against 7 namespace nodes over real SSH (docs/testbed.md).

Synthetic checkpoints (random bytes in DeepSpeed's node-local layout) cover the
refusals, the checksum path and a kill mid-transfer; the slow test collects the
bundled workload's node-local ZeRO-3 checkpoints from a DeepSpeed-runner run at 2 x 2
(4 ranks) and checks that the consolidated weights equal the live model's exactly.
The native 7 x 2 ZeRO-2 run (and the DeepSpeed runner's 7 x 2 ZeRO-3, extended) is
collected the same way by test_launch_train.py, whose module fixture launches it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterkit.checkpoints.collect.manifest import MANIFEST
from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.checkpoints.sources.transfer import PART_SUFFIX
from clusterkit.errors import CheckpointError
from clusterkit.node.hashing import sha256_file
from clusterkit.remote.dispatch import DispatchTransport
from tests import synthetic_ckpt as synthetic
from tests.cli import clusterkit_cli
from tests.helpers import SHARED_7X2_STEPS, Launched, assert_collected_exact, assert_trained, train
from tests.paths import REPO
from tests.testbed import Testbed

NODES = 7
TAG = "global_step1"

pytestmark = pytest.mark.testbed(nodes=NODES)


def _synth(tb: Testbed, name: str, shard_bytes: int = 1 << 16, stage: int = 2) -> str:
    """A synthetic checkpoint under <node-local>/<name> on every node; returns that path."""
    tb.ensure(NODES)
    inside = f"{tb.local_mountpoint}/{name}"
    roots = [str(tb.node_local_path(n, inside)) for n in tb.nodes[:NODES]]
    synthetic.write_node_local(roots, zero_stage=stage, shard_bytes=shard_bytes,
                               model_bytes=4096, hosts=[n.name for n in tb.nodes[:NODES]])
    return inside


def _bed_inventory(tb: Testbed, tmp: Path, nodes: int = NODES) -> str:
    return str(tb.write_inventory(tmp / "inv.yaml", tb.nodes[:nodes], slots=2))



def test_collect_seven_nodes_and_rerun(testbed: Testbed, tmp_path: Path) -> None:
    ckpt = _synth(testbed, "c-ok")
    inv, dest = _bed_inventory(testbed, tmp_path), tmp_path / "dest"
    res = clusterkit_cli("collect-ckpt", "-i", inv, "--dir", ckpt, "--to", str(dest), cwd=REPO,
                         timeout=300.0)
    assert res.returncode == 0, res.stderr
    shards = sorted(p.name for p in (dest / TAG).glob("*_optim_states.pt"))
    assert len(shards) == 14
    assert (dest / TAG / MANIFEST).is_file() and (dest / "latest").read_text() == TAG
    src = testbed.node_local_path("node4", f"{ckpt}/{TAG}/zero_pp_rank_7_mp_rank_00_optim_states.pt")
    assert sha256_file(str(dest / TAG / src.name)) == sha256_file(str(src))
    assert "note: global_step1/mp_rank_00_model_states.pt" in res.stdout
    again = clusterkit_cli("collect-ckpt", "-i", inv, "--dir", ckpt, "--to", str(dest), cwd=REPO,
                           timeout=300.0)
    assert again.returncode == 0 and "0 file(s) copied" in again.stdout, again.stdout


def test_missing_shard_on_node4_refuses(testbed: Testbed, tmp_path: Path) -> None:
    ckpt = _synth(testbed, "c-missing")
    os.unlink(testbed.node_local_path(
        "node4", f"{ckpt}/{TAG}/zero_pp_rank_7_mp_rank_00_optim_states.pt"))
    dest = tmp_path / "dest"
    res = clusterkit_cli("collect-ckpt", "-i", _bed_inventory(testbed, tmp_path), "--dir", ckpt, "--to",
                         str(dest), cwd=REPO, timeout=300.0)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "node4: optimizer shard of rank 7 is missing" in res.stderr
    assert "nothing was copied" in res.stderr
    assert not dest.exists()


def test_corrupt_byte_after_listing_is_reported(testbed: Testbed, tmp_path: Path) -> None:
    ckpt = _synth(testbed, "c-corrupt")
    victim = testbed.node_local_path("node5", f"{ckpt}/{TAG}/zero_pp_rank_9_mp_rank_00_optim_states.pt")
    nodes = [CollectNode(n.name, testbed.ssh_target(n), sys.executable, ckpt)
             for n in testbed.nodes[:NODES]]

    def corrupt(_plan: object) -> None:
        data = bytearray(victim.read_bytes())
        data[1234] ^= 0x01
        victim.write_bytes(bytes(data))

    dest = tmp_path / "dest"
    with DispatchTransport() as t, pytest.raises(CheckpointError) as info:
        collect(t, nodes, CollectOptions(dest=str(dest)), after_hash=corrupt)
    assert "node5:global_step1/zero_pp_rank_9_mp_rank_00_optim_states.pt: sha256 mismatch" \
        in info.value.message
    assert not (dest / TAG / victim.name).exists()
    assert not (dest / TAG / MANIFEST).exists()


def test_kill_mid_transfer_then_rerun(testbed: Testbed, tmp_path: Path) -> None:
    ckpt = _synth(testbed, "c-kill", shard_bytes=6 << 20)
    inv, dest = _bed_inventory(testbed, tmp_path), tmp_path / "dest"
    argv = [sys.executable, "-m", "clusterkit", "collect-ckpt", "-i", inv, "--dir", ckpt,
            "--to", str(dest), "--jobs", "2"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            parts = list((dest / TAG).glob(f".*{PART_SUFFIX}")) if (dest / TAG).is_dir() else []
            if any(p.exists() and p.stat().st_size > 1 << 20 for p in parts):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "collect finished before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (dest / TAG / MANIFEST).exists()
    # Every file that carries a final name is complete and correct.
    for final in (dest / TAG).iterdir():
        if final.name.startswith("."):
            continue
        owner = next(n for n in testbed.nodes[:NODES]
                     if testbed.node_local_path(n, f"{ckpt}/{TAG}/{final.name}").exists())
        held = testbed.node_local_path(owner, f"{ckpt}/{TAG}/{final.name}")
        assert sha256_file(str(final)) == sha256_file(str(held))
    res = clusterkit_cli("collect-ckpt", "-i", inv, "--dir", ckpt, "--to", str(dest), cwd=REPO,
                         timeout=300.0)
    assert res.returncode == 0, res.stderr
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 14
    assert not list((dest / TAG).glob(f".*{PART_SUFFIX}"))


def test_scatter_back_to_fresh_dirs(testbed: Testbed, tmp_path: Path) -> None:
    ckpt = _synth(testbed, "c-scatter", stage=3)
    inv, dest = _bed_inventory(testbed, tmp_path), tmp_path / "dest"
    assert clusterkit_cli("collect-ckpt", "-i", inv, "--dir", ckpt, "--to", str(dest), cwd=REPO,
                          timeout=300.0).returncode == 0
    fresh = f"{testbed.local_mountpoint}/c-scatter-back"
    res = clusterkit_cli("collect-ckpt", "-i", inv, "--dir", fresh, "--to", str(dest), "--scatter",
                         cwd=REPO, timeout=300.0)
    assert res.returncode == 0, res.stderr
    for i, n in enumerate(testbed.nodes[:NODES]):
        tag_dir = testbed.node_local_path(n, f"{fresh}/{TAG}")
        assert sorted(p.name for p in tag_dir.glob("zero_pp_rank_*_optim_states.pt")) == sorted(
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (2 * i, 2 * i + 1))
        assert (tag_dir / f"clusterkit-complete.node{i}.json").is_file()
    check = clusterkit_cli("collect-ckpt", "-i", inv, "--dir", fresh, "--to", str(tmp_path / "d2"),
                           "--dry-run", cwd=REPO, timeout=300.0)
    assert check.returncode == 0 and "complete" in check.stdout, check.stderr


# ------------------------------------------------------------------ the real workload


@pytest.mark.slow
def test_deepspeed_zero3_2x2_collect_and_consolidate_exact(testbed: Testbed,
                                                           tmp_path: Path) -> None:
    """ZeRO-3 under DeepSpeed's runner (pdsh), node-local, 2 nodes x 2 ranks: the weights
    the live model dumped equal the ones consolidated from the collected shards."""
    job, weights = "ds3-2x2", testbed.shared_dir / "ds3-2x2-weights.pt"
    run = train(testbed, tmp_path, job, "deepspeed", 2, 2, "node-local", SHARED_7X2_STEPS,
                ["--zero-stage", "3", "--set-env", f"CLUSTERKIT_DUMP_WEIGHTS={weights}"])
    assert_trained(run, SHARED_7X2_STEPS, 4)
    launched = Launched(run, 0.0, job, "node-local", 3, weights)
    assert_collected_exact(testbed, tmp_path, launched, nodes=2, ranks=4)


