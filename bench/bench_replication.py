"""Step time of the bundled workload with checkpoint replicas on and off (issue 22).

    python -m bench.bench_replication                       # 3 nodes x 1, tiny, 2 rounds
    python -m bench.bench_replication --model small --steps 20 --save-every 5 --rounds 3
    python -m bench.bench_replication --prefix ckr          # an existing test bed (kept)

Replication needs a real path between nodes: two ``transport: local`` virtual nodes
share one address, where the plan places no copy. So this runs on the test bed
(tests/testbed: network namespaces with sshd, node-private ``/scratch``), ``clusterkit
launch --launcher native``, node-local storage, saving every ``--save-every`` steps, in
interleaved rounds (on, off; then off, on; ...) so a change in the machine's load hits
both sides alike. Each run prints its mean step time (the workload's timed steps: the
first step and the saves themselves are left out, the copies running beside the steps
are not) with the 1-minute load average at its start; the end prints the mean of each
side, the ratio on/off and the mean load of each side. The machine is shared: read the
ratio with the load (rank 0's CPU seconds per step, also printed, are steadier). Everything
written is removed at the end. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.testbed import Testbed

SUMMARY_PREFIX = "CLUSTERKIT_SUMMARY "


def _load() -> float:
    return os.getloadavg()[0]


def _run(tb: Testbed, work: Path, inv: Path, job: str, ns: argparse.Namespace,
         replicas: int) -> dict[str, Any]:
    """One launch; its mean step time (s), the load at its start, the copies it made."""
    argv = [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id", job,
            "--launcher", "native", "--nodes", str(ns.nodes), "--gpus-per-node", "1",
            "--storage", "node-local", "--model", ns.model, "--steps", str(ns.steps),
            "--save-every", str(ns.save_every), "--replicas", str(replicas),
            "--skip-checks", "--grace", "2"]
    env = dict(os.environ, CLUSTERKIT_HOME=str(work / "home"), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    load = _load()
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=work,
                          timeout=ns.timeout)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.exit(f"run {job} failed ({proc.returncode}):\n{text[-4000:]}")
    line = [ln for ln in text.splitlines() if ln.startswith(SUMMARY_PREFIX)][-1]
    summary = json.loads(line[len(SUMMARY_PREFIX):])
    step_s = ns.nodes / summary["samples_per_s"]  # micro 1 x accum 1 x world
    copies = sum(1 for ln in text.splitlines() if "sha256 verified" in ln)
    for node in tb.ensure(ns.nodes):  # the next run starts with empty node-local dirs
        shutil.rmtree(tb.node_local_path(node, "ckpt"), ignore_errors=True)
    return {"job": job, "replicas": replicas, "step_s": step_s, "load": load,
            "wall_s": time.monotonic() - t0, "copies": copies,
            "cpu_s_per_step": summary.get("cpu_s_per_step")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_replication", allow_abbrev=False)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--prefix", help="use this existing test bed (else a new one, torn down)")
    ns = p.parse_args(argv)
    tb = Testbed.load(ns.prefix) if ns.prefix else Testbed.create()
    work = Path(tempfile.mkdtemp(prefix="bench-replication-"))
    runs: list[dict[str, Any]] = []
    try:
        nodes = [n.name for n in tb.ensure(ns.nodes)]
        inv = tb.write_inventory(work / "inv.yaml", nodes=nodes, slots=1)
        for r in range(ns.rounds):
            for replicas in ((1, 0) if r % 2 == 0 else (0, 1)):
                run = _run(tb, work, inv, f"benchrep-{os.getpid()}-{r}-{replicas}", ns, replicas)
                runs.append(run)
                print(f"round {r} replicas={replicas}: step {run['step_s'] * 1000:.1f} ms "
                      f"(load {run['load']:.1f}), rank 0 CPU {run['cpu_s_per_step'] * 1000:.1f} "
                      f"ms/step, {run['copies']} copies, "
                      f"{run['wall_s']:.0f} s wall", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not ns.prefix:
            tb.down()
    on = [x for x in runs if x["replicas"]]
    off = [x for x in runs if not x["replicas"]]
    m_on = statistics.mean(x["step_s"] for x in on)
    m_off = statistics.mean(x["step_s"] for x in off)
    result = {"nodes": ns.nodes, "model": ns.model, "steps": ns.steps,
              "save_every": ns.save_every, "rounds": ns.rounds,
              "step_ms_on": round(m_on * 1000, 2), "step_ms_off": round(m_off * 1000, 2),
              "ratio_on_off": round(m_on / m_off, 3),
              "median_ratio_on_off": round(statistics.median(x["step_s"] for x in on)
                                           / statistics.median(x["step_s"] for x in off), 3),
              "load_on": round(statistics.mean(x["load"] for x in on), 1),
              "load_off": round(statistics.mean(x["load"] for x in off), 1),
              "copies_per_run_on": statistics.mean(x["copies"] for x in on),
              # rank 0's own CPU seconds per step: steadier than wall time on a busy machine
              "cpu_ratio_on_off": round(statistics.mean(x["cpu_s_per_step"] for x in on)
                                        / statistics.mean(x["cpu_s_per_step"] for x in off), 3)}
    print(f"replicas on:  mean step {result['step_ms_on']} ms (load {result['load_on']})")
    print(f"replicas off: mean step {result['step_ms_off']} ms (load {result['load_off']})")
    print(f"ratio on/off: {result['ratio_on_off']} (of medians: "
          f"{result['median_ratio_on_off']}; rank 0 CPU per step: "
          f"{result['cpu_ratio_on_off']})")
    print("BENCH " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
