"""Rules on synthetic fact sets: one bad node among 7 -> exactly that node named, right fix."""

from __future__ import annotations

from dataclasses import replace

import pytest

from clusterkit.checks.facts import StorageFacts, unreachable
from clusterkit.checks.findings import Finding, Status, group_findings, worst
from clusterkit.checks.gpu_topology import parse_topo_matrix
from clusterkit.checks.infiniband import IBPort
from clusterkit.checks.netpick import ifname_selected
from clusterkit.checks.rules import run_rules
from clusterkit.checks.rules_base import GiB
from clusterkit.checks.rules_gpu import check_gpus, check_topology
from clusterkit.checks.rules_host import check_clock, check_limits, check_storage
from clusterkit.checks.rules_names import check_own_name, check_peer_names
from clusterkit.checks.rules_nccl import check_interfaces, check_nccl_env
from clusterkit.checks.rules_parity import check_freeze, check_interpreter, check_versions
from clusterkit.checks.rules_ssh import check_master_port, check_probe
from clusterkit.checks.rules_toolchain import check_cuda, check_ninja, check_pdsh
from tests.helpers import ADDR, CTX, H100, HOSTS, PY, cluster, node, only_node7
from tests.paths import TESTS


def test_healthy_cluster_has_no_warnings() -> None:
    findings = run_rules({h: node(h) for h in HOSTS}, CTX)
    assert worst(findings) is Status.PASS, [f for f in findings if f.status]


def test_torch_version_odd_node_named_with_majority_and_grouped_line() -> None:
    facts = cluster(versions={**node("node7").versions, "torch": "2.3.1"})
    findings = check_versions(facts, CTX)
    f = only_node7(findings, "version.torch")
    assert f.status is Status.FAIL
    assert f.detail == "torch 2.3.1 ≠ 2.4.0 on node[1-6]"
    assert f.fix == f"{PY} -m pip install 'torch==2.4.0'"
    lines = [g.one_line() for g in group_findings(findings, HOSTS) if g.check == "version.torch"]
    assert "FAIL version.torch  node7: torch 2.3.1 ≠ 2.4.0 on node[1-6]" in lines[1]
    assert lines[0].startswith("PASS version.torch  node[1-6]: torch 2.4.0")


@pytest.mark.parametrize("field,value,check", [
    ("python_version", "3.10.14", "version.python"),
    ("torch_cuda", "11.8", "version.torch-cuda"),
    ("nccl_version", "2.18.1", "version.nccl"),
])
def test_other_version_parity(field: str, value: str, check: str) -> None:
    f = only_node7(check_versions(cluster(**{field: value}), CTX), check)
    assert f.status is Status.FAIL and value in f.detail and "on node[1-6]" in f.detail


def test_missing_package_is_named() -> None:
    versions = {**node("node7").versions, "deepspeed": None}
    f = only_node7(check_versions(cluster(versions=versions), CTX), "version.deepspeed")
    assert f.detail == "deepspeed not installed ≠ 0.14.4 on node[1-6]"


def test_interpreter_path_fails_for_pdsh_warns_for_ssh() -> None:
    facts = cluster(python_executable="/usr/bin/python3")
    f = only_node7(check_interpreter(facts, CTX), "python.path")
    assert f.status is Status.FAIL and "/usr/bin/python3 ≠ /opt/venv/bin/python" in f.detail
    head = [x for x in check_interpreter(facts, CTX) if x.check == "python.head"]
    assert [x.host for x in head] == ["node7"]
    ssh = replace(CTX, backend="ssh")
    assert only_node7(check_interpreter(facts, ssh), "python.path").status is Status.WARN


def test_freeze_diff_lists_packages() -> None:
    facts = cluster(freeze=("deepspeed==0.14.4", "torch==2.3.1", "extra==1.0"))
    f = only_node7(check_freeze(facts, CTX), "pip.freeze")
    assert f.status is Status.WARN
    assert "torch 2.3.1≠2.4.0" in f.detail and "ninja missing" in f.detail
    assert "+extra 1.0" in f.detail and "node[1-6]" in f.detail


