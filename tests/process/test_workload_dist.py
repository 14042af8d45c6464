"""The workload under real launchers: 2 CPU ranks (gloo), tiny model, a few steps.

Each case is a couple of short 2-rank runs (a few seconds each once DeepSpeed's
shm_comm_op is cached; the very first DeepSpeed run on a machine compiles it, ~40 s).
"Two nodes" on one machine = two ranks started directly with the environment torchrun's
agent gives a rank of a 2-node job (RANK, LOCAL_RANK 0, WORLD_SIZE 2, GROUP_RANK = the
node, LOCAL_WORLD_SIZE 1, MASTER_*): the node index is what makes them two nodes
(workload/distenv.py), and ``--ckpt-dir .../node{node}/ckpt`` gives each fake node its
own node-local dir. Until issue 37 item 6 each fake node was a torchrun agent of its own
(``--nnodes 2``): two more processes that import torch (~2.5 s of CPU each) per launch
and nothing tested that the direct start does not (on real nodes the host names differ,
so the node index never depends on GROUP_RANK there). torchrun itself still starts the
shared-storage runs and the signal runs here, where its exit code is part of the test.

CPU-work cuts of issue 37 item 6 (no check dropped): the uninterrupted reference runs
also save at step 4 and are the first run of the DeepSpeed resume cases whose
(engine, storage, stage) they share (ZeRO-3 shared via torchrun, ZeRO-2 node-local on
two fake nodes): those cases resume from a copy of that save (2 steps before the end, checked
against the run's own final weights and losses), 1 launch instead of 2;
the SIGTERM run is the resume of the SIGUSR1 run (one launch fewer): it proves that the
preempted run resumes and continues, and then the SIGTERM save and exit code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, torchrun_argv, torchrun_workload, workload_env

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

SUMMARY = "CLUSTERKIT_SUMMARY "
RUN_TIMEOUT = 240
# Small, fast, and with the cosine part of the schedule active after 2 warm-up steps.
BASE = ["--model", "tiny", "--micro-batch", "2", "--grad-accum", "2", "--warmup-steps", "2",
        "--log-every", "1", "--seed", "7", "--dist-timeout", "180"]


@dataclass
class Run:
    rc: int
    out: str

    @property
    def summary(self) -> dict[str, Any]:
        lines = [ln for ln in self.out.splitlines() if ln.startswith(SUMMARY)]
        assert len(lines) == 1, f"expected one summary line, output:\n{self.out[-4000:]}"
        data: dict[str, Any] = json.loads(lines[0][len(SUMMARY):])
        return data


def torchrun(args: list[str], cwd: Path, nproc: int = 2) -> Run:
    return Run(*torchrun_workload([*BASE, *args], cwd, nproc, RUN_TIMEOUT))


def direct_ranks(args: list[str], cwd: Path, envs: list[dict[str, str]]) -> list[Run]:
    """One ``python -m clusterkit.workload`` per rank, each with ``envs[rank]`` added."""
    procs = [subprocess.Popen([sys.executable, "-m", "clusterkit.workload", *BASE, *args],
                              cwd=cwd, env=workload_env() | extra, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for extra in envs]
    runs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        runs.append(Run(p.returncode, out))
    return runs


def fake_nodes(args: list[str], cwd: Path) -> list[Run]:
    """Two nodes of one rank each (LOCAL_RANK 0 on both): what torchrun's agents of a
    ``--nnodes 2 --nproc_per_node 1`` job export to their ranks (module docstring)."""
    port = str(free_port())
    return direct_ranks(args, cwd, [
        {"RANK": str(node), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
         "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for node in (0, 1)])


def srun_style(args: list[str], cwd: Path) -> list[Run]:
    """What a plain ``srun python -m clusterkit.workload`` provides: SLURM_* only."""
    port = str(free_port())
    return direct_ranks(args, cwd, [
        {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
         "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for rank in (0, 1)])


def _rank0(runs: list[Run]) -> Run:
    (with_summary,) = [r for r in runs if SUMMARY in r.out]
    return with_summary


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = torch.load(path)
    return data


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _load(a), _load(b)
    assert wa.keys() == wb.keys()
    diffs = {k: float((wa[k] - wb[k]).abs().max()) for k in wa}
    # Bit-exact on CPU: same data per step, fp32 master weights and optimizer state restored.
    assert all(torch.equal(wa[k], wb[k]) for k in wa), diffs


@dataclass
class Reference:
    cwd: Path  # where it ran: its checkpoints, with global_step4 (REF_SAVE_AT)
    engine: str
    storage: str
    weights: Path  # final fp32 weights (--dump-weights)
    losses: list[float]


# The reference of each ZeRO stage: (engine, storage) of its run. Each is also the first
# run of the resume case with the same (engine, storage, stage): its save at step
# REF_SAVE_AT (not 3: the one at step 6 must stay the final save, which alone writes
# --save-16bit's consolidated weights) is where that case resumes, 2 steps before the end.
REFERENCES = {2: ("deepspeed", "node-local"), 3: ("deepspeed", "shared")}
REF_SAVE_AT = 4


def _run_workload(args: list[str], cwd: Path, storage: str) -> Run:
    """Shared storage: torchrun, 2 ranks. Node-local: two fake nodes, each with its own
    checkpoint dir. Rank 0's run, both ranks having exited 0."""
    if storage == "node-local":
        runs = fake_nodes([*args, "--ckpt-dir", str(cwd / "node{node}" / "ckpt")], cwd)
        assert [r.rc for r in runs] == [0, 0], "\n".join(r.out[-2000:] for r in runs)
        return _rank0(runs)
    run = torchrun(args, cwd)
    assert run.rc == 0, run.out[-3000:]
    return run


