"""Issue 37 item 4 on the namespace test bed: two nodes (own host names, own PID
namespaces) sharing one TORCH_EXTENSIONS_DIR, as an NFS home shares ~/.cache. A build on
node A holds an op's lock with our build step's owner record (node/provision/buildowner.Owner, as
``provision.jitops build`` keeps it); node B, where no /proc shows A's builder, sees it live:
the launch gate's check and doctor's lock rule say "building on A", never stale, and
removing stale locks leaves it. With the builder killed, A proves the lock dead at once
(its pid is gone), B once the record stops being refreshed (here: the record's time set
back past the TTL rather than waiting a minute); then it is reported stale with the fix
and removed by the next start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Status
from clusterkit.checks.rules_base import DoctorContext
from clusterkit.checks.rules_env import check_jit_locks
from clusterkit.node.provision import buildowner
from tests.paths import REPO
from tests.testbed import Testbed

pytestmark = pytest.mark.testbed

HOLDER = ("import os, sys, time\n"
          "from clusterkit.node.provision.buildowner import Owner\n"
          "lock = sys.argv[1]\n"
          "with Owner(lock, poll_s=0.1):\n"
          "    fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # as FileBaton does\n"
          "    print('holding', flush=True)\n"
          "    time.sleep(300)\n")
ASK = ("import json, sys\n"
       "from clusterkit.node.provision import jitops\n"
       "found = jitops.locks([sys.argv[1]])\n"
       "gone = [lk['path'] for lk in found if sys.argv[2:] == ['remove'] and lk['state'] == 'dead'"
       " and jitops.remove(lk)]\n"
       "print(json.dumps({'locks': found, 'removed': gone}))\n")


def _ask(testbed: Testbed, node: str, ext: Path, *more: str) -> dict[str, Any]:
    res = testbed.exec(node, [sys.executable, "-c", ASK, str(ext), *more], timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def _jit_lock_finding(node: str, locks: list[dict[str, Any]]) -> Any:
    (finding,) = check_jit_locks({node: NodeFacts(host=node, jit_locks=tuple(locks))},
                                 DoctorContext(hosts=(node,)))
    return finding


def test_a_build_on_another_node_sharing_the_directory_is_live_until_proven_dead(
        testbed: Testbed, tmp_path: Path) -> None:
    a, b = (n.name for n in testbed.ensure(2)[:2])
    ext = tmp_path / "ext"  # on the host's file system: both nodes see it
    lock = ext / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    builder = testbed.spawn(a, [sys.executable, "-c", HOLDER, str(lock)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert builder.stdout is not None and builder.stdout.readline().strip() == "holding"
        deadline = time.monotonic() + 20
        while not Path(f"{lock}.owner").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        record = buildowner.parse_owner(Path(f"{lock}.owner").read_text())
        assert record is not None and record["host"] == a

        (on_a,) = _ask(testbed, a, ext)["locks"]
        assert on_a["state"] == "held", on_a  # A's /proc shows its builder
        seen = _ask(testbed, b, ext, "remove")
        (on_b,) = seen["locks"]
        assert on_b["holders"] == [] and on_b["state"] == "building", on_b
        assert on_b["why"].startswith(f"building on {a} (pid {record['pid']}; record ")
        assert seen["removed"] == [] and lock.exists()  # never removed while live
        finding = _jit_lock_finding(b, [on_b])
        assert finding.status is Status.PASS and f"building on {a}" in finding.detail
        assert "stale" not in finding.detail
    finally:
        builder.kill()  # SIGKILL: the lock and the record stay, as a killed build leaves them
        builder.wait()
    assert lock.exists() and Path(f"{lock}.owner").exists()

    (on_a,) = _ask(testbed, a, ext)["locks"]
    assert on_a["state"] == "dead" and on_a["why"] == (
        f"its builder, pid {record['pid']} on {a}, is gone"), on_a
    (on_b,) = _ask(testbed, b, ext)["locks"]
    assert on_b["state"] == "building"  # B cannot ask A's /proc: the record is still young
    old = time.time() - buildowner.OWNER_TTL_S - 30
    os.utime(f"{lock}.owner", (old, old))  # a minute and a half without a refresh
    (on_b,) = _ask(testbed, b, ext)["locks"]
    assert on_b["state"] == "dead" and f"its builder on {a}" in on_b["why"], on_b
    finding = _jit_lock_finding(b, [on_b])
    assert finding.status is Status.FAIL and "stale" in finding.detail
    assert "removes it by itself" in finding.fix
    assert _ask(testbed, b, ext, "remove")["removed"] == [str(lock)]
    assert not lock.exists() and not Path(f"{lock}.owner").exists()