def test_ninja_missing_and_not_on_path() -> None:
    f = only_node7(check_ninja(cluster(tools={}), CTX), "ninja")
    assert "ninja is installed but not on the PATH" in f.detail
    assert f.fix is not None and "PATH=/opt/venv/bin:$PATH" in f.fix
    versions = {**node("node7").versions, "ninja": None}
    f = only_node7(check_ninja(cluster(tools={}, versions=versions), CTX), "ninja")
    assert f.fix is not None and f.fix.startswith(f"{PY} -m pip install ninja")


def test_cuda_libcudart_and_home() -> None:
    f = only_node7(check_cuda(cluster(libcudart=None), CTX), "cuda.libcudart")
    assert f.status is Status.FAIL
    f = only_node7(check_cuda(cluster(cuda_home=None, nvcc=None), CTX), "cuda.home")
    assert f.status is Status.WARN and "CUDA_HOME" in f.detail


def test_cpu_nodes_pass_with_no_gpu() -> None:
    cpu = {h: replace(node(h), nvidia_smi=None, gpus=None, libcudart=None, cuda_home=None,
                      nvcc=None) for h in HOSTS}
    ctx = replace(CTX, gpus={}, slots={h: 2 for h in HOSTS})
    findings = check_gpus(cpu, ctx) + check_cuda(cpu, ctx)
    assert worst(findings) is Status.PASS
    assert {f.detail for f in findings if f.check == "gpu.count"} == {"no GPU (CPU node)"}


def test_gpu_count_vs_slots_and_inventory() -> None:
    f = only_node7(check_gpus(cluster(gpus=(H100,)), CTX), "gpu.count")
    assert f.status is Status.FAIL and f.detail == "1 GPUs found, inventory says 2"
    ctx = replace(CTX, gpus={}, slots={**CTX.slots, "node7": 4})
    f = only_node7(check_gpus({h: node(h) for h in HOSTS}, ctx), "gpu.count")
    assert f.detail == "slots=4 but only 2 GPUs" and f.fix == "set slots: 2 (one rank per GPU)"
    f = only_node7(check_gpus(cluster(gpus=None, gpu_error="nvidia-smi exited 9: NVIDIA-SMI "
                                      "has failed"), CTX), "gpu.count")
    assert "nvidia-smi failed" in f.detail


def test_driver_parity() -> None:
    gpus = (replace(H100, driver_version="550.54.15"), replace(H100, index=1,
                                                               driver_version="550.54.15"))
    f = only_node7(check_gpus(cluster(gpus=gpus), CTX), "gpu.driver")
    assert f.status is Status.WARN and "550.54.15 ≠ 535.104.05 on node[1-6]" in f.detail


def test_pdsh_missing_on_head() -> None:
    (f,) = check_pdsh({}, replace(CTX, head_tools={}))
    assert f.status is Status.FAIL and "apt-get install pdsh" in (f.fix or "")
    assert check_pdsh({}, replace(CTX, backend="ssh", head_tools={})) == []


def test_storage_space() -> None:
    low = (StorageFacts("/ckpt", True, True, 150 * GiB, 1000 * GiB),)
    f = only_node7(check_storage(cluster(storage=low), CTX), "storage:/ckpt")
    assert f.status is Status.WARN and "room for only one" in f.detail
    full = (StorageFacts("/ckpt", True, True, 10 * GiB, 1000 * GiB),)
    assert only_node7(check_storage(cluster(storage=full), CTX), "storage").status is Status.FAIL
    ro = (StorageFacts("/ckpt", True, False, 500 * GiB, 1000 * GiB),)
    assert "not writable" in only_node7(check_storage(cluster(storage=ro), CTX), "storage").detail


def test_shm_and_nofile() -> None:
    f = only_node7(check_limits(cluster(shm_total_bytes=64 * 2**20), CTX), "shm")
    assert f.status is Status.WARN and "64 MiB" in f.detail
    f = only_node7(check_limits(cluster(nofile_soft=1024), CTX), "ulimit.nofile")
    assert f.status is Status.WARN and "1024" in f.detail


def test_clock_skew_relative_to_median() -> None:
    assert only_node7(check_clock(cluster(time=1005.0), CTX), "clock").status is Status.WARN
    f = only_node7(check_clock(cluster(time=1100.0), CTX), "clock")
    assert f.status is Status.FAIL and "+100.0 s" in f.detail
    # A node probed 50 s later (slow ssh) is not skewed once the window is known.
    windows = {h: (1000.0, 1000.0) for h in HOSTS} | {"node7": (1050.0, 1050.2)}
    late = check_clock(cluster(time=1050.1), replace(CTX, probe_windows=windows))
    assert worst(late) is Status.PASS


