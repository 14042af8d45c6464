"""Issue 38 item 6: a script that exists nowhere is reported as missing; a refused
restart leaves the record with the launch's exit code (status agrees); `inventory show`
marks spares; doctor checks spares (a spare that fails is no spare)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from clusterkit.checks.doctor import DoctorReport
from clusterkit.checks.doctor_plan import plan_doctor
from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.cli.main import main
from clusterkit.errors import CheckpointError
from clusterkit.inventory import Host, parse_inventory
from clusterkit.jobs.doctor import spare_hosts
from clusterkit.launch.gate import missing_problem, script_is_here
from clusterkit.launch.outcome import exit_status
from clusterkit.launch.registry import JobRecord, Registry
from clusterkit.launch.run import record_refusal
from clusterkit.spec.jobrecord import JobState
from tests.render_cases import plan_for

INV = """\
schema_version: 1
cluster: {name: t}
hosts:
  node[1-4]:
    address: 10.0.0.[1-4]
    slots: 2
spares: [node4]
"""


def test_a_script_that_exists_nowhere_is_missing_not_unsynced(tmp_path: Path) -> None:
    assert missing_problem(["/srv/work/trian.py"], script_here=False) == (
        "/srv/work/trian.py does not exist, on this node nor here on the launching host: "
        "check the script's path (a relative one is taken from the workdir)")
    assert missing_problem(["/srv/work/train.py"], script_here=True).startswith(
        "/srv/work/train.py is not on this node (--sync DIR copies DIR")
    # The launching host's copy is looked for where the user typed the path, not at the
    # node's path (the nodes' workdir is another directory: test_sync_testbed).
    (tmp_path / "train.py").write_text("")
    plan = plan_for("local", "torchrun", script="train.py")
    assert script_is_here(plan, str(tmp_path)) and not script_is_here(plan, str(tmp_path / "x"))


def test_a_refused_restart_is_the_records_exit_and_status_says_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The accelerate run of the issue: attempt 1 lost a node (129), the restart was
    refused (exit 2), and status said exit 129."""
    home = tmp_path / "home"
    registry = Registry(home)
    record = JobRecord(job_id="acc-1", backend="torchrun", created=0.0, launcher_pid=0, nodes=[],
                       state=JobState.FAILED, exit_code=129,
                       failure="node2: the SSH connection dropped")
    registry.save(record)
    refusal = CheckpointError("cannot continue job acc-1: checkpoint step_40 cannot be "
                              "assembled ...")
    record_refusal(registry, record, refusal)
    again = registry.load("acc-1")
    assert again.exit_code == 2 == refusal.exit_code and again.state is JobState.FAILED
    assert again.failure is not None and again.failure.startswith(
        "node2: the SSH connection dropped; restart refused: cannot continue job acc-1")
    monkeypatch.setenv("CLUSTERKIT_HOME", str(home))
    assert main(["status", "acc-1"]) == 0
    assert "acc-1: failed (exit 2)" in capsys.readouterr().out


def test_a_rank_killed_by_a_signal_exits_128_plus_n() -> None:
    assert exit_status(-6) == 134 and exit_status(-9) == 137 and exit_status(3) == 3


def test_inventory_show_marks_spares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INV)
    assert main(["inventory", "show", "-i", str(inv)]) == 0
    out = capsys.readouterr().out
    assert "t: 4 hosts (node[1-4]), 6 slots + spare node4 (never selected)" in out
    assert "node4 (spare)" in out and "node3 (spare)" not in out
    assert main(["inventory", "show", "-i", str(inv), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spares"] == ["node4"]
    assert main(["inventory", "validate", "-i", str(inv)]) == 0
    assert "+ spare node4 (never selected)" in capsys.readouterr().out


def test_doctor_checks_the_spares_after_the_selection() -> None:
    inv = parse_inventory(INV, "inv.yaml")
    chosen = [inv.host("node1"), inv.host("node2")]
    assert [h.name for h in spare_hosts(inv, chosen)] == ["node4"]
    assert spare_hosts(inv, [inv.host("node4")]) == []  # among the hosts already: not twice


def _spare_doctor_report(findings: list[Finding]) -> DoctorReport:
    hosts = tuple(Host(name=f"node{i}", address=f"10.0.0.{i}", slots=2) for i in (1, 2, 4))
    plan = plan_doctor(hosts, head_python=sys.executable, head_cwd="/work", head_tools={},
                       spares=["node4"])
    return DoctorReport(plan, {h: NodeFacts(host=h) for h in plan.ctx.hosts}, tuple(findings))


def test_a_spare_that_fails_the_checks_is_no_spare() -> None:
    ok = [Finding("ssh", Status.PASS, h, "probe answered") for h in ("node1", "node2", "node4")]
    assert _spare_doctor_report(ok).verdict() == (
        "PASS: all 3 nodes ready (node[1-2,4]; spare node4 checked too)")
    bad = _spare_doctor_report([*ok, Finding("version.torch", Status.FAIL, "node4", "torch 2.3.1", "pip")])
    assert bad.verdict() == ("FAIL: 1 failure on node4; 2 of 3 nodes clean; spare node4 would "
                             "fail the launch's gate: no spare until fixed")
    assert bad.exit_code() == 2


def test_only_the_contract_saves_on_usr1_in_the_resume_rule() -> None:
    """spec/resume.saves_on_usr1, one rule: the profile's (the contract's and the bundled
    workload's: yes; every other: no; no profile: as before, yes), in resume_rule's
    plain values and in what render/sbatch.py gives node/slurm/end.py."""
    from clusterkit.spec.programs import CONTRACT, PROFILES, ProgramChoice, detect
    from clusterkit.spec.resume import resume_rule, saves_on_usr1

    assert saves_on_usr1(None) and saves_on_usr1(detect(workload=True, args=(), script_text=None))
    for name, prof in PROFILES.items():
        choice = ProgramChoice(prof, "test")
        rule = resume_rule(choice, job_id="j", ckpt_dir="/ck/j", node_local=True, workload=False)
        assert rule["saves_on_usr1"] is (name == CONTRACT) is saves_on_usr1(choice), name


def test_a_program_whose_source_handles_the_stop_saves_on_usr1_whatever_its_profile() -> None:
    """A script that saves with torch.save (the snapshot profile) but installs a SIGUSR1
    handler, or polls $CLUSTERKIT_STOP_FILE, follows the contract's stop: USR1 asks it to
    save (the stop rows) rather than ending its step. HF's Trainer script does not."""
    from clusterkit.spec.programs import SNAPSHOT, detect
    from clusterkit.spec.resume import saves_on_usr1

    handler = "import signal, torch\nsignal.signal(signal.SIGUSR1, stop)\ntorch.save(m, p)\n"
    polls = "import os, torch\nif os.path.exists(os.environ['CLUSTERKIT_STOP_FILE']): torch.save(m, p)\n"
    plain = "import torch\ntorch.save(m, p)\n"
    for text, saves in ((handler, True), (polls, True), (plain, False)):
        choice = detect(workload=False, args=(), script_text=text)
        assert choice.name == SNAPSHOT and saves_on_usr1(choice) is saves, text
    hf = "from transformers import Trainer, TrainingArguments\n"
    assert not saves_on_usr1(detect(workload=False, args=(), script_text=hf))
    # --program and --resume-arg name the profile; the source still says who handles USR1
    assert saves_on_usr1(detect(workload=False, args=(), script_text=handler,
                                resume_arg="--resume {dir}"))
