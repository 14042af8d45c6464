"""A user's own DeepSpeed script for the Slurm tests (not the bundled workload).

It follows the job contract of docs/launch.md ("Your own training script") and the
preemption contract of docs/sbatch.md ("Preemption"): it asserts that every rank
got the standard torch variables and the ``CLUSTERKIT_*`` ones, trains with
``$CLUSTERKIT_DS_CONFIG``, resumes from the newest tag every rank finished, and on
SIGUSR1 or ``$CLUSTERKIT_STOP_FILE`` saves and exits 0. ``--ignore-stop``: a script
that does none of that (it trains to the end). ``--hold-after N``: a fresh run (not a
resumed one) waits after step N until the stop request arrives, so a preemption test
needs no sleeping steps to be sure the request lands mid-run. The data of a step depends only on
the step, so every launcher and every resume ends on the same loss.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

STANDARD = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CONTRACT = ("CLUSTERKIT_JOB_ID", "CLUSTERKIT_JOB_DIR", "CLUSTERKIT_DS_CONFIG",
            "CLUSTERKIT_CKPT_DIR", "CLUSTERKIT_STORAGE", "CLUSTERKIT_STOP_FILE")
stop_requested = False


def on_usr1(signum: int, frame: object) -> None:
    global stop_requested
    stop_requested = True


def check_env() -> None:
    missing = [k for k in (*STANDARD, *CONTRACT) if not os.environ.get(k)]
    assert not missing, f"missing contract variables: {missing}"
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    assert 0 <= local < local_world <= world and 0 <= rank < world, os.environ
    assert Path(os.environ["CLUSTERKIT_DS_CONFIG"]).is_file()


def newest_complete(ckpt: Path) -> int:
    """The newest step every rank finished saving (-1: none), the same on every rank:
    each rank lists the steps with its own completion mark (with node-local storage a
    node sees only its own directory), and the ranks keep the steps they all have. The
    maximum over ranks would pick a save that a node lost with its disk never had."""
    mine = {int(d.name[4:]) for d in ckpt.glob("step*")
            if d.name[4:].isdigit() and (d / f"complete.rank{dist.get_rank()}").is_file()}
    every: list[set[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    common = set.intersection(*(s or set() for s in every))
    return max(common, default=-1)


def hold_for_stop(stop_file: Path, limit_s: float = 300.0) -> None:
    """Wait until this rank sees the stop request (its signal or the stop file)."""
    deadline = time.monotonic() + limit_s
    while not (stop_requested or stop_file.exists()) and time.monotonic() < deadline:
        time.sleep(0.1)


def save(engine: deepspeed.DeepSpeedEngine, ckpt: Path, step: int) -> None:
    engine.save_checkpoint(str(ckpt), tag=f"step{step}", client_state={"step": step})
    dist.barrier()
    (ckpt / f"step{step}" / f"complete.rank{dist.get_rank()}").write_text(f"{step}\n")
    if dist.get_rank() == 0:
        print(f"saved step{step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--ignore-stop", action="store_true")
    p.add_argument("--hold-after", type=int, default=0)
    p.add_argument("--silent-start", type=float, default=0.0)  # a long op build, printing nothing
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    check_env()
    if not args.ignore_stop:
        signal.signal(signal.SIGUSR1, on_usr1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=os.environ["CLUSTERKIT_DS_CONFIG"])
    if args.silent_start:
        if rank == 0:
            print(f"silent start: {args.silent_start:g} s", flush=True)
        time.sleep(args.silent_start)
    ckpt = Path(os.environ["CLUSTERKIT_CKPT_DIR"])
    stop_file = Path(os.environ["CLUSTERKIT_STOP_FILE"])
    start, resume = 0, newest_complete(ckpt)
    if resume >= 0:
        _, client = engine.load_checkpoint(str(ckpt), tag=f"step{resume}")
        start = int(client["step"])
        if rank == 0:
            print(f"resumed from step{resume}", flush=True)
    size = engine.train_micro_batch_size_per_gpu()
    mean = None
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(size, 8, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True).sin())
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        mean = total.item() / dist.get_world_size()
        if rank == 0:
            print(f"step {step + 1} loss {mean:.6f}", flush=True)
        time.sleep(args.step_sleep)
        if args.save_every and (step + 1) % args.save_every == 0:
            save(engine, ckpt, step + 1)
        if resume < 0 and step + 1 == args.hold_after:
            hold_for_stop(stop_file)
        # Every rank must stop on the same step: agree on the request.
        asked = torch.tensor([int(not args.ignore_stop and (stop_requested or stop_file.exists()))])
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        if asked.item() and step + 1 < args.steps:
            save(engine, ckpt, step + 1)
            if rank == 0:
                print(f"stop requested: saved step{step + 1}, exiting", flush=True)
            return
    if rank == 0:
        print("CLUSTERKIT_SUMMARY " + json.dumps({
            "final_loss": round(mean, 6) if mean is not None else None, "steps": args.steps,
            "resumed_from": f"step{resume}" if resume >= 0 else None,
            "world_size": dist.get_world_size(), "finished": True}), flush=True)


if __name__ == "__main__":
    main()
    # torch 2.13's gloo can abort a rank at interpreter exit after a complete run (exit 134:
    # docs/launch.md's errors table, tests/helpers.EXIT_ABORT; about 1 run in 12 of 3 ranks,
    # and this job's preemption test has two runs of 4): the work is done and saved here,
    # so the script skips that finalization, as the table advises a user's script to.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