def test_own_name_loopback_trap_gives_hosts_fix() -> None:
    fwd = {**node("node7").forward, "node7": ("127.0.1.1",)}
    f = only_node7(check_own_name(cluster(forward=fwd), CTX), "names.self")
    assert f.status is Status.FAIL and "loopback 127.0.1.1" in f.detail
    assert f.fix == "in /etc/hosts replace `127.0.1.1 node7` with `10.0.0.7 node7`"


def test_peer_name_disagreement_and_failure() -> None:
    fwd = {**node("node7").forward, "node3": ("10.9.9.9",)}
    f = only_node7(check_peer_names(cluster(forward=fwd), CTX), "names.peer")
    assert f.detail == "node3 resolves to 10.9.9.9 here but 10.0.0.3 on node[1-6]"
    fwd = {**node("node7").forward, "node3": "gaierror: [Errno -2] Name or service not known"}
    f = only_node7(check_peer_names(cluster(forward=fwd), CTX), "names.peer")
    assert f.detail.startswith("cannot resolve node3")


def test_reverse_mismatch_warns() -> None:
    rev = {**node("node7").reverse, "10.0.0.2": "old-name.example"}
    f = only_node7(check_peer_names(cluster(reverse=rev), CTX), "names")
    assert f.check == "names.reverse" and f.status is Status.WARN


def test_interface_recommendation_and_env_mismatch() -> None:
    f = only_node7(check_interfaces(cluster(env={"NCCL_SOCKET_IFNAME": "ib"}), CTX),
                   "net.ifname")
    assert f.status is Status.FAIL and f.fix == "NCCL_SOCKET_IFNAME==eth0"
    two = {"lo": ("127.0.0.1",), "eth0": ("10.0.0.7",), "ens2": ("192.168.1.7",)}
    f = only_node7(check_interfaces(cluster(env={}, interfaces=two), CTX), "net.ifname")
    assert f.status is Status.WARN
    assert f.fix == "set NCCL_SOCKET_IFNAME==eth0 and GLOO_SOCKET_IFNAME=eth0 in the inventory env"
    split = {a: ("eth0" if a < "10.0.0.4" else "ens2") for a in node("node7").routes}
    f = only_node7(check_interfaces(cluster(routes=split), CTX), "net.iface")
    assert "different interfaces: ens2, eth0" in f.detail


def test_ifname_semantics() -> None:
    assert ifname_selected("eth", "eth0") and not ifname_selected("=eth", "eth0")
    assert ifname_selected("=eth0,ib0", "ib0") and not ifname_selected("^eth", "eth0")


def test_nccl_env_sanity() -> None:
    f = only_node7(check_nccl_env(cluster(env={"NCCL_IB_DISABLE": "1"}), CTX), "nccl.")
    assert f.status is Status.WARN
    f = only_node7(check_nccl_env(cluster(env={"NCCL_P2P_DISABLE": "1"}), CTX), "nccl.")
    assert f.status is Status.WARN
    f = only_node7(check_nccl_env(cluster(env={"NCCL_IB_HCA": "mlx5_3:1"}), CTX), "nccl.")
    assert f.status is Status.FAIL and "mlx5_3:1" in f.detail and "mlx5_0:1" in f.detail
    down = (IBPort("mlx5_0", 1, "DOWN", "Disabled", "InfiniBand", 10.0),)
    f = only_node7(check_nccl_env(cluster(ib_ports=down), CTX), "rdma")
    assert "none ACTIVE" in f.detail


def test_topology_pcie_only_and_p2p() -> None:

    fx = TESTS / "fixtures" / "gpu"
    pcie = parse_topo_matrix((fx / "topo_pcie_8gpu_pix_phb_sys.txt").read_text())
    nv = parse_topo_matrix((fx / "topo_h100_sxm_8nic.txt").read_text())
    facts = {h: replace(node(h), topo=nv) for h in HOSTS}
    facts["node7"] = replace(facts["node7"], topo=pcie)
    f = only_node7(check_topology(facts, CTX), "gpu.topology")
    assert f.status is Status.WARN and "16/28 GPU pairs cross" in f.detail


