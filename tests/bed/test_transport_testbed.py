"""SSHTransport against the namespace test bed: real nodes, real sshd, real addresses."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterkit.remote.base import GroupResult
from clusterkit.remote.ssh import SSHTransport
from tests.testbed import Testbed, TestNode

pytestmark = pytest.mark.testbed
CONNECT_TIMEOUT = 5.0


@pytest.fixture
def testbed_ssh() -> Iterator[SSHTransport]:
    t = SSHTransport(connect_timeout=CONNECT_TIMEOUT)
    yield t
    t.close()


@pytest.mark.testbed(nodes=7)
def test_run_all_on_seven_nodes(
    testbed: Testbed, testbed_nodes: list[TestNode], testbed_ssh: SSHTransport
) -> None:
    targets = [testbed.ssh_target(n) for n in testbed_nodes]
    group = testbed_ssh.run_all(targets, ["hostname"], timeout=30)
    assert [r.host for r in group] == [n.name for n in testbed_nodes]
    assert [r.result.stdout.strip() for r in group if r.result] == [n.name for n in testbed_nodes]
    assert len(group.succeeded) == 7


@pytest.mark.testbed(nodes=7)
def test_stopped_sshd_fails_fast_and_others_succeed(
    testbed: Testbed, testbed_nodes: list[TestNode], testbed_ssh: SSHTransport
) -> None:
    victim = testbed_nodes[3]
    testbed.stop_sshd(victim)
    try:
        targets = [testbed.ssh_target(n) for n in testbed_nodes]
        group = testbed_ssh.run_all(targets, ["true"], timeout=30)
        start = time.monotonic()
        alone = testbed_ssh.run_all([testbed.ssh_target(victim)], ["true"], timeout=30)
        elapsed = time.monotonic() - start
    finally:
        testbed.start_sshd(victim)
    for result in (group, alone):
        error = result[victim.name].error
        assert error is not None and error.kind == "refused", error
        assert error.host == victim.name
    assert elapsed < CONNECT_TIMEOUT  # the error came back inside the connect timeout
    assert [r.host for r in group.succeeded] == [n.name for n in testbed_nodes if n != victim]


@pytest.mark.testbed(nodes=7)
def test_rotated_host_key_is_refused_as_changed(
    testbed: Testbed, testbed_nodes: list[TestNode], testbed_ssh: SSHTransport
) -> None:
    node = testbed_nodes[5]
    target = testbed.ssh_target(node)
    assert testbed_ssh.run(target, ["true"]).ok
    testbed_ssh.close()
    before = Path(target.known_hosts_file or "").read_text()
    testbed.rotate_host_key(node)
    try:
        for accept_new in (False, True):
            with SSHTransport(connect_timeout=CONNECT_TIMEOUT) as t:
                probe = dataclasses.replace(target, accept_new_host_keys=accept_new)
                group = t.run_all([probe], ["true"])
            error = group[node.name].error
            assert error is not None and error.kind == "hostkey-changed"
            assert node.name in error.message or node.address in error.message
        assert Path(target.known_hosts_file or "").read_text() == before
    finally:
        testbed.rotate_host_key(node, update_known_hosts=True)  # leave the bed usable


@pytest.mark.testbed(nodes=7)
def test_put_get_node_local_dir(
    testbed: Testbed, testbed_nodes: list[TestNode], testbed_ssh: SSHTransport, tmp_path: Path
) -> None:
    node = testbed_nodes[6]
    target = testbed.ssh_target(node)
    inside = testbed.local_mountpoint / "transport-test" / "shard.bin"
    payload = os.urandom(1 << 20)
    src = tmp_path / "src.bin"
    src.write_bytes(payload)
    testbed_ssh.makedirs(target, str(inside.parent))
    testbed_ssh.put(target, str(src), str(inside))
    on_host = testbed.node_local_path(node, inside)
    assert on_host.read_bytes() == payload  # landed in THIS node's private dir
    other = testbed.node_local_path(testbed_nodes[0], inside)
    assert not other.exists()
    assert testbed_ssh.listdir(target, str(inside.parent)) == ["shard.bin"]
    back = tmp_path / "back.bin"
    testbed_ssh.get(target, str(inside), str(back))
    assert back.read_bytes() == payload
    assert testbed_ssh.sha256(target, str(inside)) == hashlib.sha256(payload).hexdigest()
    testbed_ssh.run(target, ["rm", "-rf", str(inside.parent)])


@pytest.mark.testbed(nodes=7)
def test_doctor_with_nodes_described_only_in_system_ssh_config_d(
        testbed: Testbed, testbed_nodes: list[TestNode], tmp_path: Path) -> None:
    """The issue-12 cluster: the inventory lists only names; /etc/ssh/ssh_config's
    ``Include /etc/ssh/ssh_config.d/*.conf`` says HostName, User, IdentityFile and
    UserKnownHostsFile. Run in a private mount namespace with those files bind-mounted
    over /etc/ssh (nothing outside this test sees them)."""
    import json
    import shlex
    import subprocess
    import sys

    import yaml

    from clusterkit.hostrange import fold

    etc = tmp_path / "etc-ssh"
    (etc / "ssh_config.d").mkdir(parents=True)
    (etc / "ssh_config").write_text("Include /etc/ssh/ssh_config.d/*.conf\nHost *\n"
                                    "    SendEnv LANG LC_*\n    HashKnownHosts yes\n")
    (etc / "ssh_config.d" / "cluster.conf").write_text(testbed.ssh_config.read_text())
    inv = testbed.inventory_dict(testbed_nodes)
    del inv["defaults"]["ssh"]  # nothing about SSH in the inventory
    inv["hosts"] = {fold(n.name for n in testbed_nodes): {}}  # names only, no address
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(inv, sort_keys=False))
    doctor = [sys.executable, "-m", "clusterkit", "doctor", "-i", str(tmp_path / "inv.yaml"),
              "--json", "--connect-timeout", "5"]
    script = (f"mount --make-rprivate / && mount --bind {shlex.quote(str(etc))} /etc/ssh && "
              f"{shlex.join(doctor)}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         timeout=240, check=False)
    report = json.loads(res.stdout)
    assert not report["unreachable"], res.stderr[-2000:]
    ssh_ok = {f["host"] for f in report["findings"] if f["check"] == "ssh" and f["status"] == "PASS"}
    assert ssh_ok == {n.name for n in testbed_nodes}


@pytest.mark.testbed(nodes=7)
def test_openssh_fan_out_matches_paramiko(
    testbed: Testbed, testbed_nodes: list[TestNode], tmp_path: Path
) -> None:
    """doctor's OpenSSH fan-out and paramiko: same output, same error kinds and messages
    (stopped sshd, rotated host key, unknown host key), same known_hosts left behind."""
    from clusterkit.remote.local import LocalTransport
    from clusterkit.remote.openssh import OpenSSHTransport

    openssh = OpenSSHTransport(LocalTransport(), connect_timeout=CONNECT_TIMEOUT)
    targets = [testbed.ssh_target(n) for n in testbed_nodes]
    group = openssh.run_all(targets, ["hostname"], timeout=30)
    assert [r.result.stdout.strip() for r in group if r.result] == [n.name for n in testbed_nodes]
    stopped, rotated, unknown = testbed_nodes[1], testbed_nodes[2], testbed_nodes[3]
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    cases = {stopped.name: testbed.ssh_target(stopped),
             rotated.name: testbed.ssh_target(rotated),
             unknown.name: dataclasses.replace(testbed.ssh_target(unknown),
                                               known_hosts_file=str(empty))}
    before = Path(targets[0].known_hosts_file or "").read_text()
    testbed.stop_sshd(stopped)
    testbed.rotate_host_key(rotated)
    try:
        with SSHTransport(connect_timeout=CONNECT_TIMEOUT) as paramiko_t:
            ours = openssh.run_all(list(cases.values()), ["true"], timeout=30)
            theirs = paramiko_t.run_all(list(cases.values()), ["true"], timeout=30)
        after = Path(targets[0].known_hosts_file or "").read_text()
    finally:
        testbed.start_sshd(stopped)
        testbed.rotate_host_key(rotated, update_known_hosts=True)
    def kinds_of(group: GroupResult) -> dict[str, str | None]:
        return {h: (e.kind if (e := group[h].error) is not None else None) for h in cases}

    kinds = kinds_of(ours)
    assert kinds == {stopped.name: "refused", rotated.name: "hostkey-changed",
                     unknown.name: "hostkey-unknown"}
    assert kinds == kinds_of(theirs)
    refused_ours, refused_theirs = ours[stopped.name].error, theirs[stopped.name].error
    assert refused_ours is not None and refused_theirs is not None
    assert refused_ours.message == refused_theirs.message  # the same row when folded
    assert after == before  # a changed key is never written
    assert empty.read_text() == ""  # strict checking: nothing was added
