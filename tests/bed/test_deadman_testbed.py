"""Issue 14, Deliver 2 on the namespace test bed: a node cut off keeps nothing running.

A sleeping "rank" script (no DeepSpeed start-up cost) runs on every node; one
node's link goes down (``ip link set eth0 down`` inside its namespace) and stays
down. Its agent hears no PING for ``--keepalive-timeout`` seconds and tears its
own ranks down: measured *inside that node's namespace* (nsenter, no network),
while the link is still down. The other nodes go as after any lost node, and the
launcher's report names the node it could not confirm. The link comes back up
(with its routes) in ``finally``.

Lean: 3 nodes x 1 rank. The 7x2 acceptance (node6 cut) is the same test with
CLUSTERKIT_EXTENDED=1 (marked slow).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers import SLEEPER, job_pids, read_until, start_launch
from tests.testbed.core import Testbed

pytestmark = pytest.mark.testbed
KEEPALIVE_S = 8.0
SLACK_S = 5.0  # the acceptance bound: gone within the switch timeout + 5 s


def _routes(tb: Testbed, node: str) -> list[str]:
    res = tb.exec(node, ["ip", "-4", "route", "show"], timeout=20, check=True)
    return [line.strip() for line in res.stdout.splitlines() if line.strip()]


def _link(tb: Testbed, node: str, state: str, routes: list[str]) -> None:
    tb.exec(node, ["ip", "link", "set", "eth0", state], timeout=20, check=True)
    if state == "up":  # a link that went down lost its routes: put every one back
        for route in routes:
            tb.exec(node, ["ip", "route", "replace", *route.split()], timeout=20)


def _partition_case(testbed: Testbed, tmp_path: Path, *, nodes: int, ranks: int,
                    cut: str) -> None:
    names = [n.name for n in testbed.ensure(nodes)]
    work = tmp_path / "work"
    work.mkdir()
    (work / "sleeper.py").write_text(SLEEPER)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes=names, slots=ranks)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    job = f"deadman-{nodes}x{ranks}"
    proc = start_launch(inv, job, ["--skip-checks", "--nodes", str(nodes), "--hang-timeout", "0",
                              "--keepalive-timeout", f"{KEEPALIVE_S:g}", str(work / "sleeper.py")],
                   env, tmp_path)
    seen: list[str] = []
    routes = _routes(testbed, cut)
    try:
        read_until(proc, nodes * ranks, "ready rank", 180, seen)
        assert job_pids(testbed, cut, job), "no rank on the node to cut"
        _link(testbed, cut, "down", routes)
        t0 = time.monotonic()
        gone_after = None
        while time.monotonic() - t0 < KEEPALIVE_S + 30:
            if not job_pids(testbed, cut, job):  # inside the node, link still down
                gone_after = time.monotonic() - t0
                break
            time.sleep(0.5)
        link = testbed.exec(cut, ["ip", "-o", "link", "show", "eth0"], timeout=20).stdout
        assert "state DOWN" in link or "NO-CARRIER" in link or ",UP" not in link, link
        load = Path("/proc/loadavg").read_text().split()[0]
        print(f"{cut}: its ranks gone {gone_after} s after the cut (keepalive {KEEPALIVE_S:g} s, "
              f"load {load})")
        assert gone_after is not None and gone_after <= KEEPALIVE_S + SLACK_S, (gone_after, load)
        out, _ = proc.communicate(timeout=180)
        seen.append(out)
    finally:
        _link(testbed, cut, "up", routes)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = "".join(seen)
    print(text[-2500:])  # with -s: the launcher's report (which nodes it could not confirm)
    assert proc.returncode not in (0, None), text
    assert cut in text, text
    assert f"{cut}: could not verify the teardown" in text, text
    assert f"{cut} could not be confirmed" in text, text
    for name in names:  # the other nodes as after any lost node; the cut one cleaned itself
        assert not job_pids(testbed, name, job), (name, text[-3000:])


@pytest.mark.slow  # ~30 s: the keepalive, then the launcher's connect timeouts on the cut node
def test_cut_node_tears_down_its_own_ranks(testbed: Testbed, tmp_path: Path) -> None:
    _partition_case(testbed, tmp_path, nodes=3, ranks=1, cut="node3")


@pytest.mark.slow
@pytest.mark.extended  # the 7x2 acceptance run
def test_acceptance_7x2_node6_cut(testbed: Testbed, tmp_path: Path) -> None:
    _partition_case(testbed, tmp_path, nodes=7, ranks=2, cut="node6")


