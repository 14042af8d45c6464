"""Start-up time of a launch: the whole command's wall time for a trivial script.

Compares, on the namespace test bed (real sshd per node, CPU/gloo):

* ``clusterkit``: ``clusterkit launch`` (default path: one agent per node over one SSH
  connection, gate folded into the agents, the ranks forked by each node's fork
  server after one ``import torch`` per node: ``--launcher native``),
* ``deepspeed``: DeepSpeed's runner over pdsh (``deepspeed.launcher.runner --launcher pdsh``),
* ``ssh-torchrun``: a plain parallel ``ssh node torchrun ...`` per node,

and on request (``--modes``) ``clusterkit-exec`` (the same launch with the fork server
off, ``CLUSTERKIT_ZYGOTE=0``) and ``clusterkit-torchrun`` (``--launcher torchrun``),
for 7 nodes x 2 ranks and 32 nodes x 1 rank in one run. Each rank runs
``init_process_group("gloo")``, prints ``INIT_DONE <rank> <unix time>``, meets the
others in a barrier and exits.

Figures: ``wall`` = the command's start to its exit (the goal figure), ``init`` = to
the last rank past ``init_process_group``. Every figure is printed with the 1-minute
load average at its start and end (``os.getloadavg()``): on a shared machine the load
decides more than the launcher does. ``--repeat N`` runs the shapes and modes N times,
interleaved (rep 1: all shapes x modes, rep 2: ...), so a change in load hits every
mode alike; ratios are taken per repetition (clusterkit / deepspeed of the same rep)
and summarised by their median. A failed run (non-zero exit, missing ranks, timeout)
is counted, its output's tail printed and kept under ``--logs``, and not retried.

Run as root (it builds and always removes its own test bed, also on Ctrl-C)::

    python bench/launch.py [--shapes 7x2,32x1] [--repeat 5] [--modes clusterkit,deepspeed,ssh-torchrun]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.testbed.core import Testbed, temporary

RANK_SCRIPT = textwrap.dedent("""
    import os, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print(f"INIT_DONE {dist.get_rank()} {time.time():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")
TIMEOUT_S = 600
_DONE = re.compile(r"INIT_DONE (\d+) ([0-9.]+)")
MODES = ("clusterkit", "deepspeed", "ssh-torchrun", "clusterkit-exec", "clusterkit-torchrun")
DEFAULT_MODES = "clusterkit,deepspeed,ssh-torchrun"


@dataclass
class Run:
    rep: int
    shape: str
    mode: str
    ok: bool
    wall: float
    init: float
    load0: float
    load1: float
    why: str = ""


def _load() -> float:
    return os.getloadavg()[0]


class Bench:
    def __init__(self, tb: Testbed, work: Path, logs: Path) -> None:
        self.tb, self.work, self.logs = tb, work, logs
        self.env = dict(os.environ, CLUSTERKIT_HOME=str(work / "home"), OMP_NUM_THREADS="1",
                        PYTHONUNBUFFERED="1")
        self.env.pop("CLUSTERKIT_ZYGOTE", None)
        self.serial = 0

    def argv(self, mode: str, n: int, g: int) -> tuple[list[str], dict[str, str]]:
        self.serial += 1
        port = str(29611 + self.serial % 200)  # a fresh port per run: no TIME_WAIT clash
        nodes = self.tb.nodes[:n]
        script = str(self.work / "rank.py")
        if mode.startswith("clusterkit"):
            inv = self.tb.write_inventory(self.work / "inv.yaml", nodes=[x.name for x in nodes],
                                          slots=g)
            launcher = "torchrun" if mode == "clusterkit-torchrun" else "native"
            env = dict(self.env, CLUSTERKIT_ZYGOTE="0") if mode == "clusterkit-exec" else self.env
            return ([sys.executable, "-m", "clusterkit", "launch", "-i", str(inv),
                     "--launcher", launcher, "--job-id", f"bench{self.serial}",
                     "--nodes", str(n), "--gpus-per-node", str(g),
                     script], env)
        if mode == "deepspeed":
            hostfile = self.work / "hostfile"
            hostfile.write_text("".join(f"{x.name} slots={g}\n" for x in nodes))
            env = dict(self.env, PDSH_SSH_ARGS_APPEND=f"-F {self.tb.ssh_config}",
                       PDSH_RCMD_TYPE="ssh")
            return ([sys.executable, "-u", "-m", "deepspeed.launcher.runner",
                     f"--hostfile={hostfile}", "--launcher=pdsh",
                     f"--master_addr={nodes[0].address}", f"--master_port={port}",
                     "--no_ssh_check", script], env)
        # A shell loop of backgrounded ssh commands, like a hand-written launch script;
        # the exit status is the first non-zero one.
        lines = []
        for i, node in enumerate(nodes):
            remote = (f"cd {self.work} && {sys.executable} -m torch.distributed.run "
                      f"--nnodes={n} --nproc-per-node={g} --node-rank={i} "
                      f"--master-addr={nodes[0].address} --master-port={port} "
                      f"--log-dir={self.work}/torchelastic {script}")  # not /tmp/torchelastic_*
            lines.append(f"ssh -F {self.tb.ssh_config} {node.name} '{remote}' & pids=\"$pids $!\"")
        script_sh = "\n".join(["pids=", *lines, "rc=0",
                               'for p in $pids; do wait $p || { [ $rc = 0 ] && rc=$?; }; done',
                               "exit $rc"])
        return ["bash", "-c", script_sh], self.env

    def run(self, rep: int, mode: str, n: int, g: int) -> Run:
        argv, env = self.argv(mode, n, g)
        shape = f"{n}x{g}"
        load0 = _load()
        started = time.time()
        # Own session: a timeout or Ctrl-C kills the command and everything it started.
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=str(self.work), start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            why = "" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, _ = proc.communicate()
            why = f"no exit within {TIMEOUT_S} s (killed)"
        except BaseException:
            _kill(proc)
            raise
        wall = time.time() - started
        stamps = {int(m.group(1)): float(m.group(2)) for m in _DONE.finditer(out)}
        if not why and len(stamps) != n * g:
            why = f"{len(stamps)}/{n * g} ranks past init_process_group"
        log = self.logs / f"rep{rep}-{shape}-{mode}.log"
        log.write_text(f"$ {' '.join(argv)}\n{out}")
        init = max(stamps.values()) - started if stamps else float("nan")
        return Run(rep, shape, mode, not why, wall, init, load0, _load(), why)


