"""collect-ckpt throughput vs ``rsync -a`` (sequential, parallel) and a local ``cp`` (the limit).

    python -m bench.collect                          # 7 nodes, 350 MB, 3 rounds, own test bed
    python -m bench.collect --prefix ckc --total-mb 700 --rounds 5
    python -m bench.collect --mask-bashrc            # nodes without root's ~/.bashrc

Writes a synthetic node-local checkpoint (random bytes, DeepSpeed's names, markers;
2 ranks per node) on every node, then times, in interleaved rounds and into a fresh
DEST each time:

* ``cp``          local ``cp -r`` of every node's files (read from the host side of the
                  node-private mounts): no network, no crypto, no checksums — the limit;
* ``rsync seq``   ``rsync -a -e 'ssh -F <test bed config>'`` node by node;
* ``rsync par``   the same, all nodes at once;
* ``collect``     ``collect()`` end to end: listing + sha256 on the nodes + verified copy
                  (``ssh`` data path, fsync per file), and its copy phase alone;
* ``collect sftp`` the same over paramiko SFTP (the fallback data path).

Ratios are of median throughputs (bytes of the shards / wall seconds). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from clusterkit.checkpoints import synthetic
from clusterkit.checkpoints.collect import CollectNode, CollectOptions, collect
from clusterkit.remote.dispatch import DispatchTransport
from tests.testbed import Testbed

TAG = "global_step1"


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bench(tb: Testbed, n: int, total_mb: int, rounds: int, jobs: int, work: str) -> dict[str, float]:
    nodes = tb.ensure(n)
    inside = f"{tb.local_mountpoint}/bench-collect"
    host_roots = [str(tb.node_local_path(node, inside)) for node in nodes]
    for r in host_roots:
        shutil.rmtree(r, ignore_errors=True)
    shard = total_mb * 10**6 // (2 * n)
    synthetic.write_node_local(host_roots, shard_bytes=shard, model_bytes=1 << 16,
                               hosts=[node.name for node in nodes])
    total = sum(_bytes_under(r) for r in host_roots)
    cnodes = [CollectNode(node.name, tb.ssh_target(node), sys.executable, inside) for node in nodes]
    dest = os.path.join(work, "dest")
    ssh = f"ssh -F {tb.ssh_config}"

    def cp() -> None:
        for i, r in enumerate(host_roots):
            subprocess.run(["cp", "-r", r, os.path.join(dest, f"n{i}")], check=True)

    def rsync_argv(i: int) -> list[str]:
        return ["rsync", "-a", "-e", ssh, f"{nodes[i].name}:{inside}/", os.path.join(dest, f"n{i}/")]

    def rsync_seq() -> None:
        for i in range(n):
            subprocess.run(rsync_argv(i), check=True, timeout=600)

    def rsync_par() -> None:
        procs = [subprocess.Popen(rsync_argv(i)) for i in range(n)]
        assert [p.wait(timeout=600) for p in procs] == [0] * n

    copy_phase: list[float] = []

    def run_collect(method: str) -> Callable[[], None]:
        def go() -> None:
            with DispatchTransport() as t:
                rep = collect(t, cnodes, CollectOptions(dest=dest, jobs=jobs, method=method))
            assert not rep.failed and rep.skipped == 0
            if method == "ssh":
                copy_phase.append(rep.seconds_copy)
        return go

    cases: dict[str, Callable[[], None]] = {
        "cp": cp, "rsync seq": rsync_seq, "rsync par": rsync_par,
        "collect": run_collect("ssh"), "collect sftp": run_collect("sftp")}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            shutil.rmtree(dest, ignore_errors=True)
            os.makedirs(dest)
            subprocess.run(["sync"], check=True)  # no writeback of the last case in this one
            t0 = time.monotonic()
            fn()
            times[name].append(time.monotonic() - t0)
    shutil.rmtree(dest, ignore_errors=True)
    times["collect (copy phase)"] = copy_phase
    mbps = {k: total / statistics.median(v) / 1e6 for k, v in times.items()}
    print(f"{n} nodes, {total / 1e6:,.0f} MB in {2 * n} shards of {shard / 1e6:,.1f} MB, "
          f"{rounds} rounds, collect --jobs {jobs}")
    for k, v in times.items():
        print(f"  {k:<22} {mbps[k]:8.1f} MB/s   median {statistics.median(v):6.2f} s   runs "
              + " ".join(f"{t:.2f}" for t in v))
    ratios = {
        "collect / rsync par": mbps["collect"] / mbps["rsync par"],
        "collect / rsync seq": mbps["collect"] / mbps["rsync seq"],
        "collect / cp": mbps["collect"] / mbps["cp"],
        "collect copy phase / rsync par": mbps["collect (copy phase)"] / mbps["rsync par"],
        "collect copy phase / cp": mbps["collect (copy phase)"] / mbps["cp"],
        "collect sftp / rsync par": mbps["collect sftp"] / mbps["rsync par"],
    }
    for label, ratio in ratios.items():
        print(f"  {label:<32} {ratio:6.2f}x")
    for r in host_roots:
        shutil.rmtree(r, ignore_errors=True)
    return {**{f"{k} MB/s": v for k, v in mbps.items()}, **ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.collect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=7)
    p.add_argument("--total-mb", type=int, default=350)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--prefix", help="use this existing test bed (else a new one, torn down)")
    p.add_argument("--mask-bashrc", action="store_true")
    p.add_argument("--work", default="/tmp/clusterkit-bench-collect", help="scratch dir for DEST")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    tb = Testbed.load(args.prefix) if args.prefix else Testbed.create(mask_bashrc=args.mask_bashrc)
    try:
        out = bench(tb, args.nodes, args.total_mb, args.rounds, args.jobs, args.work)
    finally:
        if not args.prefix:
            tb.down()
        shutil.rmtree(args.work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