def _workload_ckpt_dirs(cwd: Path, storage: str) -> list[Path]:
    if storage == "node-local":
        return [cwd / f"node{node}" / "ckpt" for node in (0, 1)]
    return [cwd / "clusterkit-run" / "checkpoints"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Reference]:
    """Uninterrupted 6-step runs (ZeRO-2 and ZeRO-3), final fp32 weights dumped, a save at
    step 4 kept; their losses are also stages 2 and 3 of the loss-trajectory test (xdist:
    one worker runs every test of this module, `--dist loadfile`)."""
    out: dict[int, Reference] = {}
    for stage, (engine, storage) in REFERENCES.items():
        cwd = tmp_path_factory.mktemp(f"ref{stage}")
        extra = ["--save-16bit"] if stage == 3 else []
        run = _run_workload(["--steps", "6", "--zero-stage", str(stage), "--engine", engine,
                       "--storage", storage, "--eval-every", "3", "--save-every", str(REF_SAVE_AT),
                       "--dump-weights", "w.pt", *extra], cwd, storage)
        assert run.summary["eval_loss"] is not None and run.summary["finished"] is True
        assert run.summary["checkpoint_tag"] == "global_step6"
        if stage == 3:  # consolidated weights gathered by DeepSpeed with the final save
            final = cwd / "clusterkit-run" / "checkpoints" / "global_step6"
            assert (final / "consolidated" / "pytorch_model.bin").stat().st_size > 0
            monitor = cwd / "clusterkit-run" / "monitor" / "clusterkit"
            assert (monitor / "Train_Samples_train_loss.csv").read_text().startswith("step,")
        out[stage] = Reference(cwd, engine, storage, cwd / "w.pt", run.summary["losses"])
    return out


