"""How fast is ``clusterkit doctor``? Against the bare SSH fan-out floor and a sequential loop.

    python -m bench.doctor                        # 7, 32 and 128 nodes, own test bed
    python -m bench.doctor --sizes 7 32 --rounds 3
    python -m bench.doctor --prefix dr --sizes 7  # an existing test bed (grown if needed)

For every size, in the same run and interleaved round by round (so load from
other work on the machine hits all alike):

* ``pdsh``: ``pdsh -R ssh -w <nodes> true`` with the test bed's ssh config via
  ``PDSH_SSH_ARGS_APPEND`` (pdsh's default fan-out, 32) — the floor;
* ``pdsh probe``: the same, running doctor's probe on every node
  (``python -c <probe> facts ...``): the floor for the same remote work;
* ``doctor``: ``python -m clusterkit doctor --json`` as a user runs it (fresh
  process: imports, SSH handshakes, probes, master-port check; no --bandwidth);
* ``doctor in-process``: :func:`run_doctor` alone (no interpreter start-up);
* ``sequential ssh``: ``ssh node <python> - facts ...`` one node after the other,
  the same probe and arguments as doctor sends (stdin = the probe).

Prints medians and the ratios doctor/pdsh (goal <= 1.2) and sequential/doctor
(goal >= 5 at 32 nodes). Needs root (the namespace test bed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from clusterkit.checks.doctor import plan_doctor, run_doctor
from clusterkit.checks.invoke import probe_source
from clusterkit.inventory import load_inventory
from clusterkit.remote.dispatch import DispatchTransport
from tests.testbed import Testbed


def _cases(tb: Testbed, n: int, workdir: Path) -> dict[str, Callable[[], None]]:
    nodes = tb.ensure(n)[:n]
    inv_path = tb.write_inventory(workdir / f"inventory-{n}.yaml", nodes)
    hosts = list(load_inventory(inv_path).hosts)
    env = dict(os.environ, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS_APPEND=f"-F {tb.ssh_config}")
    names = ",".join(node.name for node in nodes)
    plan = plan_doctor(hosts, head_python=sys.executable, head_cwd=str(workdir),
                       head_tools={}, master_port=29500)
    probe = probe_source()

    def pdsh() -> None:
        subprocess.run(["pdsh", "-R", "ssh", "-w", names, "true"], env=env, check=True,
                       timeout=600, stdout=subprocess.DEVNULL)

    def doctor_cli() -> None:
        res = subprocess.run([sys.executable, "-m", "clusterkit", "doctor", "-i", str(inv_path),
                              "--json"], capture_output=True, timeout=600, cwd=workdir)
        if res.returncode not in (0, 1, 2):
            raise RuntimeError(f"doctor failed: {res.returncode} {res.stderr[-500:]!r}")
        data = json.loads(res.stdout)
        _note("doctor", data["unreachable"], data["timings_s"])

    def doctor_inproc() -> None:
        with DispatchTransport() as transport:
            report = run_doctor(plan, transport)
        bad = {h: {"kind": f.error_kind, "error": f.probe_error}
               for h, f in report.facts.items() if not f.ok}
        _note("in-process", bad, report.timings)

    # pdsh cannot feed one stdin to many nodes: the probe travels as `python -c SOURCE`.
    probe_cmd = {p.host: shlex.join([p.python, "-c", probe.decode(), *_no_master(p.argv)[2:]])
                 for p in plan.nodes}

    def pdsh_probe() -> None:
        # Same remote work as doctor (every node runs the probe), pdsh's fan-out.
        cmd = next(iter(probe_cmd.values()))  # identical on every node of a test bed
        res = subprocess.run(["pdsh", "-R", "ssh", "-w", names, cmd], env=env, timeout=600,
                             capture_output=True)
        if res.returncode != 0 or res.stdout.count(b'"schema"') != n:
            raise RuntimeError(f"pdsh probe failed: {res.returncode} {res.stderr[-300:]!r}")

    def sequential() -> None:
        # The same probe argv doctor sends, minus the master connect (no listener here).
        for node, probe_plan in zip(nodes, plan.nodes, strict=True):
            argv = _no_master(probe_plan.argv)
            subprocess.run(["ssh", "-F", str(tb.ssh_config), node.name, shlex.join(argv)],
                           input=probe, check=True, capture_output=True, timeout=120)

    return {"pdsh": pdsh, "pdsh probe": pdsh_probe, "doctor": doctor_cli,
            "doctor in-process": doctor_inproc, "sequential ssh": sequential}


def _no_master(argv: tuple[str, ...]) -> list[str]:
    """The probe argv without ``--master H:P --master-wait S`` (no listener outside doctor)."""
    words = list(argv)
    if "--master" in words:
        cut = words.index("--master")
        del words[cut:cut + 4]
    return words


def _note(what: str, unreachable: Mapping[str, Any], timings: Mapping[str, float]) -> None:
    """A node that did not answer makes the run's time meaningless: say so, loudly."""
    parts = " ".join(f"{k}={v:.2f}" for k, v in timings.items())
    print(f"    [{what}] timings_s {parts}", flush=True)
    if unreachable:
        kinds = Counter(str(v.get("kind")) for v in unreachable.values())
        first = next(iter(unreachable.items()))
        print(f"    [{what}] UNREACHABLE {len(unreachable)}: {dict(kinds)}; e.g. {first}",
              flush=True)


def bench_size(tb: Testbed, n: int, rounds: int, workdir: Path, skip_sequential: bool
               ) -> dict[str, float]:
    cases = _cases(tb, n, workdir)
    if skip_sequential:
        cases.pop("sequential ssh")
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.monotonic()
            fn()
            times[name].append(time.monotonic() - start)
    med = {name: statistics.median(runs) for name, runs in times.items()}
    print(f"--- {n} nodes ({rounds} round(s), load avg {os.getloadavg()[0]:.1f})")
    for name, runs in times.items():
        print(f"  {name:<18} median {med[name]:7.2f} s   runs {' '.join(f'{t:.2f}' for t in runs)}")
    print(f"  doctor / pdsh            = {med['doctor'] / med['pdsh']:.2f}  (goal <= 1.2)")
    print(f"  doctor in-process / pdsh = {med['doctor in-process'] / med['pdsh']:.2f}")
    print(f"  doctor / pdsh probe      = {med['doctor'] / med['pdsh probe']:.2f}  "
          "(same remote work, pdsh's fan-out)")
    if "sequential ssh" in med:
        print(f"  sequential / doctor      = {med['sequential ssh'] / med['doctor']:.1f}  "
              "(goal >= 5 at 32 nodes)")
    sys.stdout.flush()
    return med


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[7, 32, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rounds-large", type=int, default=1, help="rounds for sizes > 32")
    parser.add_argument("--no-sequential-above", type=int, default=32,
                        help="skip the sequential loop above this many nodes")
    parser.add_argument("--prefix", help="use this existing test bed instead of a new one")
    parser.add_argument("--mask-bashrc", action="store_true",
                        help="nodes skip root's ~/.bashrc (on this host it runs `pyenv init`, "
                        "whose rehash lock serialises logins: every node shares /root/.pyenv)")
    args = parser.parse_args(argv)
    tb = Testbed.load(args.prefix) if args.prefix else Testbed.create(mask_bashrc=args.mask_bashrc)
    workdir = tb.root / "work"
    try:
        for n in args.sizes:
            rounds = args.rounds if n <= 32 else args.rounds_large
            bench_size(tb, n, rounds, workdir, n > args.no_sequential_above)
    finally:
        if not args.prefix:
            tb.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
