"""Is paramiko's fan-out competitive with pdsh? ``run_all(true)`` vs ``pdsh -R ssh true``.

    python -m bench.transport --nodes 7 --rounds 5            # own test bed, torn down after
    python -m bench.transport --prefix cktb-xyz --rounds 5     # an existing test bed
    python -m bench.transport --mask-bashrc                    # without root's ~/.bashrc

Reports the median wall time of: a cold run_all (new SSHTransport: TCP + kex +
auth per node, the doctor's case), a warm run_all (connections reused), and
``pdsh -R ssh -w <nodes> true`` over the same nodes with the same ssh config.
Needs root (the namespace test bed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from clusterkit.remote.ssh import SSHTransport
from tests.testbed import Testbed


def bench(tb: Testbed, n: int, rounds: int) -> dict[str, float]:
    nodes = tb.ensure(n)
    targets = [tb.ssh_target(node) for node in nodes]

    def cold() -> None:
        with SSHTransport() as t:
            group = t.run_all(targets, ["true"])
        assert len(group.succeeded) == n, [str(r.error) for r in group.failed]

    warm_transport = SSHTransport()
    warm_transport.run_all(targets, ["true"])

    def warm() -> None:
        group = warm_transport.run_all(targets, ["true"])
        assert len(group.succeeded) == n

    env = dict(os.environ, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS_APPEND=f"-F {tb.ssh_config}")
    hosts = ",".join(node.name for node in nodes)

    def pdsh() -> None:
        subprocess.run(["pdsh", "-R", "ssh", "-w", hosts, "true"], env=env, check=True, timeout=120)

    # Interleaved rounds, so load from other work on the machine hits all three alike.
    cases = {"pdsh": pdsh, "run_all cold": cold, "run_all warm": warm}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.monotonic()
            fn()
            times[name].append(time.monotonic() - start)
    results = {}
    for name, runs in times.items():
        results[name] = statistics.median(runs)
        print(f"{name:<14} median {results[name]:6.3f} s   runs {' '.join(f'{t:.3f}' for t in runs)}")
    warm_transport.close()
    print(f"cold / pdsh = {results['run_all cold'] / results['pdsh']:.2f} (doctor goal <= 1.2)")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--nodes", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix", help="use this existing test bed instead of a new one")
    parser.add_argument(
        "--mask-bashrc",
        action="store_true",
        help="hide root's ~/.bashrc on the nodes: measure the transport, not the login shell",
    )
    args = parser.parse_args(argv)
    if args.prefix:
        bench(Testbed.load(args.prefix), args.nodes, args.rounds)
        return 0
    tb = Testbed.create(mask_bashrc=args.mask_bashrc)
    try:
        bench(tb, args.nodes, args.rounds)
    finally:
        tb.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