@pytest.mark.slow
def test_zero_stages_give_the_same_loss_trajectory(tmp_path: Path,
                                                   reference: dict[int, Reference]) -> None:
    """ZeRO 0-3 on 2 ranks, same seed: identical losses (tolerance 1e-6 absolute; measured
    bit-identical). Stage 0 also exercises the plain-srun env fallback, stage 1 --ds-config;
    stages 2 and 3 are the reference runs (evaluation and the final save do not touch the
    training losses)."""
    from clusterkit.spec.zero import ZeroSpec, build_ds_config

    common = ["--steps", "6", "--no-final-save", "--resume", "never"]
    losses: dict[int, list[float]] = {}
    runs = srun_style([*common, "--zero-stage", "0", "--run-dir", "z0"], tmp_path)
    assert [r.rc for r in runs] == [0, 0], runs[0].out[-3000:]
    losses[0] = _rank0(runs).summary["losses"]
    cfg = build_ds_config(ZeroSpec(stage=1, precision="fp32", micro_batch=2, grad_accum=2,
                                   world_size=2, warmup_steps=2, total_steps=6, lr=1e-3,
                                   cos_min_ratio=0.1, torch_adam=True))
    (tmp_path / "ds1.json").write_text(json.dumps(cfg))
    run = torchrun([*common, "--ds-config", "ds1.json", "--run-dir", "z1"], tmp_path)
    assert run.rc == 0, run.out[-3000:]
    assert run.summary["zero_stage"] == 1
    losses[1] = run.summary["losses"]
    for stage in (2, 3):
        losses[stage] = reference[stage].losses
    assert len(losses[0]) == 6 and losses[0][-1] < losses[0][0]
    for stage in (1, 2, 3):
        assert losses[stage] == pytest.approx(losses[0], abs=1e-6), (stage, losses)


# Each engine, storage and stage value runs in the three default cases (every pair but
# accelerate with shared storage and accelerate with ZeRO-2); the rest of the grid is
# @extended (CLUSTERKIT_EXTENDED=1). accelerate-shared-2 (~25 s of the suite's 2 cores)
# joined the extended ones for the suite's 12 minutes: accelerate's save layout
# consolidates exactly by default in test_collect_converted.py (a real 2-rank save), and
# accelerate with ZeRO-2 resumes on the test bed (test_accelerate_testbed.py).
RESUME_CASES = [
    ("deepspeed", "shared", 3), ("deepspeed", "node-local", 2),
    pytest.param("accelerate", "shared", 2, marks=pytest.mark.extended),
    ("accelerate", "node-local", 3),
    pytest.param("deepspeed", "shared", 2, marks=pytest.mark.extended),
    pytest.param("deepspeed", "node-local", 3, marks=pytest.mark.extended),
]


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "storage", "stage"), RESUME_CASES)
def test_resume_is_bit_exact(tmp_path: Path, reference: dict[int, Reference], engine: str,
                             storage: str, stage: int) -> None:
    """Stopped mid-run, resumed, finished: the final fp32 weights and the losses of the
    steps after the resume tag equal the uninterrupted run's. Where the reference run is
    this case's own (engine, storage, stage), its save at step 4 is the first run (a copy,
    its later save removed, as a stop after step 4 leaves it); otherwise a run with
    --stop-after-steps 3."""
    ref = reference[stage]
    args = ["--steps", "6", "--zero-stage", str(stage), "--engine", engine, "--storage", storage]
    if (ref.engine, ref.storage) == (engine, storage):
        at = REF_SAVE_AT
        _copy_save(ref, tmp_path, at)
    else:
        at = 3
        first = _run_workload([*args, "--stop-after-steps", str(at)], tmp_path, storage)
        assert first.summary["checkpoint_tag"] == f"global_step{at}"
        assert first.summary["finished"] is False
        assert first.summary["losses"] == ref.losses[:at]
    if (engine, storage, stage) in MISSING_SHARD_CASES:
        _missing_shard_is_a_clear_error_not_a_fresh_start(tmp_path, args, storage,
                                                          f"global_step{at}")
    second = _run_workload([*args, "--dump-weights", "w.pt"], tmp_path, storage)
    assert second.summary["resumed_from"] == f"global_step{at}"
    assert second.summary["steps"] == 6 and second.summary["steps_run"] == 6 - at
    # Bit-exact on CPU: same data per step, fp32 master weights and optimizer state restored.
    assert second.summary["losses"] == ref.losses[at:], (second.summary["losses"], ref.losses)
    _assert_same_weights(ref.weights, tmp_path / "w.pt")
    if engine == "accelerate" and storage == "shared":
        _consolidates_to_the_live_weights(tmp_path / "clusterkit-run" / "checkpoints",
                                          "global_step6", tmp_path / "w.pt")
    if storage == "node-local":
        # Each fake node holds its own marker; node 1 has no `latest` (that is rank 0's).
        for node in (0, 1):
            tag_dir = tmp_path / f"node{node}" / "ckpt" / "global_step6"
            marker = json.loads((tag_dir / f"clusterkit-complete.node{node}.json").read_text())
            assert marker["storage"] == "node-local" and marker["num_nodes"] == 2
            assert [r["global_rank"] for r in marker["ranks"]] == [node]
        assert not (tmp_path / "node1" / "ckpt" / "latest").exists()


