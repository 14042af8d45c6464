"""Node side of ``clusterkit doctor --bandwidth``: one rank per node, sent on stdin.

Run as ``<python> - --bytes N --iters K --backend gloo|nccl`` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (torch's ``env://``).
It imports only the standard library and torch (it must not need clusterkit on
the node) and prints one JSON line: the rank's all_reduce time over the whole
group and its point-to-point exchange time with every other rank. Pairs run in
round-robin rounds of disjoint pairs, separated by barriers, so each pair has the
links to itself while it is measured. Times are the median iteration, so one
descheduled iteration on a busy node does not decide.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any


def round_robin(n: int) -> list[dict[int, int]]:
    """Rounds of disjoint pairs covering every pair once (circle method); {rank: partner}."""
    players = list(range(n)) + ([-1] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs: dict[int, int] = {}
        for i in range(m // 2):
            a, b = players[i], players[m - 1 - i]
            if a >= 0 and b >= 0:
                pairs[a], pairs[b] = b, a
        rounds.append(pairs)
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def _main(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="clusterkit-bw", allow_abbrev=False)
    p.add_argument("--bytes", type=int, default=4 << 20)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    n = max(1, args.bytes // 4)
    buf = torch.ones(n, dtype=torch.float32, device=device)
    dist.all_reduce(buf)  # warm-up: connections, algorithms
    sync()
    dist.barrier()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        times.append(time.perf_counter() - t0)
    # The median iteration: one descheduled iteration on a busy node must not decide.
    allreduce_s = statistics.median(times)
    # The slowest rank defines the collective's time (nccl-tests reports it that way too).
    slowest = torch.tensor([allreduce_s], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    send = torch.ones(n, dtype=torch.float32, device=device)
    recv = torch.empty(n, dtype=torch.float32, device=device)
    pairs = []
    for rnd in round_robin(world):
        dist.barrier()
        peer = rnd.get(rank)
        if peer is None:
            continue
        times = []
        for _ in range(args.iters + 1):  # the first exchange is a warm-up
            t0 = time.perf_counter()
            reqs = [dist.isend(send, peer), dist.irecv(recv, peer)]
            for r in reqs:
                if r is not None:
                    r.wait()
            sync()
            times.append(time.perf_counter() - t0)
        pairs.append({"peer": peer, "time_s": statistics.median(times[1:])})
    dist.barrier()
    dist.destroy_process_group()
    return {"event": "result", "rank": rank, "world": world, "backend": args.backend,
            "bytes": n * 4, "iters": args.iters, "allreduce_s": float(slowest.item()),
            "pairs": pairs, "elapsed_s": time.perf_counter() - t_start}


def main(argv: list[str] | None = None) -> int:
    try:
        out = _main(list(sys.argv[1:] if argv is None else argv))
    except Exception as exc:  # reported as data, like the probe
        out = {"event": "result", "fatal": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
