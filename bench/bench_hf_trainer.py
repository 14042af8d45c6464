"""Step time of a Hugging Face Trainer run under ``clusterkit launch`` against the same run
started by DeepSpeed's runner with a hostfile (issue 38).

    python -m bench.bench_hf_trainer                   # 2 nodes x 1 rank, 2 rounds, 200 steps
    python -m bench.bench_hf_trainer --nodes 3 --rounds 4 --steps 60
    python -m bench.bench_hf_trainer --prefix tb1      # an existing test bed (kept)
    python -m bench.bench_hf_trainer --sides clusterkit,clusterkit-exec,runner --rounds 6

The program is tests/programs/hf_trainer.py (run_clm.py-style: ``HfArgumentParser``,
``TrainingArguments``, ``Trainer``; a GPT-2 built from a config, data made locally) with
the usual all-``"auto"`` ZeRO-2 ds_config (``tests/helpers.HF_DS_AUTO``), no saves, on
the test bed (tests/testbed: network namespaces with sshd). The two sides, in
interleaved rounds (clusterkit, runner; then runner, clusterkit; ...) so a change in the
machine's load hits both alike:

* **clusterkit**: ``clusterkit launch -i INV --nodes N --storage shared`` (the default
  launcher: the node agents start the ranks), run here;
* **clusterkit-exec** (only with ``--sides``): the same launch with the fork server off
  (``--set-env CLUSTERKIT_ZYGOTE=0``: each rank its own ``python``), to tell the fork
  server's share of a difference from the rest of the launch in the same run;
* **runner** (the baseline): what a user types on the first node without clusterkit,
  ``deepspeed --hostfile HOSTFILE --master_addr ADDR --master_port PORT PROGRAM ARGS``
  (DeepSpeed's runner, pdsh to every node, ``deepspeed.launcher.launch`` there), run on
  node1 of the test bed, which reaches the others by name over ssh.

Both give each rank ``OMP_NUM_THREADS=1`` (clusterkit: ``--set-env``; the runner: the
``.deepspeed_env`` file in its working directory, which it reads). The step time of a run
is the median of rank 0's step times (the program's ``--step_times`` hook: step end to
step end) after the first three steps (process-group and optimizer warm-up, lazy op
loads: one-time costs that differ between launchers and are not what a step costs).
Each run prints its step time with the 1-minute load average at its start; the end prints each
side's mean, and the ratio runner / clusterkit (1.0: the same speed; 0.98: clusterkit's
steps take ~2 % longer) with the mean load of each side. A ratio measured under load is
not a result: read it with the load. Needs root; everything written is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.helpers import EXIT_ABORT, HF_DS_AUTO, HF_TRAINER
from tests.testbed import Testbed

# Rank 0's step times (tests/programs/hf_trainer.py's --step_times bench hook).
STEP_TIMES = re.compile(r"step times: (\[[^\]]*\])")
WARMUP = 3  # first steps left out: process-group and optimizer warm-up, lazy op loads


def program_args(ns: argparse.Namespace, out: Path, ds: Path) -> list[str]:
    return ["--output_dir", str(out), "--deepspeed", str(ds), "--use_cpu",
            "--max_steps", str(ns.steps), "--save_strategy", "no", "--logging_steps",
            str(ns.steps), "--per_device_train_batch_size", "4", "--report_to", "none",
            "--disable_tqdm", "True", "--seed", "7", "--step_times", "True",
            "--n_embd", str(ns.n_embd),
            "--n_layer", str(ns.n_layer)]


def step_s(text: str, side: str) -> float:
    """The median step time after the warm-up steps."""
    found = STEP_TIMES.findall(text)
    if not found:
        sys.exit(f"{side}: no 'step times' line in the run's output:\n{text[-3000:]}")
    times: list[float] = json.loads(found[-1])[WARMUP:]
    if not times:
        sys.exit(f"{side}: no step after the {WARMUP} warm-up steps (raise --steps)")
    return statistics.median(times)


# The clusterkit sides: the launch arguments each adds to --launch-arg's.
CLUSTERKIT_SIDES: dict[str, tuple[str, ...]] = {
    "clusterkit": (),
    "clusterkit-exec": ("--set-env", "CLUSTERKIT_ZYGOTE=0"),
}
SIDES = (*CLUSTERKIT_SIDES, "runner")


def run_clusterkit(work: Path, inv: Path, job: str, ns: argparse.Namespace, ds: Path,
                   extra: tuple[str, ...] = ()) -> str:
    argv = [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id", job,
            "--nodes", str(ns.nodes), "--storage", "shared", "--skip-checks", "--grace", "2",
            "--set-env", "OMP_NUM_THREADS=1", *ns.launch_arg, *extra, str(HF_TRAINER),
            *program_args(ns, work / f"out-{job}", ds)]
    env = dict(os.environ, CLUSTERKIT_HOME=str(work / "home"), PYTHONUNBUFFERED="1")
    res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                         timeout=ns.timeout, check=False)
    _ended_well("clusterkit launch", res.returncode, res.stdout + res.stderr)
    return res.stdout


def run_runner(tb: Testbed, work: Path, nodes: list[str], job: str, port: int,
               ns: argparse.Namespace, ds: Path) -> str:
    hostfile = work / "hostfile"
    hostfile.write_text("".join(f"{n} slots=1\n" for n in nodes))
    (work / ".deepspeed_env").write_text("OMP_NUM_THREADS=1\n")
    master = tb.node(nodes[0]).address
    script = (f"cd {work} && PYTHONUNBUFFERED=1 {sys.executable} -u -m deepspeed.launcher.runner "
              f"--hostfile {hostfile} --master_addr {master} --master_port {port} "
              f"{HF_TRAINER} " + " ".join(program_args(ns, work / f"out-{job}", ds)))
    res = tb.exec(nodes[0], ["bash", "-c", script], timeout=ns.timeout)
    _ended_well("deepspeed runner", res.returncode, res.stdout + res.stderr)
    return str(res.stdout)


def _ended_well(side: str, code: int, text: str) -> None:
    """Exit 0, or torch's exit-time abort (tests/helpers.EXIT_ABORT: gloo's work thread
    at interpreter exit, docs/launch.md) after a run that printed its step times: what
    is measured is complete. Anything else ends the bench."""
    if code == 0:
        return
    if EXIT_ABORT in text and STEP_TIMES.search(text):
        print(f"  ({side}: a rank aborted at interpreter exit after a complete run: "
              "torch's gloo exit abort; its step times count)", flush=True)
        return
    sys.exit(f"{side} exited {code}:\n{text[-3000:]}")


def one(side: str, tb: Testbed, work: Path, inv: Path, nodes: list[str], r: int,
        ns: argparse.Namespace, ds: Path) -> dict[str, Any]:
    job = f"hfb-{os.getpid()}-{r}-{side}"
    load, t0 = os.getloadavg()[0], time.monotonic()
    if side in CLUSTERKIT_SIDES:
        text = run_clusterkit(work, inv, job, ns, ds, CLUSTERKIT_SIDES[side])
    else:
        text = run_runner(tb, work, nodes, job, 29500 + r, ns, ds)
    shutil.rmtree(work / f"out-{job}", ignore_errors=True)
    return {"side": side, "step_s": step_s(text, side), "load": load,
            "wall_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_hf_trainer", allow_abbrev=False)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)  # fewer: the noise of a few seconds of steps
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--prefix", help="use this existing test bed (else a new one, torn down)")
    p.add_argument("--launch-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every clusterkit side's launch (repeat), e.g. "
                        "--launch-arg=--replicas --launch-arg=1; the fork server on and off: "
                        "--sides clusterkit,clusterkit-exec,runner")
    p.add_argument("--sides", default="clusterkit,runner",
                   help=f"comma-separated, taken in turn (each round starts one later): {', '.join(SIDES)}")
    ns = p.parse_args(argv)
    sides = [x.strip() for x in ns.sides.split(",") if x.strip()]
    if "runner" not in sides or not set(sides) <= set(SIDES) or len(set(sides)) != len(sides):
        p.error(f"--sides: each at most once, the runner among them, of: {', '.join(SIDES)}")
    tb = Testbed.load(ns.prefix) if ns.prefix else Testbed.create()
    # On the test bed's shared disk: the runner's working directory must exist on every
    # node (it cds there), as the user's would on a shared filesystem.
    work = Path(tempfile.mkdtemp(prefix="bench-hf-", dir=tb.shared_dir))
    work.chmod(0o755)
    runs: list[dict[str, Any]] = []
    try:
        nodes = [n.name for n in tb.ensure(ns.nodes)]
        inv = tb.write_inventory(work / "inv.yaml", nodes=nodes, slots=1)
        ds = work / "ds_config.json"
        ds.write_text(json.dumps(HF_DS_AUTO, indent=2))
        for r in range(ns.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                run = one(side, tb, work, inv, nodes, r, ns, ds)
                runs.append(run)
                print(f"round {r} {side}: step {run['step_s'] * 1000:.1f} ms "
                      f"(load {run['load']:.1f}), {run['wall_s']:.0f} s wall", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not ns.prefix:
            tb.down()
    print(summary(runs, sides, ns))
    return 0


def summary(runs: list[dict[str, Any]], sides: list[str], ns: argparse.Namespace) -> str:
    """Each side's mean step time and load, and runner / side for every clusterkit side."""
    def of(side: str, key: str, how: Any = statistics.mean) -> float:
        return float(how(x[key] for x in runs if x["side"] == side))

    parts = [f"{s} {of(s, 'step_s') * 1000:.1f} ms/step (load {of(s, 'load'):.1f})" for s in sides]
    med = statistics.median
    ratios = [f"runner / {s} = {of('runner', 'step_s') / of(s, 'step_s'):.3f}x (of the rounds' "
              f"medians {of('runner', 'step_s', med) / of(s, 'step_s', med):.3f}x)"
              for s in sides if s != "runner"]
    return (", ".join(parts) + ": " + "; ".join(ratios)
            + f" over {ns.rounds} round(s), {ns.nodes} nodes x 1 rank, {ns.steps} steps")


if __name__ == "__main__":
    raise SystemExit(main())