def _copy_save(ref: Reference, dest: Path, at: int) -> None:
    """The reference's checkpoint dirs as a stop after step ``at`` leaves them: its tag
    (with its completion marker on every node) and rank 0's `latest` naming it."""
    tag = f"global_step{at}"
    for src, dst in zip(_workload_ckpt_dirs(ref.cwd, ref.storage), _workload_ckpt_dirs(dest, ref.storage),
                        strict=True):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("global_step6"))
        assert sorted(p.name for p in dst.glob("global_step*")) == [tag]
        assert list((dst / tag).glob("clusterkit-complete.node*.json"))
        if (dst / "latest").exists():
            (dst / "latest").write_text(tag)


def _consolidates_to_the_live_weights(root: Path, tag: str, live: Path) -> None:
    """accelerate's save_state puts DeepSpeed's files in <tag>/pytorch_model/: the
    consolidation (collect-ckpt --consolidate) finds them there and equals the live model."""
    from clusterkit.checkpoints.convert.consolidate import consolidate, load_state_dict_dir

    out = consolidate(str(root), tag, ds_subdir="pytorch_model", out_dir=str(root / "fp32"))
    got, want = load_state_dict_dir(out.out_dir), _load(live)
    assert set(want) <= set(got), (sorted(want)[:5], sorted(got)[:5])
    assert all(torch.equal(got[k], v) for k, v in want.items())


# The resume cases that also check a missing shard, on a copy of their first run's save
# (one more 2-rank launch each). By default node-local (the shard missing on the other
# node's disk); the shared-storage check is the same rule (workload/ckpt.py verifies each
# rank's own files wherever they are) and rides the extended shared case (issue 37 item 6).
MISSING_SHARD_CASES = {("deepspeed", "node-local", 2), ("deepspeed", "shared", 2)}


def _missing_shard_is_a_clear_error_not_a_fresh_start(tmp_path: Path, args: list[str],
                                                      storage: str, tag: str) -> None:
    """A copy of the save with rank 1's optimizer shard deleted: every rank (node-local: each
    fake node's one rank; shared: torchrun) fails with an error naming the host, the rank
    and the file, and nothing starts from scratch."""
    broken = tmp_path / "broken"
    if storage == "node-local":
        for node in (0, 1):
            shutil.copytree(tmp_path / f"node{node}", broken / f"node{node}")
        tag_dir = broken / "node1" / "ckpt" / tag
        args = [*args, "--ckpt-dir", str(broken / "node{node}" / "ckpt")]
    else:
        shutil.copytree(tmp_path / "clusterkit-run", broken / "clusterkit-run")
        tag_dir = broken / "clusterkit-run" / "checkpoints" / tag
    shard = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.unlink()
    t0 = time.monotonic()
    runs = fake_nodes(args, broken) if storage == "node-local" else [torchrun(args, broken)]
    assert time.monotonic() - t0 < 120  # no hang
    out = "\n".join(r.out for r in runs)
    assert all(r.rc != 0 for r in runs), out[-3000:]
    assert SUMMARY not in out and "resumed from" not in out
    error = next(ln for ln in out.splitlines() if "[clusterkit] error:" in ln)
    assert f"host {socket.gethostname()}" in error
    assert "rank 1: missing" in error and str(shard) in error
    assert tag in error


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _worker_pid(launcher_pid: int, rank: int) -> int:
    for child in _children(launcher_pid):
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return child
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


