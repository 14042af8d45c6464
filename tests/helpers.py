"""Helpers shared by several test modules (one place: no test module imports from another).

Sections: doctor rules' synthetic fact sets; ``clusterkit launch`` on the namespace
test bed (a sleeping rank script, the job's pids, reading the launcher's output);
the bundled workload trained on the test bed; ``clusterkit sbatch`` on the Slurm test bed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.checks.facts import NodeFacts, StorageFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.gpu_topology import GpuInfo
from clusterkit.checks.infiniband import IBPort
from clusterkit.checks.rules_base import DoctorContext, GiB
from clusterkit.launch.fromplan import job_from_plan
from clusterkit.launch.registry import Registry
from clusterkit.launch.run import _record
from clusterkit.launchers.base import DoctorMode
from clusterkit.spec.jobrecord import JobState
from tests.paths import REPO
from tests.render_cases import plan_for

if TYPE_CHECKING:
    from tests.slurmbed import SlurmBed
    from tests.testbed.core import Testbed


# ------------------------------------------------------------------ doctor rules (synthetic facts)

HOSTS = tuple(f"node{i}" for i in range(1, 8))
PY = "/opt/venv/bin/python"
ADDR = {h: f"10.0.0.{i}" for i, h in enumerate(HOSTS, start=1)}
H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", "535.104.05", 81559)


def node(host: str) -> NodeFacts:
    """A healthy 2-GPU node that sees every peer over eth0."""
    return NodeFacts(
        host=host, hostname=host, time=1000.0, python_executable=PY, python_version="3.11.7",
        workdir="/srv/train", workdir_exists=True, workdir_writable=True,
        versions={"torch": "2.4.0", "deepspeed": "0.14.4", "accelerate": "0.33.0",
                  "transformers": "4.44.0", "ninja": "1.11.1", "numpy": "1.26.4"},
        torch_cuda="12.1", nccl_version="2.20.5",
        freeze=("deepspeed==0.14.4", "ninja==1.11.1", "torch==2.4.0"),
        tools={"ninja": "/opt/venv/bin/ninja", "pdsh": "/usr/bin/pdsh"},
        cuda_home="/usr/local/cuda", cuda_home_exists=True, nvcc="/usr/local/cuda/bin/nvcc",
        libcudart="/usr/local/cuda/lib64/libcudart.so.12", nvidia_smi="/usr/bin/nvidia-smi",
        gpus=(H100, replace(H100, index=1)),
        ib_ports=(IBPort("mlx5_0", 1, "ACTIVE", "LinkUp", "InfiniBand", 200.0),),
        storage=(StorageFacts("/ckpt", True, True, 500 * GiB, 1000 * GiB),),
        shm_total_bytes=64 * GiB, nofile_soft=1048576, self_name=host,
        forward={h: (ADDR[h],) for h in HOSTS},
        reverse={a: h for h, a in ADDR.items()},
        interfaces={"lo": ("127.0.0.1",), "eth0": (ADDR[host],)},
        routes={a: "eth0" for h, a in ADDR.items() if h != host},
        env={"NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0"},
    )


CTX = DoctorContext(hosts=HOSTS, slots={h: 2 for h in HOSTS}, gpus={h: 2 for h in HOSTS},
                    backend=DoctorMode.HEAD_PDSH, head_tools={"pdsh": "/usr/bin/pdsh"}, head_python=PY,
                    checkpoint_bytes=100 * GiB)


def cluster(**bad: object) -> dict[str, NodeFacts]:
    """Seven healthy nodes with ``bad`` fields replaced on node7."""
    facts = {h: node(h) for h in HOSTS}
    facts["node7"] = replace(facts["node7"], **bad)  # type: ignore[arg-type]
    return facts


def only_node7(findings: list[Finding], check_prefix: str) -> Finding:
    """Assert exactly node7 is flagged for this check and everybody else passed; return it."""
    mine = [f for f in findings if f.check.startswith(check_prefix)]
    bad = [f for f in mine if f.status is not Status.PASS]
    assert [f.host for f in bad] == ["node7"], [(f.host, f.detail) for f in bad]
    assert {f.host for f in mine if f.status is Status.PASS} >= set(HOSTS[:6])
    return bad[0]


# ------------------------------------------------------------------ launch on the test bed

SLEEPER = textwrap.dedent("""
    import os, sys, time
    print(f"ready rank {os.environ['RANK']}", flush=True)
    time.sleep(300)