def test_unreachable_node_is_reported_once_and_skipped_elsewhere() -> None:
    facts = {h: node(h) for h in HOSTS} | {"node7": unreachable("node7", "ssh: timeout")}
    findings = run_rules(facts, CTX)
    bad = [f for f in findings if f.status is not Status.PASS]
    assert [(f.check, f.host) for f in bad] == [("ssh", "node7")]
    assert check_probe(facts, CTX)[-1].detail == "no answer from the probe: ssh: timeout"


def test_master_port_two_phase() -> None:
    connects: dict[str, dict[str, object]] = {h: {"ok": True} for h in HOSTS[1:6]}
    connects["node7"] = {"ok": False, "error_kind": "timeout", "error": "timed out"}
    findings = check_master_port("node1", 29500, {"bound": True}, connects)
    f = only_node7(findings, "port:29500")
    assert "firewall" in (f.fix or "")
    (busy,) = check_master_port("node1", 29500, {"bound": False, "error": "EADDRINUSE"}, {})
    assert busy.status is Status.FAIL and "ss -ltnp" in (busy.fix or "")


def test_grouping_folds_hosts_in_inventory_order() -> None:
    fs = [Finding("x", Status.WARN, h, "same", "fix") for h in reversed(HOSTS)]
    (g,) = group_findings(fs, HOSTS)
    assert g.hosts == HOSTS and g.host_range == "node[1-7]"
    assert g.one_line() == "WARN x  node[1-7]: same — fix: fix"


def test_loopback_fix_uses_the_routable_address_not_lo() -> None:
    fwd = {**node("node7").forward, "node7": ("127.0.0.1",)}
    routes = {**node("node7").routes, "127.0.0.1": "lo"}
    f = only_node7(check_own_name(cluster(forward=fwd, routes=routes), CTX), "names.self")
    assert f.fix == "in /etc/hosts replace `127.0.0.1 node7` with `10.0.0.7 node7`"


def test_peer_name_on_loopback_warns() -> None:
    fwd = {h: (ADDR[h],) for h in HOSTS} | {"node3": ("127.0.1.1",)}
    facts = {h: replace(node(h), forward=fwd) for h in HOSTS}
    bad = [f for f in check_peer_names(facts, CTX) if f.status is not Status.PASS]
    # node3 itself is covered by names.self; every other node gets the warning.
    assert sorted(f.host for f in bad) == sorted(h for h in HOSTS if h != "node3")
    assert all(f.status is Status.WARN and "loopback 127.0.1.1" in f.detail for f in bad)


def test_one_machine_is_local_transport_or_loopback() -> None:
    from clusterkit.checks.rules_base import one_machine

    assert one_machine([("local", "127.0.0.1"), ("local", "127.0.0.1")])
    assert one_machine([("ssh", "127.0.0.1"), ("ssh", "localhost"), ("ssh", "::1")])
    assert not one_machine([("local", "127.0.0.1"), ("ssh", "10.0.0.2")])
    assert not one_machine([])


def test_loopback_names_only_inform_when_every_node_is_this_machine() -> None:
    """The embedded default: 'vm' -> 127.0.0.1 cannot matter to ranks that all use loopback;
    the same facts on an inventory of several machines still FAIL/WARN (tests above)."""
    fwd = {h: ("127.0.0.1",) for h in HOSTS}
    facts = {h: replace(node(h), forward=fwd) for h in HOSTS}
    one = replace(CTX, one_machine=True)
    own = check_own_name(facts, one)
    assert {f.status for f in own} == {Status.PASS}, own
    assert "every node is this machine" in own[0].detail
    assert {f.status for f in check_peer_names(facts, one)} == {Status.PASS}
    assert worst(check_own_name(facts, CTX)) is Status.FAIL
    assert worst(check_peer_names(facts, CTX)) is Status.WARN
    # an unresolvable own name: gloo falls back to loopback, so a warning, not a failure
    gone = {h: replace(f, forward={**fwd, h: "gaierror: [Errno -2] Name or service not known"})
            for h, f in facts.items()}
    assert worst(check_own_name(gone, one)) is Status.WARN
    assert worst(check_own_name(gone, CTX)) is Status.FAIL
