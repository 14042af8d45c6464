"""A dry run that tells the truth (issue 25): `launch --dry-run` makes every check the
launch makes before starting, and exits 2 where the launch would refuse.

Local checks (the script, --sync DIR) are one function both paths call
(`launch.gate.check_here`); the node checks are the gate the agents run, run on its
own (`gate_nodes` + `run_gate`), with the checkpoint dir, master address and port
added to it (node/facts/gatefacts.py). The test bed proves the node checks over SSH
(tests/bed/test_launch_preflight_testbed.py).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from clusterkit.cli.main import main
from clusterkit.launch.gate import gate_nodes, judge, node_needs
from clusterkit.node.facts.gatefacts import (
    dir_problem,
    gate_facts,
    need_dir,
    need_port,
    need_resolve,
    port_problem,
    resolve_problem,
)


@pytest.fixture()
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CLUSTERKIT_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('rank')\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x\n")
    return tmp_path


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *want: str) -> str:
    """Exit 2, the plan on stdout, exactly one error line containing every ``want``."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out.startswith("job "), out  # the plan is still printed
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clusterkit: error: "), err
    for w in want:
        assert w in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ the node program


def test_checkpoint_dir_is_probed_for_real(tmp_path: Path) -> None:
    assert dir_problem(str(tmp_path)) is None
    assert dir_problem(str(tmp_path / "a" / "b")) is None  # creatable: its parent is writable
    assert not (tmp_path / "a").exists()  # nothing left behind: a dry run stays dry
    assert list(tmp_path.iterdir()) == []
    # root passes os.access on /proc; creating a directory there fails (the case)
    assert dir_problem("/proc/nope") == "cannot be created in /proc (No such file or directory)"
    (tmp_path / "f").write_text("")
    assert dir_problem(str(tmp_path / "f" / "ck")) == \
        f"cannot be created: {tmp_path / 'f'} is not a directory"


def test_master_port_and_address_checks() -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert port_problem(port) == "Address already in use"
    assert port_problem(port) is None
    assert resolve_problem("127.0.0.1") is None
    assert resolve_problem("no-such-host.invalid") is not None


