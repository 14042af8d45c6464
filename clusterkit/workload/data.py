"""Deterministic byte-level token stream from the bundled corpus.

The corpus (``corpus.txt``, shipped in the package) is one stream of byte tokens.
The last ``EVAL_FRACTION`` is held out for evaluation; the rest is cut into
``world_size`` contiguous, disjoint shards, one per rank. The batch for
(step, micro step, rank) is drawn from that rank's shard by a RNG seeded with
(seed, step, micro step, rank) only, so it is reproducible from the seed and a
resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources

import torch

from clusterkit.errors import ClusterkitError

EVAL_FRACTION = 0.05


def load_corpus_bytes() -> bytes:
    return resources.files("clusterkit.workload").joinpath("corpus.txt").read_bytes()


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (micro_batch, seq_len) int64
    targets: torch.Tensor


class TokenStream:
    def __init__(self, data: bytes, *, seq_len: int, world_size: int, rank: int, seed: int) -> None:
        if not 0 <= rank < world_size:
            raise ClusterkitError(f"rank {rank} outside world size {world_size}", key="rank")
        window = seq_len + 1
        # Repeat a small corpus so that every shard holds at least 4 windows; shards
        # stay disjoint ranges of the (virtual) stream.
        need = int(window * 4 * world_size / (1 - EVAL_FRACTION)) + window
        repeats = max(1, -(-need // max(1, len(data))))
        tokens = torch.frombuffer(bytearray(data * repeats), dtype=torch.uint8).to(torch.int64)
        n_eval = max(window, int(len(tokens) * EVAL_FRACTION))
        n_train = len(tokens) - n_eval
        shard = n_train // world_size
        self.train = tokens[rank * shard:(rank + 1) * shard]
        self.eval = tokens[n_train:]
        self.seq_len = seq_len
        self.rank = rank
        self.seed = seed

    def _windows(self, source: torch.Tensor, starts: list[int]) -> Batch:
        rows = torch.stack([source[s:s + self.seq_len + 1] for s in starts])
        return Batch(inputs=rows[:, :-1].contiguous(), targets=rows[:, 1:].contiguous())

    def train_batch(self, step: int, micro: int, micro_batch: int) -> Batch:
        rng = random.Random(f"train:{self.seed}:{step}:{micro}:{self.rank}")
        hi = len(self.train) - self.seq_len - 1
        return self._windows(self.train, [rng.randint(0, hi) for _ in range(micro_batch)])

    def eval_batch(self, index: int, micro_batch: int) -> Batch:
        # Every rank evaluates different windows of the shared held-out tail.
        rng = random.Random(f"eval:{self.seed}:{index}:{self.rank}")
        hi = len(self.eval) - self.seq_len - 1
        return self._windows(self.eval, [rng.randint(0, hi) for _ in range(micro_batch)])
