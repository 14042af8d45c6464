"""Start-up time: from the command to every rank past ``init_process_group``.

Compares, on the namespace test bed (real sshd per node, CPU/gloo):

* ``clusterkit launch`` (default path: one agent per node over one SSH connection,
  gate folded into the agents, ranks started by the agents: ``--launcher native``),
* ``clusterkit launch --launcher torchrun`` (the agents run torchrun),
* DeepSpeed's runner over pdsh (``deepspeed.launcher.runner --launcher pdsh``),
* a plain parallel ``ssh node torchrun ...`` per node,

for 7 nodes x 2 ranks and 32 nodes x 1 rank, and prints the ratios. Each rank
prints ``INIT_DONE <rank> <unix time>`` right after ``init_process_group`` (all
namespaces share the host's clock) and exits. Run as root::

    python bench/launch.py [--shapes 7x2,32x1] [--repeat 1]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
TIMEOUT_S = 300
_DONE = re.compile(r"INIT_DONE (\d+) ([0-9.]+)")


def _measure(argv: list[str], env: dict[str, str], world: int, cwd: str) -> tuple[float, str]:
    started = time.time()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{argv[:4]}...: no result within {TIMEOUT_S} s (killed)") from None
    out = proc.stdout + proc.stderr
    stamps = {int(m.group(1)): float(m.group(2)) for m in _DONE.finditer(out)}
    if len(stamps) != world or proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-15:])
        raise RunFailed(f"{argv[:4]}...: {len(stamps)}/{world} ranks, exit {proc.returncode}\n{tail}")
    return max(stamps.values()) - started, out


class RunFailed(Exception):
    pass


def _once_more(what: str, fn: Callable[..., float], *args: Any) -> float:
    """A failed run is reported and retried once (the shared test machine is noisy:
    under heavy load gloo's full-mesh connect has failed with "No route to host");
    NaN when the retry fails too. Each time is printed as soon as it is taken."""
    for attempt in (1, 2):
        try:
            took = fn(*args)
            print(f"  {what}: {took:.2f} s (load average {_load()})", flush=True)
            return took
        except RunFailed as exc:
            print(f"  {what}: run {attempt} failed:\n{exc}", flush=True)
    return math.nan


def _clusterkit(tb: Testbed, work: Path, n: int, g: int, env: dict[str, str],
               launcher: str = "native") -> float:
    inv = tb.write_inventory(work / "inv.yaml", nodes=[x.name for x in tb.nodes[:n]], slots=g)
    argv = [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--launcher", launcher,
            "--nodes", str(n), "--gpus-per-node", str(g), str(work / "rank.py")]
    return _measure(argv, env, n * g, str(work))[0]


def _deepspeed(tb: Testbed, work: Path, n: int, g: int, env: dict[str, str]) -> float:
    hostfile = work / "hostfile"
    hostfile.write_text("".join(f"{x.name} slots={g}\n" for x in tb.nodes[:n]))
    ds_env = dict(env, PDSH_SSH_ARGS_APPEND=f"-F {tb.ssh_config}", PDSH_RCMD_TYPE="ssh")
    argv = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", f"--hostfile={hostfile}",
            "--launcher=pdsh", f"--master_addr={tb.nodes[0].address}", "--master_port=29611",
            "--no_ssh_check", str(work / "rank.py")]
    return _measure(argv, ds_env, n * g, str(work))[0]


def _ssh_torchrun(tb: Testbed, work: Path, n: int, g: int, env: dict[str, str]) -> float:
    # A shell loop of backgrounded ssh commands, like a hand-written launch script.
    lines = []
    for i, node in enumerate(tb.nodes[:n]):
        remote = (f"cd {work} && {sys.executable} -m torch.distributed.run --nnodes={n} "
                  f"--nproc-per-node={g} --node-rank={i} --master-addr={tb.nodes[0].address} "
                  f"--master-port=29612 {work / 'rank.py'}")
        lines.append(f"ssh -F {tb.ssh_config} {node.name} '{remote}' &")
    script = "\n".join([*lines, "wait"])
    return _measure(["bash", "-c", script], env, n * g, str(work))[0]


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="7x2,32x1")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--mask-bashrc", action="store_true",
                   help="hide root's ~/.bashrc inside the nodes (real clusters usually have one)")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    most = max(n for n, _ in shapes)
    rows = []
    with temporary(most, mask_bashrc=args.mask_bashrc) as tb, \
            tempfile.TemporaryDirectory(prefix="ckbench-") as tmp:
        work = Path(tmp)
        (work / "rank.py").write_text(RANK_SCRIPT)
        env = dict(os.environ, CLUSTERKIT_HOME=str(work / "home"), OMP_NUM_THREADS="1")
        for n, g in shapes:
            for _ in range(args.repeat):
                load0 = _load()
                shape = f"{n}x{g}"
                common = (tb, work, n, g, env)
                t_ck = _once_more(f"{shape} clusterkit", _clusterkit, *common)
                t_ds = _once_more(f"{shape} deepspeed", _deepspeed, *common)
                t_ckt = _once_more(f"{shape} clusterkit torchrun", _clusterkit, *common, "torchrun")
                t_ssh = _once_more(f"{shape} ssh+torchrun", _ssh_torchrun, *common)
                rows.append((f"{n}x{g}", t_ck, t_ds, t_ssh))
                print(f"{n}x{g}: clusterkit {t_ck:.2f} s | clusterkit --launcher torchrun "
                      f"{t_ckt:.2f} s | deepspeed+pdsh {t_ds:.2f} s | ssh+torchrun {t_ssh:.2f} s | "
                      f"clusterkit/deepspeed {t_ck / t_ds:.2f} | clusterkit/ssh+torchrun "
                      f"{t_ck / t_ssh:.2f} | load average {load0} -> {_load()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
