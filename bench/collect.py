"""collect-ckpt throughput vs parallel ``rsync -a`` and a local ``cp -r`` of the same files.

    python -m bench.collect                              # tiny + large, 3 rounds, own test bed
    python -m bench.collect --sizes large --repeat 5     # only the 7 x 2 x 256 MB case
    python -m bench.collect --ciphers                    # also: ssh ciphers, paramiko SFTP
    python -m bench.collect --prefix ckc                 # an existing test bed (kept)
    python -m bench.collect --slurm                      # a Slurm bed: ~1 GB, 4 nodes

Two checkpoint sizes, both a synthetic node-local ZeRO-2 layout (DeepSpeed's names,
completion markers, 2 ranks per node, incompressible bytes — no zeros, no holes):

* ``tiny``   7 nodes x 2 shards of 300 KB (what the bundled tiny workload writes);
* ``large``  7 nodes x 2 shards of 256 MB (+ 64 MB model states per node): 4 GB.

For each size, in interleaved rounds, each into a fresh DEST on this machine:

* ``cp``           local ``cp -r`` of every node's files (from the host side of the
                   node-private mounts): no network, no crypto, no checksum — the limit;
* ``cp+fsync``     the same, then an fsync of every copied file (``sync FILE...``): the
                   baseline for collect's default, which fsyncs each file;
* ``rsync par``    ``rsync -a -e 'ssh -F <test bed config>'``, all nodes at once;
* ``collect``      ``collect()`` end to end, default options (listing, sha256 on both
                   ends, fsync of every file before its rename);
* ``collect nofsync``  the same with ``--no-fsync`` (what cp and rsync do);
* ``collect sftp`` (tiny only) the paramiko SFTP fallback.

Every run prints its seconds with the 1-minute load average at its start; the summary
gives median MB/s and the ratios collect / rsync par and collect / cp with the median
load of the runs. The machine is shared: read ratios together with that load (the
test bed's nodes are namespaces of this machine, so sender and receiver share its CPUs).
Everything written (shards on the nodes, DEST, a bed made here) is removed at the end,
also on Ctrl-C or SIGTERM. Needs root.

``--slurm`` (issue 31): a Slurm cluster over the bed's first ``--nodes`` (default 4)
nodes and the ``slurm1g`` size (4 x (2 x 112 + 32) MB, ~1 GB); the cases are
``collect ssh`` (OpenSSH sessions), ``collect slurm`` (a one-task allocation per node,
the bytes on a socket back to this process) and ``collect slurm stdout`` (the same with
the socket refused, so the bytes ride srun's stdout: the fallback), each with the ratio
to ``collect ssh`` measured in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.sources import session
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.remote.dispatch import DispatchTransport
from clusterkit.slurm.steps import SlurmPlace
from tests import synthetic_ckpt as synthetic
from tests.slurmbed.cluster import SlurmBed
from tests.testbed import Testbed

TAG = "global_step1"
SIZES = {"tiny": (300_000, 100_000), "large": (256 << 20, 64 << 20),  # shard, model states
         "slurm1g": (112 << 20, 32 << 20)}


def _load() -> float:
    return os.getloadavg()[0]


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@dataclass
class Case:
    name: str
    run: Callable[[], None]
    secs: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)


@dataclass
class SizeBench:
    """One checkpoint size on the test bed: its files, DEST, and the cases to time."""

    tb: Testbed
    size: str
    nodes: int
    jobs: int
    work: str
    inside: str = ""
    host_roots: list[str] = field(default_factory=list)
    total: int = 0

    def setup(self) -> None:
        nodes = self.tb.ensure(self.nodes)
        self.inside = f"{self.tb.local_mountpoint}/bench-collect-{self.size}"
        self.host_roots = [str(self.tb.node_local_path(n, self.inside)) for n in nodes]
        self.cleanup()
        shard, model = SIZES[self.size]
        t0 = time.monotonic()
        synthetic.write_node_local(self.host_roots, shard_bytes=shard, model_bytes=model,
                                   hosts=[n.name for n in nodes])
        self.total = sum(_bytes_under(r) for r in self.host_roots)
        print(f"[{self.size}] wrote {self.total / 1e6:,.1f} MB on {self.nodes} nodes in "
              f"{time.monotonic() - t0:.1f} s", flush=True)

    def cleanup(self) -> None:
        for r in self.host_roots:
            shutil.rmtree(r, ignore_errors=True)
        shutil.rmtree(self.dest, ignore_errors=True)

    @property
    def dest(self) -> str:
        return os.path.join(self.work, f"dest-{self.size}")

    def cases(self) -> list[Case]:
        if self.size == "slurm1g":
            return [Case("collect ssh", self.collector("ssh", fsync=True)),
                    Case("collect slurm", self.slurm_collector(socket=True)),
                    Case("collect slurm stdout", self.slurm_collector(socket=False))]
        out = [Case("cp", self.cp), Case("cp+fsync", self.cp_fsync),
               Case("rsync par", self.rsync_par),
               Case("collect", self.collector("ssh", fsync=True)),
               Case("collect nofsync", self.collector("ssh", fsync=False))]
        if self.size == "tiny":
            out.append(Case("collect sftp", self.collector("sftp", fsync=True)))
        return out

    def cp(self) -> None:
        for i, r in enumerate(self.host_roots):
            subprocess.run(["cp", "-r", r, os.path.join(self.dest, f"n{i}")], check=True)

    def cp_fsync(self) -> None:
        """cp, then fsync every copied file (coreutils ``sync FILE...``): the fair
        baseline for collect's default, which fsyncs each file before its rename."""
        self.cp()
        files = [os.path.join(d, f) for d, _, fs in os.walk(self.dest) for f in fs]
        for i in range(0, len(files), 256):
            subprocess.run(["sync", *files[i:i + 256]], check=True)

    def rsync_par(self) -> None:
        ssh = f"ssh -F {self.tb.ssh_config}"
        procs = [subprocess.Popen(["rsync", "-a", "-e", ssh, f"{n.name}:{self.inside}/",
                                   os.path.join(self.dest, f"n{i}/")])
                 for i, n in enumerate(self.tb.nodes[:self.nodes])]
        try:
            assert [p.wait(timeout=1800) for p in procs] == [0] * len(procs)
        finally:  # Ctrl-C: no rsync left writing into a DEST being removed
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def collector(self, method: str, fsync: bool) -> Callable[[], None]:
        cnodes = [CollectNode(n.name, self.tb.ssh_target(n), sys.executable, self.inside)
                  for n in self.tb.nodes[:self.nodes]]

        def go() -> None:
            with DispatchTransport() as t:
                rep = collect(t, cnodes, CollectOptions(dest=self.dest, jobs=self.jobs,
                                                        method=method, fsync=fsync))
            assert not rep.failed and rep.skipped == 0
        return go


    def slurm_collector(self, socket: bool) -> Callable[[], None]:
        """collect through Slurm (a one-task allocation per node); ``socket`` False:
        the node's connection back is refused (port 1), so the bytes ride srun's stdout."""
        cnodes = [CollectNode(n.name, self.tb.ssh_target(n), sys.executable, self.inside,
                              via=SlurmPlace(n.name)) for n in self.tb.nodes[:self.nodes]]

        def go() -> None:
            real = session.BackChannel.request
            if not socket:
                session.BackChannel.request = lambda self: json.dumps(  # type: ignore[method-assign]
                    {"op": "socket", "port": 1, "secret": self.secret}).encode() + b"\n"
            try:
                with DispatchTransport() as t:
                    rep = collect(t, cnodes, CollectOptions(dest=self.dest, jobs=self.jobs,
                                                            method="slurm", fsync=True))
            finally:
                session.BackChannel.request = real  # type: ignore[method-assign]
            assert not rep.failed and rep.skipped == 0
            assert ("a socket per node" in rep.method) == socket, rep.method
        return go