def _kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGINT)  # clusterkit tears down its nodes on SIGINT
        proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _fmt(r: Run) -> str:
    if not r.ok:
        return f"FAILED ({r.why}) after {r.wall:.1f} s [load {r.load0:.1f} -> {r.load1:.1f}]"
    return f"{r.wall:6.2f} s wall, {r.init:6.2f} s init [load {r.load0:.1f} -> {r.load1:.1f}]"


def _summary(runs: list[Run], modes: list[str], shapes: list[str]) -> None:
    print("\n== summary: median wall (runs ok/all), load average at the runs' starts ==")
    for shape in shapes:
        cells = []
        for mode in modes:
            rs = [r for r in runs if r.shape == shape and r.mode == mode]
            ok = [r for r in rs if r.ok]
            med = f"{statistics.median(r.wall for r in ok):.2f} s" if ok else "-"
            loads = ",".join(f"{r.load0:.0f}" for r in rs)
            cells.append(f"{mode} {med} ({len(ok)}/{len(rs)}; load {loads})")
        print(f"{shape}: " + " | ".join(cells))
        for other in [m for m in modes if m != "clusterkit"]:
            pairs = []
            for rep in sorted({r.rep for r in runs}):
                a = [r for r in runs if (r.rep, r.shape, r.mode) == (rep, shape, "clusterkit") and r.ok]
                b = [r for r in runs if (r.rep, r.shape, r.mode) == (rep, shape, other) and r.ok]
                if a and b:
                    pairs.append((a[0].wall / b[0].wall, a[0].load0, b[0].load0))
            if pairs and "clusterkit" in modes:
                each = ", ".join(f"{p:.2f} (load {la:.0f}/{lb:.0f})" for p, la, lb in pairs)
                print(f"  clusterkit / {other}: median {statistics.median(p for p, _, _ in pairs):.2f}"
                      f" over {len(pairs)} paired reps: {each}")
    failed = [r for r in runs if not r.ok]
    print(f"failed runs: {len(failed)} of {len(runs)}"
          + "".join(f"\n  rep {r.rep} {r.shape} {r.mode}: {r.why}" for r in failed))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="7x2,32x1", help="NODESxRANKS, comma-separated")
    p.add_argument("--repeat", type=int, default=1, help="repetitions, interleaved")
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help=f"comma-separated, of {', '.join(MODES)} (default {DEFAULT_MODES})")
    p.add_argument("--logs", help="keep every run's output here (default: a new /tmp dir)")
    p.add_argument("--mask-bashrc", action="store_true",
                   help="hide root's ~/.bashrc inside the nodes (real clusters usually have one)")
    args = p.parse_args()
    if os.geteuid() != 0:
        p.error("run as root: the test bed creates network namespaces and sshd per node")
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {', '.join(bad)}; known: {', '.join(MODES)}")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    logs = Path(args.logs or tempfile.mkdtemp(prefix="ckbench-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"bench: shapes {args.shapes}, modes {','.join(modes)}, {args.repeat} rep(s), "
          f"{os.cpu_count()} CPUs, load average {_load():.1f}; logs in {logs}", flush=True)
    runs: list[Run] = []
    # SIGTERM ends the bench like Ctrl-C: the test bed and the running command go.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with temporary(max(n for n, _ in shapes), mask_bashrc=args.mask_bashrc) as tb, \
                tempfile.TemporaryDirectory(prefix="ckbench-") as tmp:
            work = Path(tmp)
            (work / "rank.py").write_text(RANK_SCRIPT)
            bench = Bench(tb, work, logs)
            for rep in range(1, args.repeat + 1):
                for n, g in shapes:
                    for mode in modes:
                        r = bench.run(rep, mode, n, g)
                        runs.append(r)
                        print(f"[rep {rep}] {r.shape} {mode:20s} {_fmt(r)}", flush=True)
                        if not r.ok:
                            tail = (logs / f"rep{rep}-{r.shape}-{mode}.log").read_text()
                            print(textwrap.indent("\n".join(tail.strip().splitlines()[-20:]),
                                                  "    | "), flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: the test bed is removed; figures so far:", flush=True)
    _summary(runs, modes, [f"{n}x{g}" for n, g in shapes])
    return 1 if any(not r.ok for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
