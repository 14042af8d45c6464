"""Doctor orchestration without the test bed: plan, report, --fix-env, bandwidth maths,
and one end-to-end run over local (subprocess) "nodes"."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import sys
from pathlib import Path

import pytest

from clusterkit.checks.bandwidth import analyze, bandwidth_findings, busbw_allreduce
from clusterkit.checks.doctor import (
    _facts_of,
    run_doctor,
)
from clusterkit.checks.doctor_plan import plan_doctor
from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.fixenv import merge_env_file, recommended_env
from clusterkit.cli.main import main
from clusterkit.errors import ClusterkitError, TransportError
from clusterkit.inventory import Host, local_inventory
from clusterkit.node.facts.bw_worker import round_robin
from clusterkit.remote.base import CommandResult
from clusterkit.remote.dispatch import DispatchTransport
from clusterkit.units import parse_size
from tests.helpers import free_port

HOSTS = tuple(Host(name=f"node{i}", address=f"10.0.0.{i}", slots=2, python="/venv/bin/python")
              for i in range(1, 4))


def _doctor_plan(**kw: object):  # type: ignore[no-untyped-def]
    return plan_doctor(HOSTS, head_python="/usr/bin/python3", head_cwd="/work",
                       head_tools={"pdsh": None}, **kw)  # type: ignore[arg-type]


def test_plan_passes_every_address_as_peer_and_the_master() -> None:
    plan = _doctor_plan(master_port=29600)
    argv = plan.nodes[1].argv
    assert argv[0] == "/venv/bin/python" and argv[argv.index("facts.probe") + 1] == "facts"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--peer"] == [
        "10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert argv[argv.index("--master") + 1] == "10.0.0.1:29600"
    assert argv[argv.index("--workdir") + 1] == "/work"  # launcher's cwd when unset
    assert plan.ctx.hosts == ("node1", "node2", "node3")
    assert "--master" not in _doctor_plan(master_port=None).nodes[0].argv


def test_backend_maps_to_rule_semantics() -> None:
    assert _doctor_plan(backend="deepspeed").ctx.backend == "deepspeed"
    assert _doctor_plan(backend="torchrun").ctx.backend == "ssh"


def _doctor_report(findings: list[Finding]):  # type: ignore[no-untyped-def]
    from clusterkit.checks.doctor import DoctorReport

    plan = _doctor_plan()
    facts = {h: NodeFacts(host=h) for h in plan.ctx.hosts}
    return DoctorReport(plan, facts, tuple(findings))


def test_verdict_and_exit_codes() -> None:
    ok = [Finding("ssh", Status.PASS, h, "probe answered") for h in ("node1", "node2", "node3")]
    r = _doctor_report(ok)
    assert r.exit_code() == 0 and r.verdict().startswith("PASS: all 3 nodes ready")
    warn = _doctor_report([*ok, Finding("ninja", Status.WARN, "node2", "x", "fix")])
    assert warn.exit_code() == 0 and warn.exit_code(strict=True) == 1
    assert warn.clean_hosts() == ["node1", "node3"]
    fail = _doctor_report([*ok, Finding("version.torch", Status.FAIL, "node3", "torch 2.3.1 ≠", "pip")])
    assert fail.exit_code() == 2 and fail.exit_code(strict=True) == 2
    assert fail.verdict() == "FAIL: 1 failure on node3; 2 of 3 nodes clean"
    data = fail.to_json()
    assert data["exit_code"] == 2 and data["groups"][0]["check"] == "version.torch"


def test_unreachable_and_bad_interpreter_become_facts() -> None:
    err = TransportError("connection refused by 10.0.0.2:22", kind="refused", host="node2")
    facts, raw = _facts_of("node2", None, err, "/venv/bin/python")
    assert not facts.ok and facts.error_kind == "refused" and raw == {}
    res = CommandResult("node3", ("x",), 127, "", "sh: 1: /venv/bin/python: not found\n", 0.1)
    facts, _ = _facts_of("node3", res, None, "/venv/bin/python")
    assert facts.error_kind == "interpreter" and "/venv/bin/python" in (facts.probe_error or "")
    res = CommandResult("node3", ("x",), 0, "motd banner\n", "", 0.1)
    assert _facts_of("node3", res, None, "p")[0].error_kind == "probe"


def test_merge_env_file_replaces_ours_keeps_theirs_drops_blank_and_comments() -> None:
    old = "# comment\nHF_HOME=/data\n\nNCCL_SOCKET_IFNAME=eth\nPATH=/x\n"
    new = merge_env_file(old, {"NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0"})
    assert new == "HF_HOME=/data\nNCCL_SOCKET_IFNAME==eth0\nPATH=/x\nGLOO_SOCKET_IFNAME=eth0\n"
    assert merge_env_file("", {"A": "1"}) == "A=1\n"


def test_recommended_env_exact_ifname_and_interpreter_bin() -> None:
    nodes = {h: NodeFacts(host=h, python_executable="/venv/bin/python",
                          interfaces={"lo": ("127.0.0.1",), "ens1": (f"10.0.0.{i}",)},
                          routes={"10.0.0.9": "ens1"})
             for i, h in enumerate(("node1", "node2", "node3"), 1)}
    r = _doctor_report([])
    r = type(r)(r.plan, nodes, ())
    assert recommended_env(r) == {"NCCL_SOCKET_IFNAME": "=ens1", "GLOO_SOCKET_IFNAME": "ens1",
                                  "PATH": "/venv/bin:$PATH"}


def test_parse_size() -> None:
    assert parse_size("4M") == 4 << 20 and parse_size("1.5G") == int(1.5 * 2**30)
    assert parse_size("512") == 512
    with pytest.raises(ClusterkitError):
        parse_size("lots")


# ----------------------------------------------------------------------------- bandwidth maths


def test_round_robin_covers_every_pair_once_with_disjoint_rounds() -> None:
    for n in (2, 3, 7, 8):
        seen = set()
        for rnd in round_robin(n):
            assert all(rnd[b] == a for a, b in rnd.items())  # symmetric = disjoint pairs
            seen |= {(min(a, b), max(a, b)) for a, b in rnd.items()}
        assert seen == {(a, b) for a in range(n) for b in range(a + 1, n)}


def test_busbw_formula_matches_nccl_tests() -> None:
    assert busbw_allreduce(10.0, 8) == pytest.approx(17.5)
    assert busbw_allreduce(10.0, 2) == pytest.approx(10.0)


def test_analyze_ranks_nodes_and_flags_the_straggler() -> None:
    hosts = ["n1", "n2", "n3", "n4"]
    mb = 1_000_000

    def t(a: int, b: int) -> float:  # seconds to move 1 MB: n3's link is 4x slower
        return 0.004 if 2 in (a, b) else 0.001

    ranks = {h: {"allreduce_s": 0.002, "pairs": [{"peer": j, "time_s": t(i, j)}
                                                  for j in range(4) if j != i]}
             for i, h in enumerate(hosts)}
    res = analyze(hosts, ranks, "gloo", mb)
    assert res.algbw_gbs == pytest.approx(0.5) and res.busbw_gbs == pytest.approx(0.75)
    assert len(res.pairs) == 6
    assert res.stragglers == ("n3",) and res.ranking()[-1] == "n3"
    warn = [f for f in bandwidth_findings(res) if f.status is Status.WARN]
    assert [(f.host, f.check) for f in warn] == [("n3", "bandwidth.pairs")]


def test_analyze_reports_failed_ranks() -> None:
    res = analyze(["a", "b"], {"a": {"fatal": "RuntimeError: timeout"}}, "gloo", 10)
    assert res.errors == {"a": "RuntimeError: timeout", "b": "no result"}
    assert {f.host for f in bandwidth_findings(res)} == {"a", "b"}


# ----------------------------------------------------------------------------- end to end, local



def test_run_doctor_on_local_nodes(tmp_path: Path) -> None:
    inv = local_inventory(str(tmp_path), nodes=2)
    plan = plan_doctor(inv.hosts, head_python=sys.executable, head_cwd=str(tmp_path),
                       head_tools={}, master_port=free_port())
    with DispatchTransport() as transport:
        report = run_doctor(plan, transport)
    assert all(f.ok for f in report.facts.values()), report.facts
    port = [f for f in report.findings if f.check.startswith("port:")]
    assert port and all(f.status is Status.PASS for f in port), port
    assert not [f for f in report.findings if f.check == "ssh" and f.status is not Status.PASS]


def test_cli_json_on_local_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["doctor", "--json", "--nodes", "2", "--master-port", str(free_port())])
    data = json.loads(out.getvalue())
    assert code == data["exit_code"] and data["hosts"] == ["local1", "local2"]
    assert data["unreachable"] == {}


def test_a_newcomers_first_doctor_passes_on_the_embedded_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No -i: the embedded default's nodes are all this machine. Its own hostname on
    loopback (most laptops, containers) must not fail it; a real inventory still would."""
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path))
    monkeypatch.delenv("CLUSTERKIT_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["doctor", "--json", "--master-port", str(free_port())])
    data = json.loads(out.getvalue())
    failed = [f for f in data["findings"] if f["status"] == "FAIL"]
    assert code == 0 and data["exit_code"] == 0, out.getvalue()[-3000:]
    assert not failed
    plan = plan_doctor(local_inventory(str(tmp_path)).hosts, head_python=sys.executable,
                       head_cwd=str(tmp_path), head_tools={})
    assert plan.ctx.one_machine
    real = [Host(name=f"n{i}", address=f"10.0.0.{i}") for i in (1, 2)]
    assert not plan_doctor(real, head_python="python3", head_cwd="/", head_tools={}).ctx.one_machine


# ----------------------------------------------------------------------------- probe modes used


def test_listener_exits_when_its_reader_goes_away() -> None:
    import subprocess
    import time

    from clusterkit.node.facts import probe

    port = free_port()
    proc = subprocess.Popen([sys.executable, probe.__file__, "listen", str(port), "60"],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["event"] == "ready"
        hello = probe.do_connect("127.0.0.1", port, 3.0)
        assert hello["ok"]
        assert json.loads(proc.stdout.readline())["event"] == "hello"
        started = time.monotonic()
        proc.stdout.close()  # what closing the SSH channel does to the remote listener
        proc.wait(10)
        assert time.monotonic() - started < 3.0
    finally:
        proc.kill()
        proc.wait()


def test_connect_with_retry_waits_for_a_late_listener() -> None:
    import threading
    import time

    from clusterkit.node.facts import probe

    port = free_port()
    srv = socket.socket()

    def late() -> None:
        time.sleep(0.5)
        srv.bind(("127.0.0.1", port))
        srv.listen()

    threading.Thread(target=late, daemon=True).start()
    try:
        res = probe.connect_with_retry("127.0.0.1", port, 1.0, wait=5.0)
        assert res["ok"] and res["attempts"] > 1
        closed = probe.connect_with_retry("127.0.0.1", free_port(), 1.0, wait=0.2)
        assert closed["error_kind"] == "refused"
    finally:
        srv.close()


def test_slow_start_up_is_a_warning() -> None:
    from clusterkit.checks.doctor import startup_findings

    found = startup_findings({"node1": 0.4, "node2": 31.0})
    assert [(f.host, f.check, f.status) for f in found] == [("node2", "ssh.startup", Status.WARN)]
    assert "bashrc" in (found[0].fix or "")
