"""A complete DeepSpeed ZeRO training script that uses clusterkit's job contract.

Run it on two nodes with ZeRO-3 and node-local checkpoints::

    clusterkit launch -i inv.yaml --nodes 2 --zero-stage 3 --storage node-local \\
        --steps 60 --job-id demo docs/examples/train.py -- --steps 60 --save-every 10

(the script's own flags go after ``--``: ``--steps`` is also a clusterkit flag, which
sizes the learning-rate schedule). Launch it again with the same ``--job-id`` and
it resumes from its newest complete checkpoint. Everything it needs comes from
clusterkit (docs/launch.md, "Your own training script"): the standard torch
variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) and ``CLUSTERKIT_DS_CONFIG`` (the
rendered ds_config.json: ZeRO stage, batch sizes, optimizer, precision),
``CLUSTERKIT_CKPT_DIR`` (this job's checkpoint dir on this node) and
``CLUSTERKIT_STORAGE``. Only the standard DeepSpeed API is used, so the
same script runs on GPUs (DeepSpeed picks the accelerator) and on CPU (gloo).

Relaunched on fewer nodes (docs/lost-a-node.md, "A user's script on fewer nodes"),
clusterkit converts the newest complete checkpoint to DeepSpeed's universal checkpoint
``<tag>_universal``, turns on ``checkpoint.load_universal`` in the ds_config and names
that tag in ``CLUSTERKIT_RESUME_TAG`` for that attempt: the script loads the tag named
there when it is set, else its own newest checkpoint that every rank finished.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

DONE = "complete.rank{rank}"  # written after every rank finished a save


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in total")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps (0: never)")
    p.add_argument("--hidden", type=int, default=64)
    # DeepSpeed's convention (`clusterkit launch --deepspeed-config-arg` passes it);
    # without it the contract's variable names the same file.
    p.add_argument("--deepspeed_config", default=os.environ.get("CLUSTERKIT_DS_CONFIG"))
    p.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher appends it
    p.add_argument("--dump-loaded-weights", default="",
                   help="after a resume, rank 0 saves the fp32 master weights here (tests)")
    return p.parse_args()


def make_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 1))


def batch(step: int, micro: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one micro-batch depends only on (step, micro, rank): a resumed run
    sees exactly the batches the uninterrupted run would have seen."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    x = torch.randn(size, 16, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x, y


def newest_complete(ckpt_dir: Path) -> str | None:
    """The tag to resume from (None: a fresh start), the same on every rank.

    ``CLUSTERKIT_RESUME_TAG`` when clusterkit sets it (a relaunch on fewer nodes: the
    universal checkpoint it converted). Else the newest step that *every* rank finished
    saving: with node-local storage each node sees only its own directory (and
    DeepSpeed's ``latest`` exists on node 0 only), so each rank lists the steps with its
    own completion marker on its node and the ranks keep the steps they all have. (The
    maximum over ranks would pick a save that a node lost with its disk never had.)
    """
    named = os.environ.get("CLUSTERKIT_RESUME_TAG")
    if named:
        return named
    mine = {int(d.name.removeprefix("step")) for d in ckpt_dir.glob("step*")
            if d.name.removeprefix("step").isdigit()
            and (d / DONE.format(rank=dist.get_rank())).is_file()}
    every: list[set[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    common = set.intersection(*(s or set() for s in every))
    return f"step{max(common)}" if common else None


def dump_fp32(engine: deepspeed.DeepSpeedEngine, path: str) -> None:
    """The fp32 master weights as DeepSpeed holds them (every rank takes part)."""
    from deepspeed.utils import safe_get_full_fp32_param

    state = {name: safe_get_full_fp32_param(p).detach().cpu().clone()
             for name, p in engine.module.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(state, path)


def save(engine: deepspeed.DeepSpeedEngine, ckpt_dir: Path, step: int) -> None:
    tag = f"step{step}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step})
    dist.barrier()  # every rank's shards are written before anyone marks the save complete
    (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
    (ckpt_dir / tag / DONE.format(rank=dist.get_rank())).write_text(f"{step}\n")
    if dist.get_rank() == 0:
        print(f"checkpoint {tag} complete", flush=True)


def main() -> None:
    args = parse_args()
    if not args.deepspeed_config:
        raise SystemExit("no DeepSpeed config: run under clusterkit launch, or pass "
                         "--deepspeed_config PATH")
    ckpt_dir = Path(os.environ.get("CLUSTERKIT_CKPT_DIR", "checkpoints"))
    deepspeed.init_distributed()
    rank = dist.get_rank()
    model = make_model(args.hidden)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config)
    start = 0
    resume = newest_complete(ckpt_dir)
    if resume is not None:
        # An explicit tag: with node-local storage `latest` is not on every node.
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=resume)
        start = int(client["step"])
        if rank == 0:
            print(f"resumed from {resume} at step {start} on {dist.get_world_size()} ranks",
                  flush=True)
        if args.dump_loaded_weights:
            dump_fp32(engine, args.dump_loaded_weights)

    size = engine.train_micro_batch_size_per_gpu()
    dtype = next(engine.parameters()).dtype  # bf16/fp16 when the ds_config says so
    loss_sum = torch.zeros(1)
    mean: float | None = None
    for step in range(start, args.steps):
        loss_sum.zero_()
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, micro, rank, size)
            x, y = x.to(engine.device, dtype), y.to(engine.device, dtype)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float().cpu()
        dist.all_reduce(loss_sum)  # the mean over ranks: the same number on every rank
        mean = loss_sum.item() / (dist.get_world_size() * engine.gradient_accumulation_steps())
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1} loss {mean:.6f}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(engine, ckpt_dir, step + 1)

    if rank == 0:
        # Optional: clusterkit launch prints this line as the job's summary.
        print("CLUSTERKIT_SUMMARY " + json.dumps({
            "final_loss": mean, "steps": args.steps,
            "resumed_from": resume,
            "steps_run": args.steps - start, "world_size": dist.get_world_size(),
            "job_id": os.environ.get("CLUSTERKIT_JOB_ID"),
            "storage": os.environ.get("CLUSTERKIT_STORAGE"), "finished": True}), flush=True)


if __name__ == "__main__":
    main()
