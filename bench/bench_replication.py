"""Step time of the bundled workload with checkpoint replicas on and off (issue 22).

    python -m bench.bench_replication                       # 3 nodes x 1, tiny, 2 rounds
    python -m bench.bench_replication --model small --steps 20 --save-every 5 --rounds 3
    python -m bench.bench_replication --prefix ckr          # an existing test bed (kept)
    python -m bench.bench_replication --user-script         # 4 x 2, 256 MB per node per save
    python -m bench.bench_replication --copy-cpu 512        # CPU s per GiB at each end

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

``--user-script`` (issue 31): the job is ``bench/replication_script.py``, a user's
script as the agent sees one (DeepSpeed ZeRO-2 file names, no completion markers, the
newest two saves kept) with fixed pure-Python work (~0.15 CPU-s) and 1 s without CPU
(the accelerator's part) per step; defaults 4 nodes x 2 ranks, saving 2 x 128 MB per
node every 5 steps. Each run prints the ranks' mean and median step time (saves left
out) with the load, the copies the agents made and their mean seconds (from the nodes'
launcher.log); the end prints the mean and median ratio on/off and the priority line.
``--copy-cpu MB``: one push of MB over loopback, a
:class:`~clusterkit.node.replicas.wire.ReplicaServer` in a child process: the CPU seconds per
GiB of each end, against one sha256 pass over the same bytes (the floor of each end).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.testbed import Testbed

SUMMARY_PREFIX = "CLUSTERKIT_SUMMARY "
SCRIPT = Path(__file__).resolve().parent / "replication_script.py"
STEPS_PREFIX = "CLUSTERKIT_BENCH_STEPS "
REPO = Path(__file__).resolve().parents[1]
GIB = float(1 << 30)


def user_script_argv(ns: argparse.Namespace) -> list[str]:
    """launch's words for the user-script job (after the common options)."""
    return [str(SCRIPT), "--", "--steps", str(ns.steps), "--save-every", str(ns.save_every),
            "--mb-per-rank", str(ns.mb_per_rank)]


def user_script_steps(text: str) -> list[float]:
    """Every rank's timed steps from launch's output (one line per rank)."""
    out: list[float] = []
    for line in text.splitlines():
        at = line.find(STEPS_PREFIX)
        if at >= 0:
            out += json.loads(line[at + len(STEPS_PREFIX):])["steps"]
    if not out:
        sys.exit("no CLUSTERKIT_BENCH_STEPS line in the launch's output:\n" + text[-3000:])
    return out


_SERVER = """
import json, resource, sys
sys.path.insert(0, {repo!r})
from clusterkit.node.replicas.wire import ReplicaServer
secret = sys.stdin.readline().strip()
srv = ReplicaServer("bench-copy-cpu", 1, "n1", {dest!r}, secret, address="127.0.0.1",
                    sources=[0])
port = srv.start()
r0 = resource.getrusage(resource.RUSAGE_SELF)
print(port, flush=True)
sys.stdin.readline()
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime}}), flush=True)
"""


