"""A user's training script as bench_replication's ``--user-script`` mode runs it (issue 31).

Standard library only (starts in a blink on 2 cores): each step is a fixed amount of
pure-Python CPU work and then ``--sleep-ms`` of no CPU (the accelerator's share of a
step, when the host's CPUs wait: a GPU job's ranks do not keep every core busy), timed;
every ``--save-every`` steps each rank writes a DeepSpeed
ZeRO-2 shaped checkpoint into ``$CLUSTERKIT_CKPT_DIR/step<N>/``: its
``zero_pp_rank_<R>_mp_rank_00_optim_states.pt`` of ``--mb-per-rank`` MB and, local rank
0, a small ``mp_rank_00_model_states.pt`` (whole zip archives, as torch.save writes
them), then ``latest``; only the newest two saves are kept. So a node's agent sees what
it sees of a user's DeepSpeed script and replicates it by the no-marker rule
(node/replicas/done.py). Each rank prints one line ``CLUSTERKIT_BENCH_STEPS {json}``:
its timed steps (the saves themselves left out, the copies beside the steps not).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zipfile


def work(units: int) -> int:
    acc = 0
    for i in range(units):
        acc = (acc * 31 + i) & 0xFFFFFFFF
    return acc


def save(ckpt: str, step: int, rank: int, local_rank: int, payload: bytes) -> None:
    tag = os.path.join(ckpt, f"step{step}")
    os.makedirs(tag, exist_ok=True)
    files = [(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", payload)]
    if local_rank == 0:
        files.append(("mp_rank_00_model_states.pt", payload[:1 << 20]))
    for name, data in files:
        tmp = os.path.join(tag, f".{name}.tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data/0", data)
        os.replace(tmp, os.path.join(tag, name))
    if rank == 0:
        with open(os.path.join(ckpt, "latest"), "w", encoding="utf-8") as fh:
            fh.write(f"step{step}")
    old = os.path.join(ckpt, f"step{step - 2 * int(os.environ['BENCH_SAVE_EVERY'])}")
    if local_rank == 0 and os.path.isdir(old):
        shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--mb-per-rank", type=int, default=128)
    p.add_argument("--units", type=int, default=1_500_000)  # ~0.15 CPU-s on this machine
    p.add_argument("--sleep-ms", type=int, default=1000)
    ns = p.parse_args()
    os.environ["BENCH_SAVE_EVERY"] = str(ns.save_every)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    ckpt = os.environ["CLUSTERKIT_CKPT_DIR"]
    payload = os.urandom(ns.mb_per_rank << 20)
    steps, cpu, saves = [], [], []
    for step in range(1, ns.steps + 1):
        t0, c0 = time.monotonic(), time.process_time()
        work(ns.units)
        time.sleep(ns.sleep_ms / 1000)
        steps.append(time.monotonic() - t0)
        cpu.append(time.process_time() - c0)
        if step % ns.save_every == 0:
            t0 = time.monotonic()
            save(ckpt, step, rank, local_rank, payload)
            saves.append(time.monotonic() - t0)
    print("CLUSTERKIT_BENCH_STEPS " + json.dumps({"rank": rank, "steps": steps[1:],
                                                  "cpu": cpu[1:], "saves": saves}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
