"""pytorch/examples' distributed/ddp-tutorial-series/multinode.py, patched only to run on
CPU (gloo instead of nccl, no device ids) and to be repeatable (a seeded dataset, the
epoch's mean loss printed by rank 0, a snapshot's epoch count that includes the epoch
saved), plus a kill-once test hook (issue 38).

As in the tutorial: rank 0 saves ``snapshot.pt`` every ``save_every`` epochs; on start
every rank loads the snapshot if the file exists. On node-local storage only rank 0's
node has it: clusterkit copies it to every node before a restart (docs/programs.md).

    torchrun ... ddp_snapshot.py TOTAL_EPOCHS SAVE_EVERY [--batch_size N]
        [--snapshot_path PATH] [--crash_at_epoch E --crash_rank R --crash_once FILE
         [--crash_how kill|hang]]
"""

import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        gen = torch.Generator().manual_seed(0)  # patched: the same data on every rank and run
        self.data = [(torch.rand(20, generator=gen), torch.rand(1, generator=gen))
                     for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")  # patched: CPU


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, crash,
                 epoch_sleep=0.0):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.crash = crash
        self.epoch_sleep = epoch_sleep
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)  # patched: no device_ids on CPU

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        losses = [self._run_batch(source, targets) for source, targets in self.train_data]
        if self.global_rank == 0:  # patched: the epoch's loss, for the test
            print(f"epoch {epoch} loss {sum(losses) / len(losses):.8f}")

    def _save_snapshot(self, epoch):
        # patched: the epochs run include this one (the tutorial stores `epoch` and runs
        # it twice after a resume, so no resumed run could end on the uninterrupted loss)
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            if self.epoch_sleep:  # patched: time for a test to lose a node mid-run
                time.sleep(self.epoch_sleep)
            at, rank, once, how = self.crash
            if at and epoch == at and self.global_rank == rank and not os.path.exists(once):
                open(once, "w").close()
                if how == "hang":  # for a hang watchdog
                    print(f"test hook: rank {rank} hangs at epoch {epoch}", flush=True)
                    time.sleep(3600)
                print(f"test hook: killing rank {rank} at epoch {epoch}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def load_train_objs():
    train_set = MyTrainDataset(512)
    torch.manual_seed(0)  # patched: the same initial weights on every run
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path, crash, epoch_sleep=0.0):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, crash,
                      epoch_sleep)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int,
                        help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--crash_at_epoch", type=int, default=0)
    parser.add_argument("--crash_rank", type=int, default=1)
    parser.add_argument("--crash_once", default="")
    parser.add_argument("--crash_how", choices=("kill", "hang"), default="kill")
    parser.add_argument("--epoch_sleep", type=float, default=0.0)
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path,
         (args.crash_at_epoch, args.crash_rank, args.crash_once, args.crash_how),
         args.epoch_sleep)
