"""Entry point of ``python -m clusterkit.workload``: set-up, training loop, summary.

Exit codes: 0 finished (or preempted by SIGUSR1 after saving), 2 usage/config error,
3 checkpoint/resume error, 143 stopped by SIGTERM after saving a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

from clusterkit.backend_timeouts import pg_timeout_from_env
from clusterkit.checkpoints import layout
from clusterkit.errors import ClusterkitError
from clusterkit.fsutil import atomic_write_text, read_json_object
from clusterkit.node.contract import SUMMARY_PREFIX, JobDir, StorageKind
from clusterkit.spec.batch import shrink_batch
from clusterkit.spec.zero import Offload, Precision, ZeroSpec, build_ds_config, resolve_precision
from clusterkit.workload import hangs
from clusterkit.workload.args import WorkloadArgs, parse_args
from clusterkit.workload.distenv import resolve_dist_env
from clusterkit.workload.presets import ModelPreset, get_preset, peak_tflops_for

if TYPE_CHECKING:
    from clusterkit.checkpoints.universal_marker import UniversalMarker

LOG_PREFIX = "[clusterkit]"
EXIT_OK = 0
EXIT_TERM = 143  # 128 + SIGTERM: "stopped on request, checkpoint saved"
SIGNAL_CODES = {signal.SIGUSR1: 1, signal.SIGTERM: 2}
SIGNAL_NAMES = {0: None, 1: "SIGUSR1", 2: "SIGTERM"}
# The ranks agree on a stop signal every step, or every K steps when steps are short:
# K keeps the agreements about AGREE_EVERY_S apart (K = 1 for steps of that length or
# more). On 2 CPU ranks of the tiny model the per-step all-reduce cost ~2 % of the
# throughput (bench/workload.py, docs/workload.md).
AGREE_EVERY_S = 0.5
MAX_AGREE_STEPS = 100


class PreemptFlag:
    """Signal handlers only record the request; the loop agrees on it across ranks."""

    def __init__(self) -> None:
        self.code = 0

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.code = max(self.code, SIGNAL_CODES.get(signal.Signals(signum), 0))

    def install(self) -> None:
        for sig in SIGNAL_CODES:
            signal.signal(sig, self.handler)


@dataclass
class RunStats:
    steps_run: int = 0
    timed_steps: int = 0
    timed_s: float = 0.0
    final_loss: float | None = None
    eval_loss: float | None = None
    last_tag: str | None = None
    stopped_early: bool = False
    first_step_s: float = 0.0
    timed_cpu_s: float = 0.0  # rank 0 process CPU time: a load-independent cost measure
    losses: list[float] = field(default_factory=list)


def _log(rank: int, text: str) -> None:
    if rank == 0:
        print(f"{LOG_PREFIX} {text}", flush=True)


def _load_ds_config_file(path: str) -> dict[str, Any]:
    data = read_json_object(path, "ds_config", ClusterkitError)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if not isinstance(data.get(key), int):
            raise ClusterkitError("needs an integer value (\"auto\" is not resolved here)",
                                  path=path, key=key)
    return data


def _ds_config(args: WorkloadArgs, precision: str, world: int, on_gpu: bool,
               run_dir: str, node_local: bool) -> dict[str, Any]:
    if args.ds_config is not None:
        cfg = _load_ds_config_file(args.ds_config)
        cfg.setdefault("checkpoint", {})["use_node_local_storage"] = node_local
        cfg["train_batch_size"] = (cfg["train_micro_batch_size_per_gpu"]
                                   * cfg["gradient_accumulation_steps"] * world)
        if not on_gpu:
            _adapt_to_cpu(cfg, keep_precision=args.precision != "auto")
        return cfg
    # argparse `choices` (and the auto resolution) already restrict these strings.
    spec = ZeroSpec(
        stage=args.zero_stage, offload_optimizer=cast(Offload, args.offload_optimizer),
        offload_param=cast(Offload, args.offload_param), nvme_path=args.nvme_path,
        precision=cast(Precision, precision),
        micro_batch=args.micro_batch, grad_accum=args.grad_accum, world_size=world,
        clip=args.clip, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, total_steps=args.steps, cos_min_ratio=args.min_lr_ratio,
        torch_adam=not on_gpu, node_local_checkpoints=node_local,
        gather_16bit_on_save=args.save_16bit,
        csv_monitor_dir=os.path.join(run_dir, "monitor"),
        tensorboard_dir=os.path.join(run_dir, "tensorboard") if _has_tensorboard() else None)
    return build_ds_config(spec)


def _adapt_to_cpu(cfg: dict[str, Any], *, keep_precision: bool) -> None:
    """Run a config rendered for GPU nodes on a node without CUDA (fake-GPU Slurm, a laptop).

    The fused Adam kernel is a GPU optimisation; on the CPU accelerator DeepSpeed would
    JIT-compile a CPU variant first (minutes on a small machine), while torch's AdamW
    computes the same update. Mixed precision falls back to fp32 unless the user asked
    for a precision explicitly (bf16 does train on DeepSpeed's CPU path, just slowly).
    """
    optimizer = cfg.get("optimizer")
    if isinstance(optimizer, dict):
        optimizer.setdefault("params", {})["torch_adam"] = True
    if not keep_precision:
        for key in ("bf16", "fp16"):
            if isinstance(cfg.get(key), dict):
                cfg[key]["enabled"] = False


def _has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def _precision_of(cfg: dict[str, Any]) -> str:
    if cfg.get("bf16", {}).get("enabled"):
        return "bf16"
    if cfg.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank = 0
    try:
        denv = resolve_dist_env(os.environ, args.local_rank)
        rank = denv.rank
        os.environ.update(denv.exports())
        return _run(args, denv.rank, denv.local_rank, denv.world_size, denv.node_index)
    except ClusterkitError as exc:
        if rank == 0 or not getattr(exc, "collective", False):
            where = "" if rank == 0 else f"[rank {rank}] "
            print(f"{LOG_PREFIX} error: {where}{exc.one_line()}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        _shutdown_dist()


def _shutdown_dist() -> None:
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _run(args: WorkloadArgs, rank: int, local_rank: int, world: int,
         env_node: int | None) -> int:
    flag = PreemptFlag()
    flag.install()  # before the slow imports, so an early signal is not lost
    hangs.install_stack_dump(rank)  # the watchdog's stack request (SIGWINCH), issue 14
    # Nothing here compiles, but deepspeed.initialize imports DeepSpeed's Muon module,
    # whose @torch.compile decorators import inductor: 1.7 s of CPU per rank (measured,
    # torch 2.13 CPU). Disabled, torch.compile returns the function as it is. A user's
    # TORCHDYNAMO_DISABLE=0 in the job env keeps it on.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import deepspeed
    import torch

    from clusterkit.workload import ckpt
    from clusterkit.workload.data import TokenStream, load_corpus_bytes
    from clusterkit.workload.engines import AccelerateAdapter, DeepSpeedAdapter, TrainEngine
    from clusterkit.workload.model import GPT

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local_rank)
    # The launcher's CLUSTERKIT_PG_TIMEOUT_S (hang timeout + margin, issue 14) beats
    # --dist-timeout: a stopped rank then fails the others in minutes, not 30.
    pg_timeout = pg_timeout_from_env(os.environ, args.dist_timeout)
    deepspeed.init_distributed(timeout=timedelta(seconds=pg_timeout),
                               auto_mpi_discovery=False)
    host = socket.gethostname()
    topo = ckpt.build_topology(rank, local_rank, env_node, host)
    run_dir = os.path.abspath(args.run_dir)
    ckpt_dir = os.path.abspath((args.ckpt_dir or os.path.join(run_dir, "checkpoints"))
                               .format(node=topo.me.node_index, host=host))
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
    requested: str = resolve_precision(args.precision, on_gpu,  # the one rule (spec.zero)
                                       "the ranks here (no CUDA device)")
    cfg = _ds_config(args, requested, world, on_gpu, run_dir,
                     args.storage == StorageKind.NODE_LOCAL)
    precision = _precision_of(cfg)
    zero_stage = int(cfg.get("zero_optimization", {}).get("stage", 0))
    adapter = AccelerateAdapter if args.engine == "accelerate" else DeepSpeedAdapter
    ctx = ckpt.CkptContext(ckpt_dir=ckpt_dir, engine_name=args.engine, zero_stage=zero_stage,
                           precision=precision, storage=args.storage, topo=topo,
                           ds_subdir=adapter.ds_subdir)
    # Chosen before the engine exists: a universal checkpoint changes the ds_config.
    resume = ckpt.choose_and_verify(ctx, args.resume)
    if resume is not None and resume.marker is not None:
        _load_universal(cfg, resume.tag, resume.marker, world, rank)
    micro, accum = int(cfg["train_micro_batch_size_per_gpu"]), int(cfg["gradient_accumulation_steps"])
    preset = get_preset(args.model)

    torch.manual_seed(args.seed)  # identical initial weights on every rank and every stage
    model = GPT(preset)
    engine: TrainEngine
    if args.engine == "accelerate":
        trackers = ["tensorboard"] if _has_tensorboard() else []
        engine = AccelerateAdapter(model, cfg, args.weight_decay, run_dir, trackers)
    else:
        engine = DeepSpeedAdapter(model, cfg, args.weight_decay)
    _log(rank, f"engine={args.engine} model={args.model} ({preset.n_params:,} params) "
               f"world={world} nodes={topo.num_nodes} zero={zero_stage} precision={precision} "
               f"micro={micro} accum={accum} ckpt_dir={ckpt_dir} storage={args.storage}")

    resumed_from = resume.tag if resume is not None else None
    if resumed_from is not None:
        engine.load(ckpt_dir, resumed_from)
        _log(rank, f"resumed from {resumed_from} at step {engine.global_steps} "
                   f"({engine.global_samples} samples consumed)")
        if args.dump_loaded_weights:
            _dump_weights(engine, rank, args.dump_loaded_weights)
    stream = TokenStream(load_corpus_bytes(), seq_len=preset.seq_len, world_size=world,
                         rank=rank, seed=args.seed)
    loop = _Loop(args, engine, stream, ctx, flag, preset, micro, accum, world, on_gpu)
    # Nothing trained since a universal load: a final save would overwrite the source tag.
    loop.resave = resume is None or resume.marker is None
    stats, stop_code = loop.run()

    if args.dump_weights:
        _dump_weights(engine, rank, args.dump_weights)
    if isinstance(engine, AccelerateAdapter):
        engine.end()
    summary = _summary(args, engine, stats, resumed_from, world, zero_stage, precision,
                       preset, micro, accum, stop_code, on_gpu, topo.num_nodes)
    if rank == 0:
        # The file is the summary to read back: a console line can arrive cut (srun
        # --label splits long lines at its message boundaries; torchrun's tee at a read).
        atomic_write_text(os.path.join(run_dir, JobDir.SUMMARY),
                          json.dumps(summary, sort_keys=True, indent=1) + "\n")
        print(SUMMARY_PREFIX + json.dumps(summary, sort_keys=True), flush=True)
    return EXIT_TERM if stop_code == 2 else EXIT_OK


def _load_universal(cfg: dict[str, Any], tag: str, marker: UniversalMarker, world: int,
                    rank: int) -> None:
    """DeepSpeed reads ``checkpoint.load_universal`` at ``initialize``; on another world
    size the batch split follows spec/batch.py (--micro-batch/--grad-accum overridden)."""
    cfg.setdefault("checkpoint", {})["load_universal"] = True
    source = f"resuming {marker.source_tag} ({marker.world_size} ranks) from {tag}"
    if marker.world_size == world:
        _log(rank, f"{source} on the same {world} ranks")
        return
    plan = shrink_batch(marker.world_size, marker.micro_batch, marker.grad_accum, world)
    cfg["train_micro_batch_size_per_gpu"] = plan.micro
    cfg["gradient_accumulation_steps"] = plan.grad_accum
    cfg["train_batch_size"] = plan.global_batch
    _log(rank, f"{source} on {world} ranks: {plan.note}")


def _dump_weights(engine: Any, rank: int, path: str) -> None:
    state = engine.full_fp32_state_dict()  # collective
    if rank == 0:
        _save_torch_atomic(state, path)


def _save_torch_atomic(obj: Any, path: str) -> None:
    import torch

    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


class _Loop:
    """The training loop proper; split out so each piece stays short."""

    def __init__(self, args: WorkloadArgs, engine: Any, stream: Any, ctx: Any,
                 flag: PreemptFlag, preset: ModelPreset, micro: int, accum: int, world: int,
                 on_gpu: bool) -> None:
        import torch

        self.args, self.engine, self.stream, self.ctx, self.flag = args, engine, stream, ctx, flag
        self.preset, self.micro, self.accum, self.world = preset, micro, accum, world
        self.rank = ctx.topo.me.global_rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.samples_per_step = micro * accum * world
        self.flops_per_step = preset.train_flops_per_token() * preset.seq_len * self.samples_per_step
        self.peak = args.peak_tflops or (
            peak_tflops_for(torch.cuda.get_device_name()) if on_gpu else None)
        self.on_gpu = on_gpu
        self.stats = RunStats()
        self.heartbeat = hangs.Heartbeat(self.rank)
        # Seconds per step between the last two agreements: their wait syncs the GPU, so
        # this is real time even where a single step's timing is not.
        self._agreed_step_s: float | None = None
        self._last_agreed: tuple[int, float] | None = None  # (step, time) of the last one
        self.resave = True  # the final save even when this invocation ran no step

    def _start_agree(self) -> tuple[Any, Any]:
        """Start the stop-signal all-reduce for this step without waiting for it.

        Issued before the step's own collectives (same order on every rank), it runs
        beside the forward/backward pass; the step's end only collects the result, so
        agreeing on a signal costs no extra round trip on the critical path. It also
        carries this rank's proposal for the number of steps until the next agreement:
        MAX over ``[signal, -proposal]`` gives every rank the same signal and the same,
        smallest, interval."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([self.flag.code, -self._agree_proposal()], dtype=torch.int32,
                         device=self.device)
        return t, dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)

    def _agree_proposal(self) -> int:
        if not self._agreed_step_s:
            return 1
        return max(1, min(MAX_AGREE_STEPS, int(AGREE_EVERY_S / self._agreed_step_s)))

    def _agree_signal(self, pending: tuple[Any, Any], done: int) -> tuple[int, int]:
        """(the agreed stop signal, steps until the next agreement)."""
        t, work = pending
        work.wait()
        code, neg_steps = (int(x) for x in t.tolist())
        now = time.perf_counter()
        if self._last_agreed is not None and done > self._last_agreed[0]:
            self._agreed_step_s = (now - self._last_agreed[1]) / (done - self._last_agreed[0])
        self._last_agreed = (done, now)
        return code, -neg_steps

    def _mean(self, value: Any) -> float:
        import torch.distributed as dist

        t = value.detach().float().reshape(1).clone()
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def run(self) -> tuple[RunStats, int]:
        start = self.engine.global_steps
        stop_code = 0
        window_s, window_steps = 0.0, 0
        next_agree = start + 1
        for step in range(start, self.args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            done = step + 1
            # A tiny all-reduce on agreed steps (every step, or ~AGREE_EVERY_S apart): all
            # ranks stop on the same step even if only one got the signal (a signal is
            # acted on at the end of the next agreed step). Its result also syncs the
            # GPU: a logged step and the last one always agree, so every logged window
            # and the run's total time are real even where a single step's is not.
            agree = done >= next_agree or done % self.args.log_every == 0 \
                or done == self.args.steps
            pending = self._start_agree() if agree else None
            batches = [self.stream.train_batch(step, m, self.micro) for m in range(self.accum)]
            loss = self.engine.train_step(batches)
            if pending is not None:
                stop_code, every = self._agree_signal(pending, done)
                next_agree = done + every
            step_s = time.perf_counter() - t0
            self.heartbeat.beat(done)  # progress for the launcher's watchdog
            self._account(step_s, time.process_time() - c0, first=step == start)
            window_s, window_steps = window_s + step_s, window_steps + 1
            time_boxed = bool(self.args.stop_after_steps and done < self.args.steps
                              and self.stats.steps_run >= self.args.stop_after_steps)
            if done % self.args.log_every == 0 or done == self.args.steps or stop_code or time_boxed:
                self._progress(done, self._mean(loss), window_s, window_steps)
                window_s, window_steps = 0.0, 0
            if self.args.eval_every and done % self.args.eval_every == 0:
                self._evaluate(done)
            if stop_code or time_boxed or (self.args.save_every
                                           and done % self.args.save_every == 0):
                self._save(done)
            if stop_code:
                _log(self.rank, f"{SIGNAL_NAMES[stop_code]} received: saved {self.stats.last_tag}, "
                                "exiting")
                break
            if time_boxed:
                self.stats.stopped_early = True
                _log(self.rank, f"--stop-after-steps reached: saved {self.stats.last_tag}, exiting")
                break
        if (self.args.save_final and not stop_code and not self.stats.stopped_early
                and (self.resave or self.stats.steps_run)
                and self.stats.last_tag != layout.step_tag(self.engine.global_steps)):
            self._save(self.engine.global_steps, final=True)
        return self.stats, stop_code

    def _account(self, seconds: float, cpu_seconds: float, *, first: bool) -> None:
        self.stats.steps_run += 1
        # The first step of an invocation pays for warm-up (allocation, comm set-up);
        # keep it out of the averages unless it is the only step.
        if first:
            self.stats.first_step_s = seconds
            return
        self.stats.timed_s += seconds
        self.stats.timed_cpu_s += cpu_seconds
        self.stats.timed_steps += 1

    def _progress(self, done: int, loss: float, seconds: float, steps: int) -> None:
        self.stats.final_loss = loss
        self.stats.losses.append(loss)
        sps = self.samples_per_step * steps / max(seconds, 1e-9)
        line = (f"step {done}/{self.args.steps} | loss {loss:.4f} | lr {self.engine.lr():.3e} | "
                f"{sps * self.preset.seq_len:,.0f} tok/s | {sps:,.2f} samples/s")
        if self.on_gpu:
            tflops = self.flops_per_step * steps / max(seconds, 1e-9) / 1e12 / self.world
            line += f" | {tflops:.1f} TFLOP/s/GPU"
            if self.peak:
                line += f" | MFU {100 * tflops / self.peak:.1f}%"
        _log(self.rank, line)
        self.engine.monitor_events([("Train/Samples/train_loss", loss, self.engine.global_samples)])
        if hasattr(self.engine, "log"):
            self.engine.log({"train/loss": loss, "train/lr": self.engine.lr()}, step=done)

    def _evaluate(self, done: int) -> None:
        import torch

        # no_grad, not inference_mode: ZeRO-3 re-partitions parameters in hooks that
        # must be allowed to modify them.
        with torch.no_grad():
            losses = [self.engine.eval_loss(self.stream.eval_batch(i, self.micro))
                      for i in range(self.args.eval_batches)]
        value = self._mean(torch.stack(losses).mean())
        self.stats.eval_loss = value
        self.engine.monitor_events([("Eval/Samples/loss", value, self.engine.global_samples)])
        _log(self.rank, f"eval step {done} | loss {value:.4f}")

    def _save(self, done: int, final: bool = False) -> None:
        from clusterkit.workload import ckpt

        tag = layout.step_tag(done)
        t0 = time.perf_counter()
        ckpt.save(self.ctx, self.engine, tag, save_16bit=self.args.save_16bit and final)
        self.stats.last_tag = tag
        _log(self.rank, f"checkpoint {tag} complete in {time.perf_counter() - t0:.2f}s "
                        f"({os.path.join(self.ctx.ckpt_dir, tag)})")


def _summary(args: WorkloadArgs, engine: Any, stats: RunStats, resumed_from: str | None,
             world: int, zero_stage: int, precision: str, preset: ModelPreset, micro: int,
             accum: int, stop_code: int, on_gpu: bool, num_nodes: int) -> dict[str, Any]:
    samples_per_step = micro * accum * world
    steps, secs = stats.timed_steps, stats.timed_s
    if steps == 0:
        steps, secs = stats.steps_run, stats.first_step_s
    sps = samples_per_step * steps / secs if secs > 0 else None
    out: dict[str, Any] = {
        "steps": engine.global_steps, "steps_run": stats.steps_run,
        "final_loss": stats.final_loss, "eval_loss": stats.eval_loss,
        "samples_per_s": sps, "tokens_per_s": sps * preset.seq_len if sps else None,
        "checkpoint_tag": stats.last_tag, "resumed_from": resumed_from,
        "world_size": world, "nodes": num_nodes, "zero_stage": zero_stage,
        "precision": precision, "engine": args.engine, "model": preset.name,
        "n_params": preset.n_params, "storage": args.storage,
        "preempted": SIGNAL_NAMES[stop_code], "stopped_early": stats.stopped_early,
        "finished": engine.global_steps >= args.steps, "losses": stats.losses,
        "cpu_s_per_step": stats.timed_cpu_s / stats.timed_steps if stats.timed_steps else None,
    }
    if on_gpu and sps:
        tflops = preset.train_flops_per_token() * preset.seq_len * sps / 1e12 / world
        out["tflops_per_gpu"] = tflops
        peak = args.peak_tflops
        if peak is None:
            import torch

            peak = peak_tflops_for(torch.cuda.get_device_name())
        out["mfu"] = tflops / peak if peak else None
    return out