""")

# Runs inside a node: the pids of this job's processes (optionally of one rank).
FIND = textwrap.dedent("""
    import json, os, sys
    job, rank = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            env = dict(x.split("=", 1) for x in open(f"/proc/{p}/environ").read().split("\\0") if "=" in x)
        except OSError:
            continue
        is_rank = env.get("RANK") == rank and "LOCAL_RANK" in env
        if env.get("CLUSTERKIT_JOB_ID") == job and (rank is None or is_rank):
            out.append(int(p))
    print(json.dumps(out))
""")


def job_pids(tb: Testbed, node: str, job: str, rank: int | None = None) -> list[int]:
    args = [sys.executable, "-c", FIND, job] + ([str(rank)] if rank is not None else [])
    res = tb.exec(node, args, timeout=30)
    assert res.returncode == 0, res.stderr
    return list(json.loads(res.stdout))


def gone_everywhere(tb: Testbed, nodes: Sequence[str], job: str) -> bool:
    return all(not job_pids(tb, n, job) for n in nodes)


def start_launch(inv: Path, job: str, extra: Sequence[str], env: dict[str, str], cwd: Path
            ) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id", job,
            "--grace", "2", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd, start_new_session=True)


def kill9_then_wait(tb: Testbed, proc: subprocess.Popen[str], node: str, victim: int,
                     nodes: Sequence[str], job: str, limit_s: float, seen: list[str]) -> None:
    """kill -9 ``victim`` on ``node``; the launcher exits and, within ``limit_s`` of the
    kill, no process of ``job`` is left on any node. Ctrl-C's the launcher if it hangs."""
    try:
        killed_at = time.monotonic()
        tb.exec(node, ["kill", "-9", str(victim)])
        out, _ = proc.communicate(timeout=60)
        seen.append(out)
        while not gone_everywhere(tb, nodes, job):
            assert time.monotonic() - killed_at < limit_s, f"processes left {limit_s} s after the kill"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)


def read_until(proc: subprocess.Popen[str], want: int, pattern: str, timeout: float,
                seen: list[str]) -> None:
    """Read lines until ``want`` lines contain ``pattern``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    hits = 0
    for line in proc.stdout:
        seen.append(line)
        hits += pattern in line
        if hits >= want:
            return
        assert time.monotonic() < deadline, "".join(seen[-30:])
    raise AssertionError("launcher ended early:\n" + "".join(seen[-40:]))


# ------------------------------------------------------------ the workload under torchrun on this machine

# torchrun's own variables: a test's environment must not leak a rank into its workers.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "CROSS_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
               "SLURM_NODEID", "NODE_RANK")

# A user's HF Trainer program (run_clm.py-style, tests/programs/hf_trainer.py) and the
# all-"auto" ZeRO-2 ds_config of HF's docs that the issue 38 tests and bench give it.
HF_TRAINER = REPO / "tests" / "programs" / "hf_trainer.py"
HF_DS_AUTO = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun_argv(extra: list[str], cwd: Path) -> list[str]:
    """``python -m torch.distributed.run EXTRA -m clusterkit.workload``; --log-dir: without
    it every run leaves a /tmp/torchelastic_* directory behind."""
    return [sys.executable, "-m", "torch.distributed.run", f"--log-dir={cwd}/torchelastic",
            *extra, "-m", "clusterkit.workload"]


def torchrun_workload(args: Sequence[str], cwd: Path, nproc: int, timeout: float
                      ) -> tuple[int, str]:
    """One machine, ``nproc`` CPU ranks: (exit code, stdout + stderr)."""
    argv = torchrun_argv(["--nnodes", "1", "--nproc_per_node", str(nproc), "--master_addr",
                          "127.0.0.1", "--master_port", str(free_port())], cwd)
    proc = subprocess.run([*argv, *args], cwd=cwd, env=workload_env(), capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


# torch 2.13's gloo: a work thread that frees the last AsyncWork (DDP's final allreduce) while
# the interpreter finalizes takes the GIL, is told to exit, and the forced unwind crosses a
# noexcept frame: SIGABRT after the program's last line (gdb: ProcessGroupGloo::runLoop ->
# ~AsyncWork -> take_gil -> pthread_exit; pytorch PR 179291). About 1 run in 12 of a 3-rank
# DDP program here, whatever the program does before exit.
EXIT_ABORT = "terminate called without an active exception"


def torchrun_exit_abort(text: str) -> bool:
    """torchrun's output shows a rank ended by that abort (SIGABRT, exit code -6): with a
    complete output (the caller checks), the work is done; the exit status is torch's."""
    return EXIT_ABORT in text and "exitcode  : -6" in text