def test_gate_facts_report_every_need(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    facts = gate_facts([str(script), str(tmp_path / "gone.py"), need_dir("/proc/nope"),
                        need_dir(str(tmp_path / "ck")), need_resolve("no-such-host.invalid"),
                        need_port(1)])
    assert facts["missing"] == [str(tmp_path / "gone.py")]
    assert list(facts["unwritable"]) == ["checkpoint dir=/proc/nope"]
    assert list(facts["resolve"]) == ["no-such-host.invalid"]
    assert facts["port"] == {}  # root may listen on port 1


def test_judge_names_each_new_problem() -> None:
    base = {"python": "/py", "version": "3.11"}
    facts = {"n1": {**base, "port": {"29500": "Address already in use"}, "unwritable": {},
                    "resolve": {}},
             "n2": {**base, "unwritable": {"checkpoint dir=/ck/j": "cannot be created in / "
                                                                  "(Read-only file system)"}},
             "n5": {**base, "unwritable": {"job dir=/w/.clusterkit/jobs/j": "is not writable "
                                                                           "(Permission denied)"}},
             "n3": {**base, "resolve": {"master0": "Name or service not known"}},
             "n4": dict(base)}  # an agent from before these checks: nothing to say
    problems = judge(facts, {}, ["n1", "n2", "n3", "n4", "n5"]).problems
    assert problems["n1"].startswith("master port 29500 is taken here (Address already in use)")
    assert problems["n2"] == ("checkpoint dir /ck/j cannot be created in / (Read-only file "
                              "system); it comes from --ckpt-dir or the inventory's checkpoint "
                              "dirs")
    assert problems["n5"] == ("job dir /w/.clusterkit/jobs/j is not writable (Permission denied); "
                              "it comes from the workdir (the inventory's, or the current "
                              "directory)")
    assert problems["n3"].startswith("cannot resolve the master address master0 here")
    assert "n4" not in problems


@pytest.mark.parametrize(("versions", "odd"), [
    ({"n1": "2.3.1", "n2": "2.4.0", "n3": "2.4.0"}, "n1"),  # the first node is the odd one
    ({"n1": "2.4.0", "n2": "2.3.1", "n3": "2.4.0"}, "n2"),
    ({"n1": "2.4.0", "n2": "2.3.1"}, "n2"),  # a tie: the earliest node's value wins
])
def test_gate_and_doctor_give_one_verdict(versions: dict[str, str], odd: str) -> None:
    """The same facts given to the gate and to doctor: both blame the same node, by the
    one rule (majority, ties to the earliest node: node/facts/parity.py), for every package
    of the one table the gate reads (a mismatch there refuses / FAILs)."""
    from clusterkit.checks.facts import NodeFacts
    from clusterkit.checks.findings import Status
    from clusterkit.checks.rules_base import DoctorContext
    from clusterkit.checks.rules_parity import check_versions
    from clusterkit.hostrange import fold
    from clusterkit.node.facts.gatefacts import PACKAGES
    from clusterkit.node.facts.parity import MUST, packages

    assert packages(MUST) == PACKAGES and PACKAGES
    order = list(versions)
    for pkg in PACKAGES:
        gate = judge({n: {"python": "/py", "version": "3.11", pkg: v}
                      for n, v in versions.items()}, {}, order).problems
        doctor = check_versions({n: NodeFacts(host=n, python_executable="/py",
                                              python_version="3.11", versions={pkg: v})
                                 for n, v in versions.items()}, DoctorContext(hosts=tuple(order)))
        failed = {f.host for f in doctor if f.check == f"version.{pkg}" and f.status is Status.FAIL}
        assert set(gate) == failed == {odd}
        want = versions[next(n for n in order if n != odd)]
        assert gate[odd] == ("differs from the majority: "
                             f"{pkg} {versions[odd]} != {want} on {fold(n for n in order if n != odd)}")


def test_node_needs_script_ckpt_master() -> None:
    from clusterkit.inventory import local_inventory
    from clusterkit.plan.build import plan_job
    from clusterkit.spec.job import JobOptions
    from tests.render_cases import FACTS

    plan = plan_job(local_inventory("/tmp/ck"), JobOptions(job_id="j", nodes=2,
                                                          script="train.py"), FACTS)
    first, second = (node_needs(plan, n) for n in plan.nodes)
    workdir = plan.nodes[0].workdir
    assert first == (f"{workdir}/train.py", need_dir(plan.nodes[0].job_dir, "job dir"),
                     need_dir(plan.nodes[0].ckpt_dir), need_resolve(plan.master_addr),
                     need_port(plan.master_port))
    assert second == (f"{workdir}/train.py", need_dir(plan.nodes[1].job_dir, "job dir"),
                      need_dir(plan.nodes[1].ckpt_dir),
                      need_resolve(plan.master_addr))  # the port: the master's node only
    assert need_dir("/ck") == "dir:checkpoint dir=/ck"
    nvme = plan_job(local_inventory("/tmp/ck"), JobOptions(
        job_id="j", nodes=1, zero_stage=3, offload_param="nvme", storage="node-local"), FACTS)
    assert need_dir("/tmp/ck/nodes/local1/ckpt/nvme-offload", "NVMe offload dir") in \
        node_needs(nvme, nvme.nodes[0])
    assert all(not any(x.startswith("/") for x in g.needs)
               for g in gate_nodes(plan, synced=True))  # --sync brings the script


# ------------------------------------------------------------------ the CLI


@pytest.mark.parametrize(("argv", "want"), [
    (["missing.py"], ("SCRIPT: missing.py: no such file",)),
    (["adir"], ("SCRIPT: adir is a directory, not a Python file",)),
    (["--sync", "/nonexistent", "train.py"], ("--sync: /nonexistent does not exist",)),
    (["--sync", "afile", "train.py"], ("--sync: afile is not a directory",)),
    (["--storage", "shared", "--ckpt-dir", "/proc/nope", "train.py"],
     ("pre-launch check failed on 4 node(s): local[1-4]: checkpoint dir /proc/nope/",
      "cannot be created in /proc")),
])
def test_dry_run_refuses_what_the_launch_refuses(cwd: Path, capsys: pytest.CaptureFixture[str],
                                                argv: list[str], want: tuple[str, ...]) -> None:
    """Each of these exited 0 with a plan (issue 25)."""
    _refused(["launch", "--dry-run", *argv], capsys, *want)
    assert not (cwd / "home" / "jobs").exists()  # nothing was started or recorded


def test_dry_run_refuses_an_unwritable_workdir(cwd: Path, capsys: pytest.CaptureFixture[str]
                                               ) -> None:
    (cwd / "inv.yaml").write_text("schema_version: 1\ndefaults: {transport: local, workdir: "
                                  "/proc/wd, checkpoint: {shared_dir: " + str(cwd / "ck") + "}}\n"
                                  "hosts:\n  l1: {address: 127.0.0.1}\n")
    _refused(["launch", "--dry-run", "-i", "inv.yaml", "--job-id", "wd"], capsys,
             "l1: job dir /proc/wd/.clusterkit/jobs/wd cannot be created in /proc",
             "it comes from the workdir")


def test_dry_run_that_passes_says_what_it_checked(cwd: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", "--nodes", "2", "--job-id", "ok", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "pre-launch checks passed on 2 nodes: same Python and packages, train.py, job and " \
           "checkpoint dirs writable, master 127.0.0.1 resolves, port" in out
    # --sync . brings the script: the dry run does not ask the nodes for it
    assert main(["launch", "--dry-run", "--nodes", "1", "--sync", ".", "train.py"]) == 0
    assert "packages, job and checkpoint dirs writable" in capsys.readouterr().out
    # --skip-checks skips the node gate, as it does for a launch; --sync DIR still must exist
    assert main(["launch", "--dry-run", "--skip-checks", "missing.py"]) == 0
    assert "pre-launch checks on the nodes: skipped (--skip-checks)" in capsys.readouterr().out
    _refused(["launch", "--dry-run", "--skip-checks", "--sync", "nope", "train.py"], capsys,
             "--sync: nope does not exist")


def test_dry_run_refuses_a_master_port_in_use(cwd: Path, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    from clusterkit.spec.ports import master_port

    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("", master_port("busy")))
        busy.listen(1)
        _refused(["launch", "--dry-run", "--nodes", "1", "--job-id", "busy", "train.py"], capsys,
                 f"local1: master port {master_port('busy')} is taken here",
                 "a new --job-id picks another port")


def test_a_real_launch_refuses_an_unwritable_checkpoint_dir(
        cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same gate, folded into the agents: `--ckpt-dir /proc/nope` used to pass a real
    launch too, and fail in the ranks."""
    code = main(["launch", "--nodes", "2", "--job-id", "ro", "--storage", "shared",
                 "--ckpt-dir", "/proc/nope", "train.py"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(
        "clusterkit: error: pre-launch check failed on 2 node(s): local[1-2]: checkpoint dir "
        "/proc/nope/ro cannot be created in /proc"), err
    assert "[r0" not in err  # no rank started


def test_an_interpreter_path_counts_only_where_the_launcher_needs_one_path() -> None:
    """The gate's verdict on paths is doctor's (launchers.base.Backend.same_python):
    DeepSpeed's runner starts its own path on every node, so a node with another path
    is refused; one launcher per node runs each host's `python:`, where only versions
    must agree."""
    from clusterkit.checks.rules_parity import SAME_PYTHON_BACKENDS
    from clusterkit.launchers import BACKENDS

    facts = {"n1": {"python": "/venv/bin/python", "version": "3.11"},
             "n2": {"python": "/venv/bin/python", "version": "3.11"},
             "n3": {"python": "/opt/py/bin/python", "version": "3.11"}}
    order = ["n1", "n2", "n3"]
    assert "python /opt/py/bin/python" in judge(facts, {}, order).problems["n3"]
    assert judge(facts, {}, order, same_python=False).ok
    assert BACKENDS["deepspeed"].same_python and not BACKENDS["torchrun"].same_python
    assert {b.doctor for b in BACKENDS.values() if b.same_python} <= set(SAME_PYTHON_BACKENDS)
