"""Putting S bytes on N nodes: ``clusterkit sync`` (a pipelined chain) against size/rate,
parallel rsync from the launcher and the old one-tar-per-node sync (issue 29).

    python -m bench.bench_sync                          # 7 nodes, 400 Mbit/s, 1 GiB, 1 round
    python -m bench.bench_sync --nodes 16 --rounds 2
    python -m bench.bench_sync --rate 300 --big-mib 192 --small 500   # a smaller data set
    python -m bench.bench_sync --old-mib 32             # the old sync on 32 MiB (it cannot do 1 GiB)

On the test bed (tests/testbed: a network namespace with sshd per node, node-private
``/scratch``), every link is shaped with ``tc`` to the same rate R: each node's down link
(tbf on the host side of its veth) and up link (tbf on its eth0), and the launching
machine's own link (tbf on the bridge, which carries everything this machine sends to
any node). The data: a ``--big-mib`` file and ``--small`` small files making up the rest
of ``--total-mib`` (default 768 MiB + 2,000 files = 1 GiB). Each round runs, in turn:
clusterkit sync to empty destinations, parallel rsync (one ``rsync -a`` over ssh per
node, all at once) to empty destinations (``--rsync-mib``: on the first that many MiB of
the data only, when N copies through one link would take too long), and, once, the old
sync (git ``--old-commit``, on ``--old-mib``, stopped after ``--old-timeout`` s). Each
line prints the seconds, the ratio to its own size/rate, the launcher's peak RSS (the
child's ru_maxrss) and the 1-minute load average at the start. After the rounds: a
second sync with nothing changed (seconds, bytes sent) and one with one small file
changed (only it travels). The machine is shared: read every figure with its load.
The destination is each node's private ``/dev/shm`` (the test bed's nodes share one
host disk, which could not take N copies at the link's rate: ~117 MB/s with fsync here).
Everything written is removed at the end; ``--prefix`` uses an existing test bed. Root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.testbed import Testbed

REPO = Path(__file__).resolve().parents[1]
OLD_COMMIT = "410e7ca^"  # the last tree with the one-tar-per-node sync


def _load() -> float:
    return os.getloadavg()[0]


def _sh(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def shape(tb: Testbed, nodes: list[Any], mbit: int) -> None:
    """Every link at ``mbit``: each node's down link and up link, and this machine's."""
    spec = ["tbf", "rate", f"{mbit}mbit", "burst", "512kb", "latency", "100ms"]
    _sh(["tc", "qdisc", "replace", "dev", tb.bridge, "root", *spec])
    for n in nodes:
        _sh(["tc", "qdisc", "replace", "dev", n.veth, "root", *spec])
        tb.exec(n, ["tc", "qdisc", "replace", "dev", "eth0", "root", *spec], check=True)


def unshape(tb: Testbed, nodes: list[Any]) -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", tb.bridge, "root"], capture_output=True, check=False)
    for n in nodes:
        subprocess.run(["tc", "qdisc", "del", "dev", n.veth, "root"], capture_output=True, check=False)
        tb.exec(n, ["tc", "qdisc", "del", "dev", "eth0", "root"])


def make_data(root: Path, big_mib: int, total_mib: int, small: int) -> int:
    """A ``big_mib`` file and ``small`` files sharing the rest; the total in bytes."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "model.safetensors", "wb") as fh:
        for _ in range(big_mib):
            fh.write(os.urandom(1 << 20))
    each = max(1, ((total_mib - big_mib) << 20) // max(small, 1)) if small else 0
    for i in range(small):
        d = root / "data" / f"shard{i // 100:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"part{i:05d}.bin").write_bytes(os.urandom(each))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _timed(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run; seconds, exit code (None: stopped after ``timeout``), the process's own peak
    RSS in MiB (os.wait4's ru_maxrss), stdout and stderr."""
    import threading

    load = _load()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err,
                                start_new_session=True)
        stopped: list[bool] = []

        def stop() -> None:
            stopped.append(True)
            os.killpg(proc.pid, 9)

        timer = threading.Timer(timeout, stop)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        secs = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        return {"s": secs, "code": None if stopped else proc.returncode,
                "rss": usage.ru_maxrss / 1024, "out": out.read().decode(),
                "err": err.read().decode(), "load": load}


DEST = "/dev/shm/bench-sync"  # each node's private tmpfs: one host disk cannot take N copies


def clear(tb: Testbed, nodes: list[Any]) -> None:
    for n in nodes:
        tb.exec(n, ["rm", "-rf", DEST])


def run_new(ctx: dict[str, Any]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "clusterkit", "sync", "data", "-i", str(ctx["inv"]), "--json"]
    res = _timed(argv, ctx["proj"], ctx["env"], ctx["timeout"])
    last: dict[str, Any] = next((json.loads(x) for x in reversed(res["out"].splitlines())
                 if x.startswith('{"event": "done"')), {})
    res["sent"] = last.get("sent_from_here")
    res["ok"] = last.get("ok")
    return res


def run_rsync(ctx: dict[str, Any], src: Path, nodes: list[Any], dest: str) -> dict[str, Any]:
    tb: Testbed = ctx["tb"]
    cmds = [["rsync", "-a", "-e", f"'ssh -F {tb.ssh_config}'", f"--rsync-path='mkdir -p {dest} "
             "&& rsync'", f"{src}/", f"{n.name}:{dest}/"] for n in nodes]
    script = "set -e\n" + "\n".join(" ".join(c) + " &" for c in cmds) + \
        "\nfor j in $(jobs -p); do wait $j; done\n"
    return _timed(["bash", "-c", script], ctx["proj"], ctx["env"], ctx["timeout"] * 4)


def run_old(ctx: dict[str, Any], commit: str, timeout: float) -> dict[str, Any]:
    old = Path(ctx["work"]) / "old"
    if not old.exists():
        old.mkdir()
        tar = subprocess.run(["git", "-C", str(REPO), "archive", commit, "clusterkit"],
                             check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=tar, check=True)
    env = dict(ctx["env"], PYTHONPATH=str(old))
    argv = [sys.executable, "-m", "clusterkit", "sync", "old", "-i", str(ctx["inv"])]
    return _timed(argv, ctx["proj"], env, timeout)


def line(name: str, res: dict[str, Any], nbytes: int, mbit: int) -> str:
    ideal = nbytes * 8 / (mbit * 1e6)
    state = "" if res["code"] == 0 else (" STOPPED (did not finish)" if res["code"] is None
                                         else f" exit {res['code']}")
    sent = f", sent {res['sent'] / 1e6:.1f} MB" if res.get("sent") is not None else ""
    if res["code"] not in (0, None):
        state += ": " + " ".join(res["err"].strip().splitlines()[-2:])[-300:]
    return (f"{name:<28} {res['s']:7.1f} s  {res['s'] / ideal:5.2f} x S/R ({ideal:.1f} s for "
            f"{nbytes / 2**20:.0f} MiB)  peak RSS {res['rss']:.0f} MiB{sent}  load "
            f"{res['load']:.1f}{state}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--nodes", type=int, default=7)
    p.add_argument("--rate", type=int, default=400, help="Mbit/s on every link")
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--big-mib", type=int, default=768)
    p.add_argument("--small", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rsync-mib", type=int, default=0,
                   help="rsync only this much of the data (0: all of it)")
    p.add_argument("--no-rsync", action="store_true")
    p.add_argument("--old-mib", type=int, default=32, help="0: skip the old sync")
    p.add_argument("--old-timeout", type=float, default=300.0)
    p.add_argument("--old-commit", default=OLD_COMMIT)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--prefix", help="use this existing test bed (else a new one, torn down)")
    ns = p.parse_args(argv)
    tb = Testbed.load(ns.prefix) if ns.prefix else Testbed.create()
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    nodes: list[Any] = []
    try:
        nodes = tb.ensure(ns.nodes)[:ns.nodes]
        inv = tb.write_inventory(work / "inv.yaml", nodes=[n.name for n in nodes],
                                 workdir=DEST)
        proj = work / "proj"
        size = make_data(proj / "data", ns.big_mib, ns.total_mib, ns.small)
        env = dict(os.environ, CLUSTERKIT_HOME=str(work / "home"))
        ctx = {"tb": tb, "inv": inv, "proj": proj, "env": env, "timeout": ns.timeout,
               "work": work}
        rs_src, rs_size = proj / "data", size
        if ns.rsync_mib:
            rs_src = proj / "rsync-part"
            rs_size = make_data(rs_src, min(ns.big_mib, ns.rsync_mib * 3 // 4), ns.rsync_mib,
                                ns.small * ns.rsync_mib // ns.total_mib)
        old_size = make_data(proj / "old", ns.old_mib * 3 // 4, ns.old_mib,
                             ns.small * ns.old_mib // ns.total_mib) if ns.old_mib else 0
        print(f"{ns.nodes} nodes, every link {ns.rate} Mbit/s, {size / 2**20:.0f} MiB "
              f"({ns.big_mib} MiB file + {ns.small} files); S/R = "
              f"{size * 8 / (ns.rate * 1e6):.1f} s; {os.cpu_count()} CPUs", flush=True)
        # The source's hashes, once (the cache a second run uses); the cold cost printed.
        t0 = time.monotonic()
        from clusterkit.sync.source import Ignore, scan, source_entries

        source_entries(scan(str(proj / "data"), Ignore()).files,
                       str(work / "home" / "sync-cache"), str(proj / "data"))
        print(f"hashing the source once here: {time.monotonic() - t0:.1f} s (load {_load():.1f}); "
              "later runs read the cache", flush=True)
        shape(tb, nodes, ns.rate)
        for r in range(ns.rounds):
            order = ["new", "rsync"] if r % 2 == 0 else ["rsync", "new"]
            for what in order:
                clear(tb, nodes)
                if what == "new":
                    res = run_new(ctx)
                    print(line(f"round {r + 1}: clusterkit sync", res, size, ns.rate)
                          + ("" if res.get("ok") else f"  NOT OK: {res['err'][-300:]}"), flush=True)
                elif not ns.no_rsync:
                    res = run_rsync(ctx, rs_src, nodes, DEST + "/rs")
                    print(line(f"round {r + 1}: parallel rsync", res, rs_size, ns.rate), flush=True)
        clear(tb, nodes)
        res = run_new(ctx)
        print(line("fill again for the delta runs", res, size, ns.rate), flush=True)
        res = run_new(ctx)
        print(f"second run, nothing changed: {res['s']:.1f} s, {res['sent']} bytes sent from here, "
              f"load {res['load']:.1f}", flush=True)
        changed = next((proj / "data" / "data").rglob("*.bin"))
        changed.write_bytes(os.urandom(changed.stat().st_size))
        res = run_new(ctx)
        print(f"one file changed ({changed.stat().st_size:,} bytes): {res['s']:.1f} s, "
              f"{res['sent']} bytes sent from here, load {res['load']:.1f}", flush=True)
        if ns.old_mib:
            clear(tb, nodes)
            res = run_old(ctx, ns.old_commit, ns.old_timeout)
            print(line(f"old sync ({ns.old_mib} MiB)", res, old_size, ns.rate), flush=True)
    finally:
        if nodes:
            unshape(tb, nodes)
            clear(tb, nodes)
        shutil.rmtree(work, ignore_errors=True)
        if not ns.prefix:
            tb.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