def reference_run(argv: Sequence[str], cwd: Path, complete: Callable[[str], bool],
                  timeout: float = 600) -> str:
    """An uninterrupted reference run's output. What is compared is what it printed, so a
    rank that aborted at interpreter exit after a complete output (EXIT_ABORT, nothing
    else wrong) still gives the reference; any other failure is the test's failure."""
    proc = subprocess.run(list(argv), cwd=cwd, env=workload_env(), capture_output=True,
                          text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 or torchrun_exit_abort(text), text[-3000:]
    assert complete(text), text[-3000:]
    return text


# ------------------------------------------------------------------ the workload trained on the test bed

CKPT_DONE = re.compile(r"checkpoint (global_step\d+) complete")
RANK_LABEL = re.compile(r"^\[node\d+ r(\d+)\] ")


@dataclass
class Run:
    code: int
    text: str
    summary: dict[str, Any]


def train_argv(inv: Path, job: str, backend: str, n: int, g: int, storage: str, steps: int,
          extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id", job,
            "--launcher", backend, "--nodes", str(n), "--gpus-per-node", str(g),
            "--storage", storage, "--steps", str(steps), "--grace", "2", "--skip-checks", *extra]


def train_env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1")


class Console:
    """A launcher's merged output, read on a thread (a full pipe would stall the job)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Path) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=cwd, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str,
                 poll: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.proc.poll() is None, f"launcher ended before {what}:\n{self.text[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s:\n{self.text[-4000:]}"
            time.sleep(poll)

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(30)
        self._reader.join(10)
        return code


Wait = tuple[Callable[[], bool], float, str]  # (condition, seconds, what: for the failure)


def lose_node_mid_run(tb: Testbed, run: Console, node: str, waits: Sequence[Wait], timeout: float,
                      before_loss: Callable[[], object] | None = None,
                      after_loss: Callable[[], object] | None = None) -> int:
    """Wait on ``run`` for each of ``waits`` in turn (a save, its copies on the ring),
    call ``before_loss``, destroy ``node`` while the job runs, call ``after_loss`` (what
    the test does to the attempts after the loss), and wait up to ``timeout`` s for the
    launcher to end: its exit code. On any failure the launcher is stopped too."""
    try:
        for cond, limit, what in waits:
            run.wait_for(cond, limit, what)
        if before_loss is not None:
            before_loss()
        tb.destroy(node)
        if after_loss is not None:
            after_loss()
        return run.finish(timeout=timeout)
    except BaseException:
        run.finish(timeout=1)
        raise



def went_on_with_fewer(code: int, text: str, lost: str) -> str:
    """A launch that lost ``lost`` with no spare ended 0 after going on with fewer nodes:
    the console from that line on (what the resharded attempts printed)."""
    assert code == 0, text[-6000:]
    assert f"no spare for {lost}" in text and "going on with fewer nodes" in text, text[-6000:]
    return text.split("going on with fewer nodes", 1)[1]


def replicated_everywhere(text: str, tag: str, nodes: int) -> None:
    """The launch's last ``checkpoints replicated:`` line lists ``tag`` and every tag it
    lists has all ``nodes`` copies (a tag a reshard converted inside itself included:
    node/replicas/done.py judges it by its conversion's files)."""
    lines = re.findall(r"checkpoints replicated: (.*)", text)
    counts = lines[-1].split(", ") if lines else []
    assert f"{tag} {nodes}/{nodes}" in counts, (lines, text[-6000:])
    assert all(c.endswith(f" {nodes}/{nodes}") for c in counts), lines


def workload_summary(text: str) -> dict[str, Any]:
    """The bundled workload's last ``CLUSTERKIT_SUMMARY {json}`` line (after any prefix:
    a batch log's srun label)."""
    lines = [ln for ln in text.splitlines() if "CLUSTERKIT_SUMMARY " in ln]
    assert lines, text[-4000:]
    value = json.loads(lines[-1].split("CLUSTERKIT_SUMMARY ", 1)[1])
    assert isinstance(value, dict)
    return value


def snapshot_tag(tb: Testbed, nodes: Sequence[str], job: str, tag: str, dest: Path,
                 local: str = "ckpt") -> Path:
    """Every node's files of ``tag`` (node-local ``<local>/<job>/<tag>``; ``local``: the
    inventory's ``checkpoint.local_dir`` under the node-local dir) gathered on the host
    (file copies, no clusterkit code), to consolidate what a node lost later held: the
    first node's first, so the model states file shared by ZeRO 0-2 is rank 0's, as
    collect-ckpt picks it."""
    import shutil

    for name in nodes:
        src = tb.node_local_path(name, f"{local}/{job}/{tag}")
        for f in sorted(src.rglob("*")):
            target = dest / tag / f.relative_to(src)
            if f.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
    return dest


def train(tb: Testbed, tmp_path: Path, job: str, backend: str, n: int, g: int, storage: str,
           steps: int, extra: Sequence[str] = (), timeout: float = 300) -> Run:
    inv = tb.write_inventory(tmp_path / f"{job}.yaml", nodes=[x.name for x in tb.ensure(n)], slots=g)
    proc = subprocess.run(train_argv(inv, job, backend, n, g, storage, steps, extra),
                          capture_output=True, text=True, env=train_env(tmp_path), cwd=tmp_path,
                          timeout=timeout)
    text = proc.stdout + proc.stderr
    return Run(proc.returncode, text, workload_summary(text) if proc.returncode == 0 else {})


def rank_pid(job: str, rank: int) -> int | None:
    """The host pid of one rank of ``job`` (node PID namespaces are visible from the host)."""
    want = {b"CLUSTERKIT_JOB_ID=" + job.encode(), b"RANK=" + str(rank).encode()}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = set(Path(f"/proc/{name}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= env and any(x.startswith(b"LOCAL_RANK=") for x in env):
            return int(name)
    return None


def replica_manifests(tb: Testbed, ring: Sequence[str], job: str, tag: str,
                      local: str = "ckpt") -> list[Path]:
    """Host paths of every node's copy manifest of ``tag`` (K = 1) on its ring successor,
    under the node-local dir's ``local`` (the inventory's ``checkpoint.local_dir``)."""
    from clusterkit.node.contract import REPLICA_MANIFEST

    return [tb.node_local_path(ring[(i + 1) % len(ring)],
                               f"{local}/{job}.replicas/node{i}/{tag}/{REPLICA_MANIFEST}")
            for i in range(len(ring))]


def assert_trained(run: Run, steps: int, world: int) -> None:
    assert run.code == 0, run.text[-4000:]
    s = run.summary
    assert s["finished"] and s["steps"] == steps and s["world_size"] == world, s
    assert isinstance(s["final_loss"], float)
    # every rank's lines carry their label, whatever the launcher
    ranks = {int(m.group(1)) for ln in run.text.splitlines() if (m := RANK_LABEL.match(ln))}
    assert 0 in ranks, run.text[-2000:]


# ------------------------------------------------------------------ shared runs

# Every step of a 14-rank ZeRO-3 run costs ~4 s on this 2-core machine: three steps
# show training as well as six did.
SHARED_7X2_STEPS = 3
# key -> (launcher, storage, ZeRO stage). The node-local ones dump their weights for
# test_collect_testbed.py (ZeRO-2 and ZeRO-3 collect + consolidate).
SHARED_7X2: dict[str, tuple[str, str, int]] = {
    "native": ("native", "node-local", 2),
    "deepspeed": ("deepspeed", "node-local", 3),
    "accelerate": ("accelerate", "shared", 2),
}


@dataclass
class Launched:
    """One launched job shared by several tests of a module (a module fixture)."""

    run: Run
    wall: float
    job: str
    storage: str
    zero_stage: int
    weights: Path | None  # the workload's --dump-weights file (shared dir), if asked for


def launch_7x2(tb: Testbed, tmp_path: Path, key: str) -> Launched:
    backend, storage, stage = SHARED_7X2[key]
    job = f"b7-{key}"
    extra = ["--zero-stage", str(stage)]
    weights = None
    if storage == "node-local":
        weights = tb.shared_dir / f"{job}-weights.pt"
        extra += ["--set-env", f"CLUSTERKIT_DUMP_WEIGHTS={weights}"]
    started = time.monotonic()
    run = train(tb, tmp_path, job, backend, 7, 2, storage, SHARED_7X2_STEPS, extra)
    return Launched(run, time.monotonic() - started, job, storage, stage, weights)


# ------------------------------------------------------------------ sbatch on the Slurm test bed

IN_PROGRESS = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING")


def slurm_job_dir(bed: SlurmBed, job: str) -> Path:
    return bed.tb.root / "work" / ".clusterkit" / "jobs" / job


def wait_slurm_finished(bed: SlurmBed, slurm_id: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = bed.job_state(slurm_id)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state
        time.sleep(0.3)
    raise AssertionError(f"job {slurm_id} still {bed.job_state(slurm_id)} after {timeout} s")


def assert_slurm_nodes_clean(bed: SlurmBed, timeout: float = 20) -> None:
    """No slurmstepd, batch script or rank left on any node (after KillWait at most)."""
    deadline = time.monotonic() + timeout
    left: dict[str, list[tuple[int, str]]] = {}
    while time.monotonic() < deadline:
        left = {n.name: p for n in bed.nodes if (p := bed.job_processes(n))}
        if not left:
            return
        time.sleep(0.3)
    raise AssertionError(f"processes left after the job: {left}")


# -------------------------------------------------------------- a job recorded as failed


def recorded_failed_job(tmp_path: Path, **kw: object) -> Registry:
    """A registry holding the a800-7x2 torchrun plan of ``kw`` as a failed job (what a
    relaunch with the same id continues: tests of check_continue and the recovery)."""
    plan = plan_for("a800-7x2", "torchrun", **kw)
    registry = Registry(tmp_path)
    record = _record(job_from_plan(plan), plan, 0)
    record.state = JobState.FAILED
    registry.save(record)
    return registry


def assert_collected_exact(testbed: Testbed, tmp_path: Path, launched: Launched, nodes: int,
                            ranks: int) -> None:
    """A node-local run's newest checkpoint collected from its nodes and consolidated to
    fp32 equals, tensor by tensor, the weights its live model dumped."""
    import torch

    from clusterkit.checkpoints.convert.consolidate import load_state_dict_dir

    assert launched.run.code == 0, launched.run.text[-3000:]
    assert launched.storage == "node-local"
    assert launched.weights is not None and launched.weights.is_file(), launched.run.text[-3000:]
    tag = f"global_step{SHARED_7X2_STEPS}"
    ckpt = f"{testbed.local_mountpoint}/ckpt/{launched.job}"  # checkpoint.local_dir/<job>
    dest = tmp_path / "dest"
    inv = testbed.write_inventory(tmp_path / "inv.yaml", testbed.nodes[:nodes], slots=2)
    res = subprocess.run([sys.executable, "-m", "clusterkit", "collect-ckpt", "-i", str(inv),
                          "--dir", ckpt, "--to", str(dest), "--consolidate", "fp32"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(list((dest / tag).glob("*_optim_states.pt"))) == ranks
    assert "loads strictly into clusterkit.workload GPT(tiny)" in res.stdout
    live = torch.load(launched.weights, map_location="cpu")
    got = load_state_dict_dir(str(dest / f"{tag}-fp32"))
    assert set(live) <= set(got)
    assert max(float((got[k].detach() - v.detach()).abs().max()) for k, v in live.items()) == 0.0


# ------------------------------------------------------------------ a resume proved inside one job

# No uninterrupted reference run (issue 37 item 6): the failed attempt is the reference
# for every step it logged after the tag the next attempt resumes from. The job is held
# (every rank SIGSTOPped) at a moment where the newest save is complete, no newer one is
# begun, and rank 0 has logged ``past`` steps after it; the next attempt resumes from
# exactly that save and logs those steps again. The first step after the tag needs the
# loaded weights, the second also the optimizer and LR state. DeepSpeed's CSV monitor
# (rank 0, the workload's run dir in the shared job dir) has the losses at full precision.

def monitor_losses(run_dir: Path, per_step: int | None = None) -> list[dict[int, float]]:
    """The bundled workload's logged losses from DeepSpeed's CSV monitor under ``run_dir``
    (the workload's --run-dir: ``<job dir>/run`` for a launch): rank 0 writes a header
    when a run (an attempt) logs its first step, then ``global_samples,loss`` rows
    (``repr`` of the float: exact). Per run, step -> loss; ``per_step`` is the samples of
    one optimizer step, by default the first run's first row (a run from step 1 that logs
    every step: ``--log-every 1``). A row being written (cut short) is left out."""
    import csv

    files = list((run_dir / "monitor").rglob("Train_Samples_train_loss.csv"))
    assert len(files) <= 1, files
    runs: list[list[tuple[int, float]]] = []
    if files:
        with files[0].open(newline="") as fh:
            for row in csv.reader(fh):
                if row and row[0] == "step":
                    runs.append([])
                elif runs and len(row) == 2:
                    try:
                        runs[-1].append((int(row[0]), float(row[1])))
                    except ValueError:
                        continue
    if per_step is None:
        if not runs or not runs[0]:
            return [{} for _ in runs]
        per_step = runs[0][0][0]
    assert per_step > 0, runs[:1]
    return [{samples // per_step: loss for samples, loss in run} for run in runs]


def attempts_agree(logged: Sequence[tuple[int, str]], repeated: Sequence[int]) -> None:
    """A job killed and restarted, proved resumed exactly without a reference run:
    ``logged`` is the (step, loss) lines of the whole console in order; an attempt starts
    where the step goes back. Two attempts; the second logs every step of ``repeated``
    (those after its checkpoint that the first had logged before the kill) with the very
    loss the first logged, and those are the only steps both logged."""
    runs: list[dict[int, str]] = [{}]
    for step, loss in logged:
        if runs[-1] and step <= max(runs[-1]):
            runs.append({})
        runs[-1][step] = loss
    assert len(runs) == 2, logged
    both = sorted(runs[0].keys() & runs[1].keys())
    assert both == sorted(repeated), (both, logged)
    assert all(runs[0][s] == runs[1][s] for s in both), logged


def node_local_saves(tb: Testbed, nodes: Sequence[str], local: str, job: str) -> tuple[int, int]:
    """A node-local job's (newest step whose save any node has begun: its tag dir exists,
    newest step whose save every node completed: clusterkit's marker of each node
    index); 0 for none. ``local``: the inventory's checkpoint.local_dir under the
    node-local dir (``ckpt`` for root's, ``<user>/ckpt`` for the bed's user's)."""
    from clusterkit.node.contract import marker_name

    begun: set[int] = set()
    done: set[int] = set()
    tags = [{int(d.name.removeprefix("global_step")): d
             for d in tb.node_local_path(n, f"{local}/{job}").glob("global_step*")
             if d.name.removeprefix("global_step").isdigit()} for n in nodes]
    for held in tags:
        begun |= set(held)
    for step in set.intersection(*(set(t) for t in tags)) if tags else set():
        if all((t[step] / marker_name(i)).is_file() for i, t in enumerate(tags)):
            done.add(step)
    return max(begun, default=0), max(done, default=0)


def stop_ranks(pids: Sequence[int], timeout: float = 10.0) -> None:
    """SIGSTOP every pid and wait until each is stopped ('T'); fails if one is gone."""
    from clusterkit.node.agent.hangs import proc_state

    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = {pid: proc_state(pid) for pid in pids}
        gone = [pid for pid, s in states.items() if s in ("?", "Z", "X")]
        assert not gone, f"rank pids {gone} ended before they were stopped"
        if all(s in ("T", "t") for s in states.values()):
            return
        assert time.monotonic() < deadline, f"ranks not stopped after SIGSTOP: {states}"
        time.sleep(0.02)


def continue_ranks(pids: Sequence[int]) -> None:
    import contextlib

    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def hold_past_save(run: Console, job: str, world: int, saves: Callable[[], tuple[int, int]],
                   losses: Callable[[], dict[int, float]], after: int = 0, past: int = 2,
                   timeout: float = 400) -> tuple[int, list[int]]:
    """Wait until this attempt of ``job`` has completed a save N > ``after``, begun none
    newer and logged steps N+1..N+``past`` (``saves()``: (newest begun, newest complete);
    ``losses()``: this attempt's logged step -> loss), and return (N, the pids of ranks
    0..world-1) with every rank stopped (SIGSTOP): checked while stopped, so the next
    attempt resumes from N and this one has logged those steps. The caller continues
    (:func:`continue_ranks`) or kills them. Never returns while the ranks run on."""
    deadline = time.monotonic() + timeout

    def ready() -> bool:
        begun, done = saves()
        logged = losses()
        return done > after and begun == done and all(done + k in logged
                                                      for k in range(1, past + 1))

    while True:
        run.wait_for(ready, max(1.0, deadline - time.monotonic()),
                     f"{job}: {past} steps logged past a save after step {after}", poll=0.02)
        pids = [rank_pid(job, r) for r in range(world)]
        if None in pids:
            time.sleep(0.1)  # between attempts
            continue
        found = [p for p in pids if p is not None]
        stop_ranks(found)
        if ready():
            return saves()[1], found
        continue_ranks(found)  # a newer save began meanwhile: wait for its steps