def time_rounds(sb: SizeBench, rounds: int) -> list[Case]:
    cases = sb.cases()
    for r in range(rounds):
        for c in cases:
            shutil.rmtree(sb.dest, ignore_errors=True)
            os.makedirs(sb.dest)
            subprocess.run(["sync"], check=True)  # the last case's writeback is not this one's
            c.loads.append(_load())
            t0 = time.monotonic()
            c.run()
            c.secs.append(time.monotonic() - t0)
            print(f"[{sb.size}] round {r + 1}/{rounds} {c.name:<16} {c.secs[-1]:7.2f} s  "
                  f"{sb.total / c.secs[-1] / 1e6:8.1f} MB/s  (load {c.loads[-1]:.1f})", flush=True)
    shutil.rmtree(sb.dest, ignore_errors=True)
    return cases


def summarize(sb: SizeBench, cases: list[Case]) -> dict[str, float]:
    mbps = {c.name: sb.total / statistics.median(c.secs) / 1e6 for c in cases}
    load = {c.name: statistics.median(c.loads) for c in cases}
    shard = SIZES[sb.size][0]
    print(f"\n[{sb.size}] {sb.nodes} nodes, {sb.total / 1e6:,.1f} MB, shards of "
          f"{shard / 1e6:,.1f} MB, {len(cases[0].secs)} rounds, collect --jobs {sb.jobs}")
    for c in cases:
        print(f"  {c.name:<16} {mbps[c.name]:9.1f} MB/s  median {statistics.median(c.secs):7.2f} s"
              f"  (median load {load[c.name]:.1f}; runs "
              + ", ".join(f"{t:.2f} s @ {ld:.1f}" for t, ld in zip(c.secs, c.loads, strict=True))
              + ")")
    out = {f"{k} MB/s": v for k, v in mbps.items()}
    for name in [c.name for c in cases if c.name.startswith("collect")]:
        for base in [b for b in ("rsync par", "cp", "cp+fsync", "collect ssh")
                     if b in mbps and b != name]:
            ratio = mbps[name] / mbps[base]
            out[f"{name} / {base}"] = ratio
            print(f"  {name + ' / ' + base:<30} {ratio:6.2f}x  (load {load[name]:.1f} vs "
                  f"{load[base]:.1f})")
    return out


