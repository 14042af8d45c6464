"""An ordinary accelerate script (issue 38): ``Accelerator`` with its DeepSpeed plugin
(``DeepSpeedPlugin(zero_stage=2)``), ``save_state(OUTPUT_DIR/step_N)`` every
``--save_every`` steps, and on start ``load_state`` of the newest ``step_N`` it finds.
It knows nothing of clusterkit. The batch of step S is a function of S (repeatable), and
rank 0 prints each step's loss, then ``final loss at step S: L``.

Test hooks: ``--crash_at_step N --crash_rank R --crash_once FILE`` SIGKILLs global rank R
after step N, once (FILE says it happened); ``--step_sleep S`` sleeps S seconds after each
step (time to lose a node mid-run; the numbers do not change).
"""

import argparse
import os
import re
import signal
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, set_seed


def newest_save(root):
    steps = [int(m.group(1)) for n in (os.listdir(root) if os.path.isdir(root) else [])
             for m in [re.fullmatch(r"step_(\d+)", n)] if m]
    return max(steps) if steps else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save_every", type=int, default=10)
    p.add_argument("--crash_at_step", type=int, default=0)
    p.add_argument("--crash_rank", type=int, default=1)
    p.add_argument("--crash_once", default="")
    p.add_argument("--step_sleep", type=float, default=0.0)
    args = p.parse_args()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.rand(96, 16, generator=gen),
                                          torch.rand(96, 1, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = list(loader)
    start = newest_save(args.output_dir)
    if start is not None:
        accelerator.load_state(os.path.join(args.output_dir, f"step_{start}"))
        accelerator.print(f"resumed from step_{start}")
    rank = accelerator.process_index
    loss_value = None
    for step in range((start or 0) + 1, args.steps + 1):
        x, y = batches[step % len(batches)]
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        loss_value = accelerator.reduce(loss.detach(), "mean").item()
        accelerator.print(f"step {step} loss {loss_value:.8f}")
        if step % args.save_every == 0:
            accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
        if (args.crash_at_step and step == args.crash_at_step and rank == args.crash_rank
                and not os.path.exists(args.crash_once)):
            open(args.crash_once, "w").close()
            print(f"test hook: killing rank {rank} at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_sleep)
    accelerator.print(f"final loss at step {args.steps}: {loss_value:.8f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
