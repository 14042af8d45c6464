"""A run_clm.py-style Hugging Face Trainer program, as a user runs it (issue 38).

Unmodified in what matters to clusterkit: ``HfArgumentParser`` over run_clm's argument
dataclasses and ``TrainingArguments`` (``--output_dir``, ``--deepspeed FILE``,
``--resume_from_checkpoint``, ``--save_on_each_node``, ...), ``Trainer.train(
resume_from_checkpoint=...)`` exactly as run_clm passes it. Shrunk to run on CPUs with
no hub: a GPT-2 from a tiny ``GPT2Config`` (dropout off: a resumed run's losses equal
an uninterrupted one's), a word-level tokenizer and a text made here.

Test hook (``TestArguments``): ``--crash_at_step N --crash_rank R --crash_once FILE``
kills global rank R with SIGKILL at the end of step N, once (FILE, on storage every node
sees, says it happened): a ``kill -9`` of one rank at a known step, without a race
(``--crash_how hang``: the rank hangs there instead, for a hang watchdog);
``--step_sleep S`` makes each step S seconds slower (time to destroy a node mid-run);
``--exact_losses True``: rank 0 prints each logged loss in full (``exact loss at step S:
L``, the float's repr; HF's own console line rounds to 4 digits), so a test compares the
steps a killed run logged with the same steps after its resume, exactly.
Bench hook: ``--step_times True``: rank 0 prints each step's seconds (bench/bench_hf_trainer.py).
Rank 0 ends with ``final loss at step S: L`` (the last logged training loss).
"""

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

logger = logging.getLogger(__name__)

WORDS = [
    "the", "cat", "sat", "on", "a", "mat", "while", "a", "dog", "ran", "past", "the", "old",
    "red", "barn", "and", "birds", "sang", "in", "tall", "green", "trees", "near", "the",
    "quiet", "river", "bank",
]


@dataclass
class ModelArguments:
    n_embd: int = field(default=32, metadata={"help": "GPT-2 width"})
    n_layer: int = field(default=2, metadata={"help": "GPT-2 layers"})


@dataclass
class DataTrainingArguments:
    block_size: int = field(default=32, metadata={"help": "tokens per sample"})
    text_words: int = field(default=4000, metadata={"help": "words of made-up text"})


@dataclass
class TestArguments:
    crash_at_step: int = field(default=0, metadata={"help": "test hook: SIGKILL at this step"})
    crash_rank: int = field(default=1, metadata={"help": "test hook: the rank killed"})
    crash_once: str | None = field(default=None, metadata={"help": "test hook: marker"})
    crash_how: str = field(default="kill", metadata={"help": "test hook: kill (SIGKILL) or "
                                                     "hang (the rank sleeps for an hour)"})
    step_sleep: float = field(default=0.0, metadata={"help": "test hook: seconds per step"})
    step_times: bool = field(default=False, metadata={"help": "bench hook: rank 0 prints "
                                                      "each step's seconds at the end"})
    exact_losses: bool = field(default=False, metadata={"help": "test hook: rank 0 prints "
                                                        "each logged loss in full"})


class Blocks(torch.utils.data.Dataset):
    def __init__(self, ids, block):
        self.rows = [ids[i:i + block] for i in range(0, len(ids) - block, block)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = torch.tensor(self.rows[i])
        return {"input_ids": row, "labels": row.clone()}


class StepTimes(TrainerCallback):
    """The bench hook: each training step's wall seconds, step end to step end (the first
    from the step's begin), printed by rank 0 at the end as ``step times: [...]``."""

    def __init__(self) -> None:
        self.last = 0.0
        self.times = []

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.times and not self.last:
            self.last = time.perf_counter()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now
        return control


class ExactLosses(TrainerCallback):
    """The test hook: each logged training loss in full, by rank 0."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"exact loss at step {state.global_step}: {logs['loss']!r}", flush=True)
        return control


class CrashOnce(TrainerCallback):
    """The test hook: one rank killed by SIGKILL at one step, once."""

    def __init__(self, test: TestArguments, rank: int) -> None:
        self.test, self.rank = test, rank

    def on_step_end(self, args, state, control, **kwargs):
        t = self.test
        if t.step_sleep:
            time.sleep(t.step_sleep)  # a slow step: time to lose a node mid-run
        if (t.crash_at_step and state.global_step == t.crash_at_step and self.rank == t.crash_rank
                and t.crash_once and not os.path.exists(t.crash_once)):
            with open(t.crash_once, "w") as fh:
                fh.write(f"step {state.global_step}\n")
            if t.crash_how == "hang":
                print(f"test hook: rank {self.rank} hangs at step {state.global_step}", flush=True)
                time.sleep(3600)
            print(f"test hook: killing rank {self.rank} at step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return control


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments,
                               TestArguments))
    model_args, data_args, training_args, test_args = parser.parse_args_into_dataclasses()
    # run_clm.py's logging set-up, as is
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(f"Process rank: {training_args.local_process_index}, device: "
                   f"{training_args.device}, n_gpu: {training_args.n_gpu}")
    set_seed(training_args.seed)
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(sorted(set(WORDS)))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    text = " ".join(WORDS[(i * 7 + i // 13) % len(WORDS)] for i in range(data_args.text_words))
    ids = tokenizer(text)["input_ids"]
    config = GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=model_args.n_embd,
                        n_layer=model_args.n_layer, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    rank = int(os.environ.get("RANK", "0"))
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=Blocks(ids, data_args.block_size),
                      processing_class=tokenizer, callbacks=[CrashOnce(test_args, rank)])
    timer = StepTimes()
    if test_args.step_times:
        trainer.add_callback(timer)
    if test_args.exact_losses:
        trainer.add_callback(ExactLosses())
    # run_clm.py: resume only when told
    checkpoint = None
    if training_args.resume_from_checkpoint is not None:
        checkpoint = training_args.resume_from_checkpoint
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    metrics = train_result.metrics
    trainer.log_metrics("train", metrics)
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    if rank == 0 and losses:
        print(f"final loss at step {losses[-1][0]}: {losses[-1][1]}", flush=True)
    if rank == 0 and test_args.step_times:
        print(f"step times: {[round(t, 6) for t in timer.times]}", flush=True)


if __name__ == "__main__":
    main()