# ------------------------------------------------------------------ ciphers, paramiko


def bench_ciphers(tb: Testbed, work: str, mb: int, rounds: int) -> dict[str, float]:
    """One node -> here, one file of ``mb`` MB to /dev/null: each OpenSSH cipher with
    compression off (and aes128-gcm with compression on), and paramiko SFTP."""
    node = tb.ensure(1)[0]
    inside = f"{tb.local_mountpoint}/bench-cipher"
    host = str(tb.node_local_path(node, inside))
    synthetic._write_random(os.path.join(host, "f"), mb << 20)
    variants = [(c, "no") for c in ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com",
                                    "chacha20-poly1305@openssh.com", "aes128-ctr")]
    variants.append(("aes128-gcm@openssh.com", "yes"))
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}

    def timed(key: str, nbytes: int, fn: Callable[[], None]) -> None:
        load = _load()
        t0 = time.monotonic()
        fn()
        times.setdefault(key, []).append(time.monotonic() - t0)
        sizes[key] = nbytes
        print(f"  {key:<52} {nbytes / times[key][-1] / 1e6:8.1f} MB/s (load {load:.1f})",
              flush=True)

    def ssh_cat(cipher: str, comp: str, nbytes: int) -> Callable[[], None]:
        argv = ["ssh", "-F", str(tb.ssh_config), "-o", f"Compression={comp}", "-c", cipher,
                node.name, "head", "-c", str(nbytes), f"{inside}/f"]

        def run() -> None:
            subprocess.run(argv, stdout=subprocess.DEVNULL, check=True, timeout=900)
        return run

    def sftp() -> None:
        with DispatchTransport() as t:
            t.get(tb.ssh_target(node), f"{inside}/f", os.path.join(work, "sftp-f"))
        os.unlink(os.path.join(work, "sftp-f"))

    try:
        for _ in range(rounds):
            for cipher, comp in variants:
                # zlib on random bytes runs at a few MB/s: a 64 MB sample says enough.
                nbytes = (mb << 20) if comp == "no" else min(mb, 64) << 20
                timed(f"ssh {cipher} compression={comp}", nbytes, ssh_cat(cipher, comp, nbytes))
            timed("paramiko sftp get", mb << 20, sftp)
    finally:
        shutil.rmtree(host, ignore_errors=True)
    out = {k: sizes[k] / statistics.median(v) / 1e6 for k, v in times.items()}
    print(f"\nciphers: {mb} MB, one stream, median of {rounds}")
    for k, v in out.items():
        print(f"  {k:<52} {v:8.1f} MB/s")
    return out


def _sigterm(_sig: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # run the finally blocks: nothing left on the nodes or in --work


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.collect", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, help="default 7; 4 with --slurm")
    p.add_argument("--sizes", help="comma list of: " + ", ".join(SIZES)
                   + " (default tiny,large; slurm1g with --slurm)")
    p.add_argument("--slurm", action="store_true", help="collect through Slurm vs over SSH")
    p.add_argument("--repeat", "--rounds", type=int, default=3, dest="repeat")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--ciphers", action="store_true", help="also time ssh ciphers and SFTP")
    p.add_argument("--cipher-mb", type=int, default=1024)
    p.add_argument("--prefix", help="use this existing test bed (else a new one, torn down)")
    p.add_argument("--mask-bashrc", action="store_true")
    p.add_argument("--work", default="/tmp/clusterkit-bench-collect", help="scratch dir for DEST")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.nodes = args.nodes or (4 if args.slurm else 7)
    args.sizes = args.sizes or ("slurm1g" if args.slurm else "tiny,large")
    signal.signal(signal.SIGTERM, _sigterm)
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} CPUs)", flush=True)
    tb = Testbed.load(args.prefix) if args.prefix else Testbed.create(mask_bashrc=args.mask_bashrc)
    os.makedirs(args.work, exist_ok=True)
    out: dict[str, dict[str, float]] = {}
    benches: list[SizeBench] = []
    bed: SlurmBed | None = None
    try:
        if args.slurm:
            bed = SlurmBed.start(tb, args.nodes)
            os.environ["SLURM_CONF"] = str(bed.conf)  # srun finds this cluster
        if args.ciphers:
            out["ciphers"] = bench_ciphers(tb, args.work, args.cipher_mb, args.repeat)
        for size in args.sizes.split(","):
            sb = SizeBench(tb, size, args.nodes, args.jobs, args.work)
            benches.append(sb)
            sb.setup()
            out[size] = summarize(sb, time_rounds(sb, args.repeat))
            sb.cleanup()
    finally:
        for sb in benches:
            sb.cleanup()
        shutil.rmtree(args.work, ignore_errors=True)
        if bed is not None:
            bed.stop()
        if not args.prefix:
            tb.down()
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
