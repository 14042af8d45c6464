"""How fast is ``clusterkit doctor`` against the ``pdsh -w ALL true`` floor? (issue 15)

    python -m bench.doctor                     # 7, 32 and 128 nodes, 3 pairs each, own test bed
    python -m bench.doctor --repeat 5 --sizes 7 32
    python -m bench.doctor --mask-bashrc       # nodes skip root's ~/.bashrc (pyenv init)

One test bed is created (grown 7 → 32 → 128) and always torn down, also on
Ctrl-C. For every size, ``--repeat`` interleaved pairs, the order alternating
(pdsh first, then doctor first, ...), so load from other work on the machine
hits both alike:

* **floor** ``pdsh -R ssh -w <all nodes> true`` (pdsh's defaults: fan-out 32,
  OpenSSH's default key exchange) with the test bed's ssh config;
* **doctor** ``python -m clusterkit doctor --json`` as a user runs it (a fresh
  process: imports, SSH fan-out, probes, master-port check, rules; no
  ``--bandwidth``); "in-process" is doctor's own ``timings_s.total`` (the rest of
  the wall time is the CLI's interpreter start-up, imports and exit).

Each figure is printed with the 1-minute load average (``os.getloadavg()``)
read right after it: on a 2-core machine shared with other work the ratio
means little when the load is far above 2. The goal is doctor/floor <= 1.2.

Where the time over the floor goes (printed per size, and once per run):

* launcher CPU: user+sys seconds of the doctor process and its ``ssh``
  children vs pdsh and its ``ssh`` children (``getrusage`` of children);
* doctor's own ``timings_s``: SSH set-up (connect + key exchange + login),
  remote command (login shell + interpreter + probe), the probe's own work,
  rules and report;
* per-node remote CPU measured inside node1: the login shell (``bash -c true``
  with the node's ~/.bashrc) that pdsh pays too, ``python -c pass``, and the
  probe (``facts`` with every node as a peer), which only doctor pays;
* CLI start-up: ``python -m clusterkit doctor --help``.

Needs root (the namespace test bed) and pdsh.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.testbed import Testbed

PAIR_TIMEOUT_S = 600


@dataclass
class Run:
    wall_s: float
    cpu_s: float  # user + sys of the process and its children
    load: float  # 1-minute load average right after the run
    timings: dict[str, float] = field(default_factory=dict)
    unreachable: int = 0  # doctor: nodes that did not answer (the ratio is then not comparable)


def _timed(argv: Sequence[str], env: dict[str, str] | None = None,
           cwd: Path | None = None) -> tuple[Run, subprocess.CompletedProcess[bytes]]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    res = subprocess.run(list(argv), env=env, cwd=cwd, capture_output=True,
                         timeout=PAIR_TIMEOUT_S, check=False)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(wall, cpu, os.getloadavg()[0]), res


class Size:
    """The two commands for one size of the test bed."""

    def __init__(self, tb: Testbed, n: int, workdir: Path) -> None:
        self.n = n
        self.nodes = tb.ensure(n)[:n]
        self.inventory = tb.write_inventory(workdir / f"inventory-{n}.yaml", self.nodes)
        self.workdir = workdir
        self.client = "?"  # the SSH client doctor reported using
        self.pdsh_env = dict(os.environ, PDSH_RCMD_TYPE="ssh",
                             PDSH_SSH_ARGS_APPEND=f"-F {tb.ssh_config}")

    def floor(self) -> Run:
        names = ",".join(node.name for node in self.nodes)
        run, res = _timed(["pdsh", "-R", "ssh", "-w", names, "true"], env=self.pdsh_env)
        if res.returncode != 0:
            raise RuntimeError(f"pdsh failed ({res.returncode}): {res.stderr[-500:]!r}")
        return run

    def doctor(self) -> Run:
        run, res = _timed([sys.executable, "-m", "clusterkit", "doctor", "-i",
                           str(self.inventory), "--json"], cwd=self.workdir)
        if res.returncode not in (0, 1, 2):
            raise RuntimeError(f"doctor failed ({res.returncode}): {res.stderr[-500:]!r}")
        data = json.loads(res.stdout)
        run.timings = {k: float(v) for k, v in data["timings_s"].items()}
        self.client = str(data.get("ssh_client", "?"))
        run.unreachable = len(data["unreachable"])
        if data["unreachable"]:  # a node that did not answer makes the time meaningless
            host, why = next(iter(data["unreachable"].items()))
            print(f"    !! doctor: {len(data['unreachable'])} node(s) unreachable, e.g. "
                  f"{host}: {why.get('kind')}: {why.get('error')}")
        return run


def bench_size(size: Size, repeat: int) -> float:
    """Interleaved pairs; prints each pair and returns the median ratio."""
    print(f"--- {size.n} nodes: {repeat} interleaved pair(s)  (load avg before "
          f"{os.getloadavg()[0]:.1f})", flush=True)
    ratios, floors, doctors = [], [], []
    for i in range(repeat):
        first_floor = i % 2 == 0
        if first_floor:
            floor = size.floor()
            doc = size.doctor()
        else:
            doc = size.doctor()
            floor = size.floor()
        floors.append(floor)
        doctors.append(doc)
        ratios.append(doc.wall_s / floor.wall_s)
        print(f"  pair {i + 1} ({'floor first' if first_floor else 'doctor first'}): "
              f"pdsh true {floor.wall_s:6.2f} s (load {floor.load:5.1f})   "
              f"doctor {doc.wall_s:6.2f} s (load {doc.load:5.1f}; in-process "
              f"{doc.timings.get('total', float('nan')):.2f} s)   "
              f"ratio {ratios[-1]:.2f}", flush=True)
    print(f"  doctor's SSH client: {size.client}")
    _breakdown(floors, doctors)
    ratio = statistics.median(ratios)
    verdict = "ok" if ratio <= 1.2 else "OVER the 1.2 goal"
    if any(r.unreachable for r in doctors):
        verdict += ("; NOT COMPARABLE: doctor gave up on unreachable nodes (its timeouts) "
                    "that pdsh waited for")
    print(f"  => {size.n} nodes: doctor/floor median {ratio:.2f} ({verdict}); medians "
          f"pdsh {statistics.median(r.wall_s for r in floors):.2f} s, doctor "
          f"{statistics.median(r.wall_s for r in doctors):.2f} s", flush=True)
    return ratio


def _breakdown(floors: Sequence[Run], doctors: Sequence[Run]) -> None:
    def med(values: Sequence[float]) -> float:
        return statistics.median(values) if values else float("nan")

    print(f"  launcher CPU (median, process + its ssh children): pdsh "
          f"{med([r.cpu_s for r in floors]):.2f} s, doctor {med([r.cpu_s for r in doctors]):.2f} s")
    keys = ("ssh_setup_max", "command_median", "command_max", "probe_work_max", "facts",
            "rules", "total")
    parts = [f"{k} {med([r.timings[k] for r in doctors if k in r.timings]):.2f}"
             for k in keys if any(k in r.timings for r in doctors)]
    print(f"  doctor timings_s (median): {', '.join(parts)}")


def node_costs(tb: Testbed, peers: int, workdir: Path) -> None:
    """CPU of the remote work per node, measured inside node1 (5 runs each)."""
    script = workdir / "node_costs.py"
    script.write_text(_NODE_COSTS)
    inv = workdir / f"inventory-{peers}.yaml"
    res = tb.exec(tb.nodes[0], [sys.executable, str(script), str(inv)], timeout=300,
                  cwd=str(Path.cwd()))
    print("per-node remote CPU (inside node1, median of 5):")
    for line in (res.stdout or res.stderr).strip().splitlines():
        print(f"  {line}")


_NODE_COSTS = '''
import os, resource, statistics, subprocess, sys
from clusterkit.checks.doctor_plan import plan_doctor
from clusterkit.checks.invoke import probe_source
from clusterkit.inventory import load_inventory
hosts = list(load_inventory(sys.argv[1]).hosts)
plan = plan_doctor(hosts, head_python=sys.executable, head_cwd="/tmp", head_tools={},
                   master_port=None)
def cpu(argv, stdin=None):
    runs = []
    for _ in range(5):
        a = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(argv, input=stdin, capture_output=True, check=False)
        b = resource.getrusage(resource.RUSAGE_CHILDREN)
        runs.append(b.ru_utime - a.ru_utime + b.ru_stime - a.ru_stime)
    return statistics.median(runs) * 1000
login = "source ~/.bashrc 2>/dev/null; true"
print(f"login shell (bash + ~/.bashrc; pdsh pays it too) {cpu(['bash', '-c', login]):6.1f} ms")
print(f"python -c pass (interpreter + site)               {cpu([sys.executable, '-c', 'pass']):6.1f} ms")
print(f"probe facts, {len(hosts)} peers (incl. interpreter)      "
      f"{cpu(list(plan.nodes[0].argv), probe_source()):6.1f} ms  "
      f"({len(probe_source())} bytes on stdin)")
'''


def cli_startup(workdir: Path) -> None:
    run, _ = _timed([sys.executable, "-m", "clusterkit", "doctor", "--help"], cwd=workdir)
    print(f"CLI start-up (python -m clusterkit doctor --help): {run.wall_s:.2f} s wall, "
          f"{run.cpu_s:.2f} s CPU (load {run.load:.1f})")


def _with_bed(mask_bashrc: bool, body: Callable[[Testbed], None]) -> None:
    tb = Testbed.create(mask_bashrc=mask_bashrc)
    try:
        body(tb)
    finally:
        # A second Ctrl-C must not interrupt the tear-down itself.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            tb.down()
            print(f"test bed {tb.prefix} removed", flush=True)
        finally:
            signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--sizes", type=int, nargs="+", default=[7, 32, 128])
    parser.add_argument("--repeat", type=int, default=3, help="interleaved pairs per size")
    parser.add_argument("--mask-bashrc", action="store_true",
                        help="nodes skip root's ~/.bashrc (on this host it runs `pyenv init`)")
    args = parser.parse_args(argv)
    print(f"bench.doctor: sizes {args.sizes}, {args.repeat} pair(s) each, "
          f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}, "
          f"bashrc {'masked' if args.mask_bashrc else 'as on this host'}, "
          f"CLUSTERKIT_SSH_CLIENT={os.environ.get('CLUSTERKIT_SSH_CLIENT', '(auto)')}",
          flush=True)

    def body(tb: Testbed) -> None:
        workdir = tb.root / "work"
        ratios = {n: bench_size(Size(tb, n, workdir), args.repeat) for n in sorted(args.sizes)}
        node_costs(tb, max(args.sizes), workdir)
        cli_startup(workdir)
        print("summary: " + "   ".join(f"{n} nodes {r:.2f}x" for n, r in ratios.items())
              + f"   (goal <= 1.2x; load avg now {os.getloadavg()[0]:.1f})")

    try:
        _with_bed(args.mask_bashrc, body)
    except KeyboardInterrupt:
        print("interrupted; test bed removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