def _run_until_step_then_signal(tmp_path: Path, args: list[str], sig: signal.Signals,
                                rank: int, step_line: str) -> Run:
    """torchrun, 2 ranks: once ``step_line`` is in the log, ``sig`` to one rank only."""
    log = tmp_path / f"{sig.name}.log"
    argv = torchrun_argv(["--nnodes", "1", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port())], tmp_path)
    with log.open("w") as fh:
        proc = subprocess.Popen([*argv, *BASE, *args], cwd=tmp_path, env=workload_env(), text=True,
                                stdout=fh, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT
            while step_line not in log.read_text():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.2)
            # Only ONE rank gets the signal: the all-reduced flag must stop both.
            os.kill(_worker_pid(proc.pid, rank), sig)
            rc = proc.wait(timeout=RUN_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return Run(rc, log.read_text())


# The preemption runs: ZeRO-2, a schedule far longer than the test.
SIGNAL_ARGS = ["--steps", "5000", "--zero-stage", "2"]


@dataclass
class Preempted:
    cwd: Path
    run: Run


@pytest.fixture(scope="module")
def usr1_preempted(tmp_path_factory: pytest.TempPathFactory) -> Preempted:
    """A run whose rank 1 alone got SIGUSR1 after step 3; the SIGTERM test resumes it (one
    launch for both signals' runs and the resume; a module fixture: one xdist worker)."""
    cwd = tmp_path_factory.mktemp("usr1")
    return Preempted(cwd, _run_until_step_then_signal(cwd, SIGNAL_ARGS, signal.SIGUSR1, 1,
                                                      "step 3/"))


@pytest.mark.slow
def test_sigusr1_saves_and_exits_zero(usr1_preempted: Preempted) -> None:
    run = usr1_preempted.run
    assert run.rc == 0, run.out[-3000:]
    summary = run.summary
    assert summary["preempted"] == "SIGUSR1"
    step = summary["steps"]
    assert 3 <= step < 5000 and summary["checkpoint_tag"] == f"global_step{step}"
    ckpt = usr1_preempted.cwd / "clusterkit-run" / "checkpoints" / f"global_step{step}"
    assert (ckpt / "clusterkit-complete.node0.json").exists()


@pytest.mark.slow
def test_sigusr1_run_resumes_and_sigterm_saves_and_exits_143(usr1_preempted: Preempted) -> None:
    """The SIGUSR1 run resumed from its tag and continues (its first step is the one after
    the tag's), then SIGTERM to rank 0 alone: a checkpoint, and exit code 143."""
    cwd = usr1_preempted.cwd
    preempted_at = usr1_preempted.run.summary["steps"]
    run = _run_until_step_then_signal(cwd, SIGNAL_ARGS, signal.SIGTERM, 0,
                                      f"step {preempted_at + 1}/")
    summary = run.summary
    assert summary["resumed_from"] == f"global_step{preempted_at}"
    steps = [int(m.group(1)) for m in re.finditer(r"\bstep (\d+)/5000 ", run.out)]
    assert steps[0] == preempted_at + 1, run.out[-3000:]
    assert summary["preempted"] == "SIGTERM"
    tag = summary["checkpoint_tag"]
    assert summary["steps"] > preempted_at and tag == f"global_step{summary['steps']}"
    assert (cwd / "clusterkit-run" / "checkpoints" / tag / "clusterkit-complete.node0.json"
            ).exists()
    # torchrun reports the workers' documented exit code 143 and fails itself.
    assert run.rc != 0 and "exitcode: 143" in run.out