def copy_cpu(mb: int) -> int:
    """One push of ``mb`` MB (4 files) on loopback: CPU seconds per GiB at each end."""
    from clusterkit.node.replicas.wire import push

    work = Path(tempfile.mkdtemp(prefix="bench-copy-cpu-"))
    try:
        src = work / "src" / "step1"
        src.mkdir(parents=True)
        block = os.urandom(1 << 20)
        for i in range(4):
            with open(src / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt", "wb") as fh:
                for _ in range(mb // 4):
                    fh.write(block)
        nbytes = sum(f.stat().st_size for f in src.iterdir())
        secret = secrets.token_hex(32)
        server = subprocess.Popen([sys.executable, "-c", _SERVER.format(
            repo=str(REPO), dest=str(work / "dest"))], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(secret + "\n")
        server.stdin.flush()
        port = int(server.stdout.readline())
        del port  # the server's port list is derived from the job id, as on a node
        load = os.getloadavg()[0]
        res: dict[str, Any] = {}

        def send() -> None:
            c0, t0 = time.thread_time(), time.monotonic()
            res["bytes"] = push(str(work / "src"), "step1",
                                {"node": "n1", "index": 1, "address": "127.0.0.1"},
                                job_id="bench-copy-cpu", source=0, source_host="n0",
                                secret=secret, tags=["step1"])
            res["cpu"], res["wall"] = time.thread_time() - c0, time.monotonic() - t0

        t = threading.Thread(target=send)
        t.start()
        t.join()
        server.stdin.write("done\n")
        server.stdin.flush()
        recv_cpu = float(json.loads(server.stdout.readline())["cpu"])
        server.wait(30)
        floor = _sha256_cpu(src)
        gib = nbytes / GIB
        result = {"mb": round(nbytes / 1e6), "load": round(load, 2),
                  "wall_s": round(res["wall"], 2),
                  "sender_cpu_s_per_gib": round(res["cpu"] / gib, 3),
                  "receiver_cpu_s_per_gib": round(recv_cpu / gib, 3),
                  "sha256_alone_cpu_s_per_gib": round(floor / gib, 3)}
        print(f"push of {result['mb']} MB on loopback in {result['wall_s']} s (load {load:.2f}): "
              f"sender {result['sender_cpu_s_per_gib']} CPU-s/GiB, receiver "
              f"{result['receiver_cpu_s_per_gib']} CPU-s/GiB; one sha256 pass alone "
              f"{result['sha256_alone_cpu_s_per_gib']} CPU-s/GiB")
        print("BENCH " + json.dumps(result))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


_PINNED_SERVER = """
import os, sys
sys.path.insert(0, {repo!r})
os.sched_setaffinity(0, {{{cpu}}})
from clusterkit.node.replicas import priority
from clusterkit.node.replicas.wire import ReplicaServer
if {lower!r}:
    priority.lower_this_session()  # as node/replicas/proc.py's copy process does
else:
    priority.lower_this_thread = lambda path="": "off"
srv = ReplicaServer({job!r}, 1, "n1", {dest!r}, sys.stdin.readline().strip(),
                    address="127.0.0.1", sources=[0])
print(srv.start(), flush=True)
sys.stdin.readline()
"""

# One push from a process of its own (a session of its own, as the agent's copy process).
_PINNED_SENDER = """
import os, sys, time
sys.path.insert(0, {repo!r})
os.sched_setaffinity(0, {{{cpu}}})
from clusterkit.node.replicas import priority
from clusterkit.node.replicas.wire import low_priority, push
if {lower!r}:
    priority.lower_this_session()
else:
    priority.lower_this_thread = lambda path="": "off"
low_priority(lambda _m: None, {work!r})
secret = sys.stdin.readline().strip()
t0 = time.monotonic()
push({src!r}, "step1", {{"node": "n1", "index": 1, "address": "127.0.0.1"}}, job_id={job!r},
     source=0, source_host="n0", secret=secret, tags=["step1"])
print(time.monotonic() - t0, flush=True)
"""

_RANK = """
import os, sys, time, select
os.sched_setaffinity(0, {{{cpu}}})
n, t0 = 0, time.monotonic()
while not select.select([sys.stdin], [], [], 0)[0]:
    for _ in range(20000):
        n += 1
print(n / (time.monotonic() - t0), flush=True)
"""


def beside_rank(mb: int, rounds: int) -> int:
    """A busy "rank" (a session of its own) and one push of ``mb`` MB, sender and server
    each a process in a session of its own as the agent's copy process is, all pinned to
    one CPU: the rank's work rate while the copy runs over its rate alone, with the copy
    at the priority node/replicas/priority.py gives it (autogroup nice 19, SCHED_IDLE, idle I/O)
    and without (interleaved rounds)."""
    cpu = max(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="bench-beside-rank-"))
    out: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        src = work / "src" / "step1"
        src.mkdir(parents=True)
        (src / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(os.urandom(mb << 20))

        def rank_rate(seconds: float | None, during: Any = None) -> float:
            proc = subprocess.Popen([sys.executable, "-c", _RANK.format(cpu=cpu)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    start_new_session=True)
            assert proc.stdin is not None and proc.stdout is not None
            if during is None:
                time.sleep(seconds or 0.0)
            else:
                during()
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            return float(proc.stdout.readline())

        for r in range(rounds):
            for lower in ((True, False) if r % 2 == 0 else (False, True)):
                job = f"bench-beside-{os.getpid()}-{r}-{int(lower)}"
                secret = secrets.token_hex(16)
                server = subprocess.Popen([sys.executable, "-c", _PINNED_SERVER.format(
                    repo=str(REPO), cpu=cpu, lower=lower, job=job, dest=str(work / job))],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    start_new_session=True)
                assert server.stdin is not None and server.stdout is not None
                server.stdin.write(secret + "\n")
                server.stdin.flush()
                server.stdout.readline()
                took: list[float] = []

                def copy(lower: bool = lower, job: str = job, secret: str = secret,
                         took: list[float] = took) -> None:
                    sender = subprocess.Popen(
                        [sys.executable, "-c", _PINNED_SENDER.format(
                            repo=str(REPO), cpu=cpu, lower=lower, work=str(work),
                            src=str(work / "src"), job=job)],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                        start_new_session=True)
                    out_, _ = sender.communicate(secret + "\n", timeout=600)
                    took.append(float(out_))

                alone = rank_rate(3.0)
                during = rank_rate(None, copy)
                server.stdin.write("done\n")
                server.stdin.flush()
                server.wait(30)
                out[lower].append((during / alone, took[0]))
                print(f"round {r} copy {'at low priority' if lower else 'at normal priority'}:"
                      f" the rank's rate during the copy {during / alone:.2f} of its rate alone;"
                      f" the {mb} MB copy took {took[0]:.1f} s (load {os.getloadavg()[0]:.1f})",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for lower in (True, False):
        rates = [x for x, _ in out[lower]]
        print(f"{'low' if lower else 'normal'} priority: the rank kept "
              f"{statistics.mean(rates):.2f} of its rate (runs "
              + ", ".join(f"{x:.2f}" for x in rates) + "); copy "
              + ", ".join(f"{t:.1f} s" for _, t in out[lower]))
    return 0


def _sha256_cpu(src: Path) -> float:
    """CPU seconds of one sha256 pass over the files (read from the page cache)."""
    c0 = time.process_time()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    for f in sorted(src.iterdir()):
        h = hashlib.sha256()
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])
    return time.process_time() - c0



def _load() -> float:
    return os.getloadavg()[0]


def _run(tb: Testbed, work: Path, inv: Path, job: str, ns: argparse.Namespace,
         replicas: int) -> dict[str, Any]:
    """One launch; its mean step time (s), the load at its start, the copies it made."""
    argv = [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id", job,
            "--launcher", "native", "--nodes", str(ns.nodes), "--gpus-per-node",
            str(ns.ranks), "--storage", "node-local", "--replicas", str(replicas),
            "--skip-checks", "--grace", "2"]
    argv += user_script_argv(ns) if ns.user_script else [
        "--model", ns.model, "--steps", str(ns.steps), "--save-every", str(ns.save_every)]
    env = dict(os.environ, CLUSTERKIT_HOME=str(work / "home"), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    load = _load()
    t0 = time.monotonic()
    for attempt in (1, 2):  # the machine is shared: a run killed from outside gets one more try
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=work,
                              timeout=ns.timeout)
        text = proc.stdout + proc.stderr
        if proc.returncode == 0:
            break
        if attempt == 2:
            sys.exit(f"run {job} failed ({proc.returncode}):\n{text[-4000:]}")
        print(f"run {job} failed ({proc.returncode}), once more: "
              + " | ".join(ln for ln in text.splitlines() if "FAILED" in ln)[-300:], flush=True)
        for node in tb.ensure(ns.nodes):
            shutil.rmtree(tb.node_local_path(node, "ckpt"), ignore_errors=True)
        job += "-again"
    copies = sum(1 for ln in text.splitlines() if "sha256 verified" in ln)
    if ns.user_script:
        steps = user_script_steps(text)
        copies, copy_s, prio, per_gib = _copies(tb, job)
        for node in tb.ensure(ns.nodes):
            shutil.rmtree(tb.node_local_path(node, "ckpt"), ignore_errors=True)
        return {"job": job, "replicas": replicas, "step_s": statistics.mean(steps),
                "median_s": statistics.median(steps), "load": load, "load_end": _load(),
                "wall_s": time.monotonic() - t0, "copies": copies, "copy_s": copy_s,
                "priority": prio, "cpu_s_per_gib": per_gib, "cpu_s_per_step": None}
    line = [ln for ln in text.splitlines() if ln.startswith(SUMMARY_PREFIX)][-1]
    summary = json.loads(line[len(SUMMARY_PREFIX):])
    step_s = ns.nodes / summary["samples_per_s"]  # micro 1 x accum 1 x world
    for node in tb.ensure(ns.nodes):  # the next run starts with empty node-local dirs
        shutil.rmtree(tb.node_local_path(node, "ckpt"), ignore_errors=True)
    return {"job": job, "replicas": replicas, "step_s": step_s, "load": load,
            "wall_s": time.monotonic() - t0, "copies": copies,
            "cpu_s_per_step": summary.get("cpu_s_per_step")}


COPY_LINE = re.compile(r"replica: \S+ -> \S+: complete .*\((\d+) bytes, ([\d.]+) s, "
                       r"([\d.]+) CPU s\)")
RECV_LINE = re.compile(r"replica: received \S+ of node index \d+: (\d+) bytes in [\d.]+ s, "
                       r"([\d.]+) CPU s")


def _copies(tb: Testbed, job: str) -> tuple[int, float | None, str, dict[str, float | None]]:
    """From the nodes' launcher.log: the copies made (bytes sent), their mean seconds,
    the priority line the agents wrote, and the copy threads' CPU s per GiB at each end."""
    secs, prio, session = [], "", ""
    ends = {"send": [0, 0.0], "receive": [0, 0.0]}  # bytes, CPU s
    for log in (tb.root / "work" / ".clusterkit" / "jobs" / job / "nodes").glob("*/launcher.log"):
        for line in log.read_text(errors="replace").splitlines():
            m, r = COPY_LINE.search(line), RECV_LINE.search(line)
            if m and int(m.group(1)) > 0:
                secs.append(float(m.group(2)))
                ends["send"][0] += int(m.group(1))
                ends["send"][1] += float(m.group(3))
            elif r:
                ends["receive"][0] += int(r.group(1))
                ends["receive"][1] += float(r.group(2))
            elif "copies run at low priority" in line:
                prio = line[line.index("copies run"):] + (f" ({session})" if session else "")
            elif "copy process runs in a session of its own" in line:
                session = line[line.index("session of its own: ") + 20:]
    per_gib = {k: (round(cpu / (n / GIB), 2) if n else None) for k, (n, cpu) in ends.items()}
    return len(secs), (statistics.mean(secs) if secs else None), prio, per_gib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_replication", allow_abbrev=False)
    p.add_argument("--nodes", type=int)
    p.add_argument("--ranks", type=int, help="per node (default 1; 2 with --user-script)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int)
    p.add_argument("--save-every", type=int)
    p.add_argument("--user-script", action="store_true",
                   help="bench/replication_script.py instead of the bundled workload")
    p.add_argument("--mb-per-rank", type=int, default=128)
    p.add_argument("--copy-cpu", type=int, metavar="MB",
                   help="only the CPU per GiB of one push of MB on loopback")
    p.add_argument("--beside-rank", type=int, metavar="MB",
                   help="only: a busy rank's rate while a push of MB shares its CPU, "
                        "copy at low vs normal priority (--rounds rounds)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--prefix", help="use this existing test bed (else a new one, torn down)")
    ns = p.parse_args(argv)
    if ns.copy_cpu:
        return copy_cpu(ns.copy_cpu)
    if ns.beside_rank:
        return beside_rank(ns.beside_rank, ns.rounds)
    us = ns.user_script
    ns.nodes = ns.nodes or (4 if us else 3)
    ns.ranks = ns.ranks or (2 if us else 1)
    ns.steps = ns.steps or (20 if us else 40)
    ns.save_every = ns.save_every or (5 if us else 4)
    tb = Testbed.load(ns.prefix) if ns.prefix else Testbed.create()
    work = Path(tempfile.mkdtemp(prefix="bench-replication-"))
    runs: list[dict[str, Any]] = []
    try:
        nodes = [n.name for n in tb.ensure(ns.nodes)]
        inv = tb.write_inventory(work / "inv.yaml", nodes=nodes, slots=ns.ranks)
        for r in range(ns.rounds):
            for replicas in ((1, 0) if r % 2 == 0 else (0, 1)):
                run = _run(tb, work, inv, f"benchrep-{os.getpid()}-{r}-{replicas}", ns, replicas)
                runs.append(run)
                cpu = (f"rank 0 CPU {run['cpu_s_per_step'] * 1000:.1f} ms/step"
                       if run["cpu_s_per_step"] is not None else
                       f"median {run['median_s'] * 1000:.1f} ms, load at end {run['load_end']:.1f}"
                       + (f", copies took {run['copy_s']:.1f} s on average"
                          if run.get("copy_s") else "")
                       + (f", copy CPU s per GiB: send {run['cpu_s_per_gib']['send']}, "
                          f"receive {run['cpu_s_per_gib']['receive']}"
                          if run.get("copy_s") else ""))
                print(f"round {r} replicas={replicas}: step {run['step_s'] * 1000:.1f} ms "
                      f"(load {run['load']:.1f}), {cpu}, {run['copies']} copies, "
                      f"{run['wall_s']:.0f} s wall", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not ns.prefix:
            tb.down()
    on = [x for x in runs if x["replicas"]]
    off = [x for x in runs if not x["replicas"]]
    m_on = statistics.mean(x["step_s"] for x in on)
    m_off = statistics.mean(x["step_s"] for x in off)
    med = "median_s" if ns.user_script else "step_s"
    result = {"nodes": ns.nodes, "ranks": ns.ranks, "steps": ns.steps,
              "model": "user-script" if ns.user_script else ns.model,
              "save_every": ns.save_every, "rounds": ns.rounds,
              "step_ms_on": round(m_on * 1000, 2), "step_ms_off": round(m_off * 1000, 2),
              "ratio_on_off": round(m_on / m_off, 3),
              "median_ratio_on_off": round(statistics.median(x[med] for x in on)
                                           / statistics.median(x[med] for x in off), 3),
              "load_on": round(statistics.mean(x["load"] for x in on), 1),
              "load_off": round(statistics.mean(x["load"] for x in off), 1),
              "copies_per_run_on": statistics.mean(x["copies"] for x in on),
              # rank 0's own CPU seconds per step: steadier than wall time on a busy machine
              "cpu_ratio_on_off": None if ns.user_script else round(
                  statistics.mean(x["cpu_s_per_step"] for x in on)
                  / statistics.mean(x["cpu_s_per_step"] for x in off), 3)}
    prio = next((x["priority"] for x in on if x.get("priority")), "")
    if prio:
        print(prio)
    print(f"replicas on:  mean step {result['step_ms_on']} ms (load {result['load_on']})")
    print(f"replicas off: mean step {result['step_ms_off']} ms (load {result['load_off']})")
    print(f"ratio on/off: {result['ratio_on_off']} (of medians: "
          f"{result['median_ratio_on_off']}; rank 0 CPU per step: "
          f"{result['cpu_ratio_on_off']})")
    print("BENCH " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
