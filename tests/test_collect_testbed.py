"""collect-ckpt against 7 namespace nodes over real SSH (docs/testbed.md).

Synthetic checkpoints (random bytes in DeepSpeed's node-local layout) cover the
refusals, the checksum path and a kill mid-transfer; the slow tests train the bundled
workload 7 x 2 with node-local storage (ZeRO-2 and ZeRO-3) and check that the
consolidated weights equal the live model's exactly.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from clusterkit.checkpoints import synthetic
from clusterkit.checkpoints.collect import MANIFEST, CollectNode, CollectOptions, collect
from clusterkit.checkpoints.transfer import PART_SUFFIX
from clusterkit.errors import CheckpointError
from clusterkit.remote.dispatch import DispatchTransport
from tests.testbed import Testbed

NODES = 7
TAG = "global_step1"
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.testbed(nodes=NODES)


def _cli(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterkit", "collect-ckpt", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _synth(tb: Testbed, name: str, shard_bytes: int = 1 << 16, stage: int = 2) -> str:
    """A synthetic checkpoint under <node-local>/<name> on every node; returns that path."""
    tb.ensure(NODES)
    inside = f"{tb.local_mountpoint}/{name}"
    roots = [str(tb.node_local_path(n, inside)) for n in tb.nodes[:NODES]]
    synthetic.write_node_local(roots, zero_stage=stage, shard_bytes=shard_bytes,
                               model_bytes=4096, hosts=[n.name for n in tb.nodes[:NODES]])
    return inside


def _inventory(tb: Testbed, tmp: Path) -> str:
    return str(tb.write_inventory(tmp / "inv.yaml", tb.nodes[:NODES], slots=2))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_collect_seven_nodes_and_rerun(testbed: Testbed, tmp_path: Path) -> None:
    ckpt = _synth(testbed, "c-ok")
    inv, dest = _inventory(testbed, tmp_path), tmp_path / "dest"
    res = _cli("-i", inv, "--dir", ckpt, "--to", str(dest))
    assert res.returncode == 0, res.stderr
    shards = sorted(p.name for p in (dest / TAG).glob("*_optim_states.pt"))
    assert len(shards) == 14
    assert (dest / TAG / MANIFEST).is_file() and (dest / "latest").read_text() == TAG
    src = testbed.node_local_path("node4", f"{ckpt}/{TAG}/zero_pp_rank_7_mp_rank_00_optim_states.pt")
    assert _sha(dest / TAG / src.name) == _sha(src)
    assert "note: global_step1/mp_rank_00_model_states.pt" in res.stdout
    again = _cli("-i", inv, "--dir", ckpt, "--to", str(dest))
    assert again.returncode == 0 and "0 file(s) copied" in again.stdout, again.stdout


def test_missing_shard_on_node4_refuses(testbed: Testbed, tmp_path: Path) -> None:
    ckpt = _synth(testbed, "c-missing")
    os.unlink(testbed.node_local_path(
        "node4", f"{ckpt}/{TAG}/zero_pp_rank_7_mp_rank_00_optim_states.pt"))
    dest = tmp_path / "dest"
    res = _cli("-i", _inventory(testbed, tmp_path), "--dir", ckpt, "--to", str(dest))
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
    inv, dest = _inventory(testbed, tmp_path), tmp_path / "dest"
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
        assert _sha(final) == _sha(testbed.node_local_path(owner, f"{ckpt}/{TAG}/{final.name}"))
    res = _cli("-i", inv, "--dir", ckpt, "--to", str(dest))
    assert res.returncode == 0, res.stderr
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 14
    assert not list((dest / TAG).glob(f".*{PART_SUFFIX}"))


def test_scatter_back_to_fresh_dirs(testbed: Testbed, tmp_path: Path) -> None:
    ckpt = _synth(testbed, "c-scatter", stage=3)
    inv, dest = _inventory(testbed, tmp_path), tmp_path / "dest"
    assert _cli("-i", inv, "--dir", ckpt, "--to", str(dest)).returncode == 0
    fresh = f"{testbed.local_mountpoint}/c-scatter-back"
    res = _cli("-i", inv, "--dir", fresh, "--to", str(dest), "--scatter")
    assert res.returncode == 0, res.stderr
    for i, n in enumerate(testbed.nodes[:NODES]):
        tag_dir = testbed.node_local_path(n, f"{fresh}/{TAG}")
        assert sorted(p.name for p in tag_dir.glob("zero_pp_rank_*_optim_states.pt")) == sorted(
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (2 * i, 2 * i + 1))
        assert (tag_dir / f"clusterkit-complete.node{i}.json").is_file()
    check = _cli("-i", inv, "--dir", fresh, "--to", str(tmp_path / "d2"), "--dry-run")
    assert check.returncode == 0 and "complete" in check.stdout, check.stderr


# ------------------------------------------------------------------ the real workload


def _train_node_local(tb: Testbed, stage: int, ckpt: str, weights: Path, logs: Path) -> None:
    """torchrun on every node (node-local checkpoints); the first failure stops all."""
    nodes = tb.ensure(NODES)
    port = str(random.randint(29100, 29900))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    procs: list[subprocess.Popen[bytes]] = []
    for i, n in enumerate(nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                "--node_rank", str(i), "--nproc_per_node", "2", "--master_addr", nodes[0].address,
                "--master_port", port, "-m", "clusterkit.workload", "--model", "tiny",
                "--steps", "3", "--zero-stage", str(stage), "--log-every", "1",
                "--storage", "node-local", "--ckpt-dir", ckpt,
                "--run-dir", f"{tb.local_mountpoint}/run-z{stage}", "--dump-weights", str(weights)]
        with open(logs / f"node{i + 1}.log", "wb") as log:
            procs.append(tb.spawn(n, argv, cwd=str(REPO), env=env, stdout=log,
                                  stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 600
    summary = logs / "node1.log"

    def finished() -> bool:
        return b"CLUSTERKIT_SUMMARY" in summary.read_bytes()

    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            # A rank dying before the run finished is a failure: stop the others now.
            if any(p.poll() not in (None, 0) for p in procs) and not finished():
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    bad = [i for i, c in enumerate(codes) if c != 0]
    tails = "\n".join(f"--- node{i + 1} (exit {codes[i]}):\n"
                      + (logs / f"node{i + 1}.log").read_text(errors="replace")[-1500:]
                      for i in bad[:2])
    # Seen under heavy load: a rank aborts in process teardown ("terminate called
    # without an active exception") after the checkpoint and the weight dump were
    # complete. That is not what this test is about; a failure before the summary is.
    assert finished() and weights.is_file(), tails
    if bad:
        warnings.warn(f"ranks exited non-zero after the run finished: {tails[-600:]}",
                      stacklevel=1)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_workload_7x2_collect_and_consolidate_exact(testbed: Testbed, tmp_path: Path,
                                                    stage: int) -> None:
    import torch

    from clusterkit.checkpoints.consolidate import load_state_dict_dir

    ckpt = f"{testbed.local_mountpoint}/wl-z{stage}"
    weights = testbed.shared_dir / f"wl-z{stage}-weights.pt"
    _train_node_local(testbed, stage, ckpt, weights, tmp_path)
    dest = tmp_path / "dest"
    res = _cli("-i", _inventory(testbed, tmp_path), "--dir", ckpt, "--to", str(dest),
               "--consolidate", "fp32", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(list((dest / "global_step3").glob("*_optim_states.pt"))) == 14
    assert "loads strictly into clusterkit.workload GPT(tiny)" in res.stdout
    live = torch.load(weights, map_location="cpu")
    got = load_state_dict_dir(str(dest / "global_step3-fp32"))
    assert set(live) <= set(got)
    assert max(float((got[k] - v.detach()).abs().max()) for k, v in live.items()) == 0.0
