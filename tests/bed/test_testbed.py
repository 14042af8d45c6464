"""The namespace test bed itself: nodes, names, disks, SSH, pdsh, teardown."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.paths import REPO
from tests.testbed import Testbed, TestNode
from tests.testbed.sysutil import alive, link_names, mountpoints

pytestmark = pytest.mark.testbed


def host_ssh(tb: Testbed, node: str, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(tb.ssh_config), node, *cmd],
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.testbed(nodes=7)
def test_seven_nodes_come_up_with_their_hostnames(testbed: Testbed,
                                                  testbed_nodes: list[TestNode]) -> None:
    assert [n.name for n in testbed_nodes] == [f"node{i}" for i in range(1, 8)]
    assert len({n.address for n in testbed_nodes}) == 7
    for node in testbed_nodes:
        assert node.address.startswith(testbed.subnet.rsplit(".", 1)[0] + ".")
        assert testbed.exec(node, ["hostname"], check=True).stdout.strip() == node.name


@pytest.mark.testbed(nodes=7)
def test_names_resolve_to_bridge_addresses_inside_every_node(
        testbed: Testbed, testbed_nodes: list[TestNode]) -> None:
    expected = {n.name: n.address for n in testbed_nodes}
    for node in testbed_nodes:
        out = testbed.exec(node, ["getent", "ahostsv4", *expected], check=True).stdout
        seen = {}
        for line in out.splitlines():
            addr, _kind, *names = line.split()
            for name in names:
                seen[name] = addr
        assert {k: seen.get(k) for k in expected} == expected, node.name
        hosts = testbed.exec(node, ["cat", "/etc/hosts"], check=True).stdout
        assert "127.0.1.1" not in hosts
        assert "127.0.0.1 localhost" in hosts


@pytest.mark.testbed(nodes=7)
def test_node_local_dir_is_private_and_shared_dir_is_common(
        testbed: Testbed, testbed_nodes: list[TestNode]) -> None:
    local, shared = testbed.local_mountpoint, testbed.shared_dir
    for node in testbed_nodes:
        script = f"echo {node.name} > {local}/who && echo {node.name} > {shared}/from-{node.name}"
        testbed.exec(node, ["sh", "-c", script], check=True)
    for node in testbed_nodes:
        assert testbed.exec(node, ["cat", f"{local}/who"]).stdout.strip() == node.name
        listing = testbed.exec(node, ["ls", str(shared)], check=True).stdout.split()
        assert {f"from-{n.name}" for n in testbed_nodes} <= set(listing)
        assert testbed.node_local_path(node, f"{local}/who").read_text().strip() == node.name
        assert testbed.node_local_path(node, "who") == testbed.node_local_path(node, local / "who")
    assert not (local / "who").exists()  # the host's own copy of the mount point is untouched


@pytest.mark.testbed(nodes=2)
def test_private_run_devshm_and_pid_namespace(testbed: Testbed,
                                              testbed_nodes: list[TestNode]) -> None:
    a, b = testbed_nodes
    testbed.exec(a, ["sh", "-c", "echo x > /dev/shm/cktb-probe"], check=True)
    assert testbed.exec(b, ["test", "-e", "/dev/shm/cktb-probe"]).returncode == 1
    assert not Path("/dev/shm/cktb-probe").exists()
    assert testbed.exec(a, ["test", "-d", "/run/sshd"]).returncode == 0
    init = testbed.exec(a, ["cat", "/proc/1/cmdline"], check=True).stdout
    assert "node_init.sh" in init and a.name in init


@pytest.mark.testbed(nodes=7)
def test_ssh_from_host_to_every_node(testbed: Testbed, testbed_nodes: list[TestNode]) -> None:
    with ThreadPoolExecutor(7) as pool:
        results = list(pool.map(lambda n: host_ssh(testbed, n.name, "hostname"), testbed_nodes))
    for node, res in zip(testbed_nodes, results, strict=True):
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == node.name
    # The same works by address (known_hosts has both), and the SSHTarget agrees.
    target = testbed.ssh_target(testbed_nodes[2])
    assert target.address == testbed_nodes[2].address and target.user == "root"
    assert host_ssh(testbed, target.address, "hostname").stdout.strip() == "node3"


@pytest.mark.testbed(nodes=7)
def test_ssh_between_nodes_by_name_with_strict_host_keys(
        testbed: Testbed, testbed_nodes: list[TestNode]) -> None:
    res = testbed.exec("node1", ["ssh", "-o", "StrictHostKeyChecking=yes", "node7", "hostname"],
                       timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "node7"
    # An unknown name is refused, not silently accepted.
    res = testbed.exec("node1", ["ssh", "127.0.0.1", "true"], timeout=30)
    assert res.returncode == 255
    assert "Host key verification failed" in res.stderr


@pytest.mark.testbed(nodes=7)
def test_pdsh_over_all_nodes_from_host_and_from_a_node(
        testbed: Testbed, testbed_nodes: list[TestNode]) -> None:
    if shutil.which("pdsh") is None:
        pytest.skip("pdsh missing (apt-get install pdsh)")
    env = {**os.environ, "PDSH_SSH_ARGS_APPEND": f"-F {testbed.ssh_config}"}
    res = subprocess.run(["pdsh", "-R", "ssh", "-w", "node[1-7]", "hostname"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == sorted(f"node{i}: node{i}" for i in range(1, 8))
    res2 = testbed.exec("node4", ["pdsh", "-R", "ssh", "-w", "node[1-7]", "true"], timeout=60)
    assert res2.returncode == 0, res2.stderr


@pytest.mark.testbed(nodes=2)
def test_stop_and_start_sshd(testbed: Testbed, testbed_nodes: list[TestNode]) -> None:
    node = testbed_nodes[1]
    testbed.stop_sshd(node)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((node.address, 22), timeout=5).close()
        assert testbed.exec(node, ["hostname"]).stdout.strip() == node.name  # node still up
    finally:
        testbed.start_sshd(node)
    assert host_ssh(testbed, node.name, "hostname").stdout.strip() == node.name


@pytest.mark.testbed(nodes=2)
def test_rotated_host_key_is_refused(testbed: Testbed, testbed_nodes: list[TestNode]) -> None:
    node = testbed_nodes[1]
    testbed.rotate_host_key(node)
    try:
        res = host_ssh(testbed, node.name, "true")
        assert res.returncode == 255
        assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in res.stderr
    finally:
        testbed.rotate_host_key(node, update_known_hosts=True)
    assert host_ssh(testbed, node.name, "hostname").stdout.strip() == node.name


@pytest.mark.testbed(nodes=2)
def test_spawn_runs_inside_the_node_and_orphans_are_reaped(
        testbed: Testbed, testbed_nodes: list[TestNode]) -> None:
    node = testbed_nodes[0]
    proc = testbed.spawn(node, ["sh", "-c", "hostname; exec sleep 300"], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == node.name
        ps = testbed.exec(node, ["ps", "-eo", "args"], check=True).stdout
        assert "sleep 300" in ps
    finally:
        proc.terminate()
    assert proc.wait(timeout=10) != 0
    assert "sleep 300" not in testbed.exec(node, ["ps", "-eo", "args"]).stdout
    # A daemonised child of an ssh session is adopted and reaped by the node's init.
    assert host_ssh(testbed, node.name, "sh -c 'sleep 0.2 &'").returncode == 0
    deadline = time.monotonic() + 15  # generous: the machine may be heavily loaded
    while True:
        ps = testbed.exec(node, ["ps", "-eo", "stat=,args="], check=True).stdout
        if not any(line.split()[0].startswith("Z") or "sleep 0.2" in line
                   for line in ps.splitlines()):
            break
        assert time.monotonic() < deadline, ps
        time.sleep(0.1)


@pytest.mark.testbed(nodes=2)
def test_inventory_points_at_the_test_bed(testbed: Testbed, testbed_nodes: list[TestNode],
                                          tmp_path: Path) -> None:
    path = testbed.write_inventory(tmp_path / "inv.yaml", nodes=testbed_nodes, slots=3,
                                   env={"FOO": "1"})
    data = yaml.safe_load(path.read_text())
    assert data["schema_version"] == 1
    assert data["hosts"] == {n.name: {"address": n.address} for n in testbed_nodes}
    d = data["defaults"]
    assert d["slots"] == 3 and d["gpus"] == 0 and d["python"] == sys.executable
    assert d["ssh"]["config_file"] == str(testbed.ssh_config)
    assert d["ssh"]["known_hosts_file"] == str(testbed.known_hosts)
    assert d["ssh"]["identity_file"] == str(testbed.identity_file)
    assert d["checkpoint"] == {"shared_dir": f"{testbed.shared_dir}/ckpt",
                               "local_dir": f"{testbed.local_mountpoint}/ckpt"}
    assert d["env"] == {"FOO": "1"}
    assert testbed.inventory_path.is_file()


@pytest.mark.testbed(nodes=7)
def test_grow_adds_a_node_everyone_can_reach(testbed: Testbed,
                                             testbed_nodes: list[TestNode]) -> None:
    nodes = testbed.ensure(len(testbed.nodes) + 1)
    new = nodes[-1]
    res = testbed.exec("node1", ["ssh", new.name, "hostname"], timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == new.name
    assert host_ssh(testbed, new.name, "getent", "hosts", "node1").stdout.split()[0] == \
        testbed_nodes[0].address


def _leftovers(tb: Testbed, pids: list[int]) -> list[str]:
    netns = Path("/run/netns")
    found = [f"netns {p.name}" for p in (netns.glob(f"cktb-{tb.prefix}-*") if netns.is_dir()
                                         else [])]
    found += [f"link {n}" for n in link_names() if n.startswith(f"{tb.prefix}-")]
    found += [f"pid {p}" for p in pids if alive(p)]
    found += [f"mount {m}" for m in mountpoints()
              if str(tb.root) in m or f"cktb-{tb.prefix}-" in m]
    if tb.root.exists():
        found.append(f"dir {tb.root}")
    return found


def test_down_leaves_nothing_behind(testbed_required: None) -> None:
    tb = Testbed.create()
    try:
        nodes = tb.ensure(2)
        proc = tb.spawn(nodes[0], ["sleep", "300"])
        pids = [n.pid for n in nodes] + [proc.pid]
        sshd = [int(p) for p in Path(f"/proc/{nodes[1].pid}/task/{nodes[1].pid}/children")
                .read_text().split()]
        pids += sshd
        before = " ".join(_leftovers(tb, pids))  # the probe does see a live test bed
        for kind in ("netns", "link", "pid", "mount", "dir"):
            assert kind in before
    finally:
        tb.down()
    assert _leftovers(tb, pids) == []
    tb.down()  # idempotent


def test_down_all_stops_host_daemons_a_killed_session_left(testbed_required: None) -> None:
    """A pytest killed before its teardown leaves the Slurm bed's munged/slurmctld running
    on the host with their files under the test bed's root; tearing the bed down by its
    prefix (what `down --all` does for each one) stops them."""
    from tests.testbed.core import down_prefix

    tb = Testbed.create()
    tb.ensure(1)
    daemon = subprocess.Popen(  # stands in for `slurmctld -f <root>/slurm/slurm.conf`
        [sys.executable, "-c", "import time; time.sleep(300)", f"{tb.root}/slurm/slurm.conf"],
        start_new_session=True)
    try:
        assert down_prefix(tb.prefix)
        assert daemon.wait(timeout=15) == -9
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def test_cli_up_exec_down(testbed_required: None) -> None:
    prefix = f"cli{os.getpid() % 100000}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tests.testbed", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120, check=False)

    try:
        up = cli("up", "1", "--prefix", prefix)
        assert up.returncode == 0, up.stderr
        assert "ssh config" in up.stdout and "inventory" in up.stdout
        ex = cli("exec", "--prefix", prefix, "node1", "--", "hostname")
        assert (ex.returncode, ex.stdout.strip()) == (0, "node1")
        assert "node1" in cli("status", "--prefix", prefix).stdout
    finally:
        down = cli("down", "--prefix", prefix)
    assert down.returncode == 0, down.stderr
    assert not Path(f"/tmp/cktb-{prefix}").exists()
    assert not [n for n in link_names() if n.startswith(f"{prefix}-")]
