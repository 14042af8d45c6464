"""clusterkit.slurm without a cluster: parsers, argv + timeouts + hints, the output follower."""

from __future__ import annotations

import io
import json
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from clusterkit.cli.main import main
from clusterkit.slurm.client import SlurmClient, SlurmError
from clusterkit.slurm.jobinfo import JobInfo, SlurmParseError, parse_job, parse_parsable
from clusterkit.slurm.watch import watch

# A real `scontrol show job -o` record from the Slurm test bed (22.05), trimmed.
SHOW_JOB = (
    "JobId=7 JobName=ck-t1 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 "
    "Nice=0 Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=138:0 RunTime=00:01:27 "
    "TimeLimit=01:00:00 NodeList=node[1-2] BatchHost=node1 NumNodes=2 NumCPUs=2 "
    "Command=/tmp/my jobs/t1/sbatch.sh WorkDir=/tmp/my jobs/t1 "
    "StdErr=/tmp/t1/logs/slurm-7.err StdIn=/dev/null StdOut=/tmp/t1/logs/slurm-7.out Power= "
    "TresPerNode=gres:gpu:2\n"
)


def test_parse_parsable() -> None:
    assert parse_parsable("123\n") == "123"
    assert parse_parsable("123;cluster2\n") == "123"
    assert parse_parsable("sbatch: warning: x\n45\n") == "45"
    with pytest.raises(SlurmParseError):
        parse_parsable("Submitted batch job 5\n")


def test_parse_job_fields_with_spaces() -> None:
    info = parse_job(SHOW_JOB, "7")
    assert (info.job_id, info.name, info.state, info.reason) == ("7", "ck-t1", "FAILED", "NonZeroExitCode")
    assert (info.exit_code, info.exit_signal, info.nodes) == (138, 0, "node[1-2]")
    assert info.stdout == "/tmp/t1/logs/slurm-7.out"
    assert info.fields["Command"] == "/tmp/my jobs/t1/sbatch.sh"
    assert info.finished and not info.succeeded
    assert info.describe() == "FAILED (exit code 138, reason NonZeroExitCode)"


@pytest.mark.parametrize(("state", "finished"), [("PENDING", False), ("RUNNING", False),
                                                 ("COMPLETING", False), ("CANCELLED", True),
                                                 ("TIMEOUT", True), ("COMPLETED", True)])
def test_terminal_states(state: str, finished: bool) -> None:
    info = parse_job(SHOW_JOB.replace("JobState=FAILED", f"JobState={state}"), "7")
    assert info.finished is finished


class FakeSlurm:
    """Answers Slurm commands from a script of (stdout, stderr, rc) or exceptions."""

    def __init__(self, answers: list[object]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], float, str | None]] = []

    def __call__(self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None,
                 cwd: str | None) -> subprocess.CompletedProcess[str]:
        self.calls.append((list(argv), timeout, cwd))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        out, err, rc = answer  # type: ignore[misc]
        return subprocess.CompletedProcess(list(argv), rc, out, err)


def test_submit_argv_cwd_timeout(tmp_path: Path) -> None:
    fake = FakeSlurm([("42\n", "", 0)])
    client = SlurmClient(timeout_s=7, runner=fake)
    assert client.submit(tmp_path / "sbatch.sh") == "42"
    assert fake.calls == [(["sbatch", "--parsable", str(tmp_path / "sbatch.sh")], 7, str(tmp_path))]


def test_cancel_signal_argv() -> None:
    fake = FakeSlurm([("", "", 0), ("", "", 0)])
    client = SlurmClient(runner=fake)
    client.cancel("5")
    client.cancel("5", signal="USR1", full=True)
    assert [c[0] for c in fake.calls] == [["scancel", "5"], ["scancel", "--signal=USR1", "--full", "5"]]


@pytest.mark.parametrize(("answer", "needle"), [
    (("", "sbatch: error: Batch job submission failed: Invalid partition name specified\n", 1),
     "sinfo -s"),
    (("", "sbatch: error: Batch job submission failed: Invalid generic resource (gres) "
          "specification\n", 1), "declare no GPUs"),
    (("", "sbatch: error: Batch job submission failed: Invalid feature specification\n", 1),
     "sinfo -o '%N %f'"),
    (FileNotFoundError("sbatch"), "login node"),
    (subprocess.TimeoutExpired("sbatch", 3), "scontrol ping"),
])
def test_errors_are_one_line_with_hint(answer: object, needle: str) -> None:
    client = SlurmClient(timeout_s=3, runner=FakeSlurm([answer]))
    with pytest.raises(SlurmError) as err:
        client.submit("/x/sbatch.sh")
    assert needle in err.value.one_line()
    assert "\n" not in err.value.one_line()


def _scontrol_record(state: str, out: Path, restarts: int = 0) -> str:
    return (f"JobId=9 JobName=ck JobState={state} Reason=None Restarts={restarts} ExitCode=0:0 "
            f"NodeList=node1 StdErr={out} StdOut={out}\n")


def test_watch_follows_output_and_restart(tmp_path: Path) -> None:
    out_file = tmp_path / "slurm-9.out"
    steps = [("PENDING", None), ("RUNNING", "line 1\npart"), ("RUNNING", "line 1\npartial 2\n"),
             ("RUNNING", "again\n"), ("COMPLETED", "again\ndone")]
    answers: list[object] = []
    writes: list[str | None] = []
    for i, (state, text) in enumerate(steps):
        answers.append((_scontrol_record(state, out_file, restarts=1 if i >= 3 else 0), "", 0))
        writes.append(text)

    def sleep(_: float) -> None:
        text = writes.pop(0) if writes else None
        if text is not None:
            out_file.write_text(text)

    sleep(0)  # the PENDING poll sees no file
    out, err = io.StringIO(), io.StringIO()
    info = watch(SlurmClient(runner=FakeSlurm(answers)), "9", out, err, poll_s=0, sleep=sleep)
    assert isinstance(info, JobInfo) and info.succeeded
    # whole lines while running; the shrink (requeue) starts over; the tail at the end
    assert out.getvalue() == "line 1\npartial 2\nagain\ndone"
    assert "requeued" in err.getvalue() and "COMPLETED" in err.getvalue()


def _write_ssh_inventory(tmp_path: Path, gpus: int, local_dir: str = "/scratch/ckpt") -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(
        "schema_version: 1\ncluster: {name: unit}\n"
        f"defaults: {{transport: ssh, gpus: {gpus}, slots: 2, python: /usr/bin/python3, "
        f"workdir: {tmp_path}/work, checkpoint: {{shared_dir: {tmp_path}/ckpt, "
        f"local_dir: {local_dir}}}}}\n"
        "hosts:\n  n1: {address: 10.0.0.1}\n  n2: {address: 10.0.0.2}\n")
    return path


def test_writing_the_job_files_again_drops_a_killed_run_s_plain_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run killed hard after a conversion leaves ds_config.json.plain (its config was
    for that run only); the next run's start would move it over the file `clusterkit
    sbatch` just wrote again (a changed DeepSpeed config lost): writing removes it."""
    inv = _write_ssh_inventory(tmp_path, gpus=0)
    argv = ["sbatch", "-i", str(inv), "--job-id", "p1", "--storage", "node-local"]
    assert main(argv) == 0
    job_dir = tmp_path / "work/.clusterkit/jobs/p1"
    stale = job_dir / "ds_config.json.plain"
    stale.write_text("{}\n")
    assert main(argv) == 0 and not stale.exists()
    assert "ds_config.json.plain" not in (job_dir / "sbatch.sh").read_text()  # the suffix only
    capsys.readouterr()


def test_cli_dry_run_prints_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = _write_ssh_inventory(tmp_path, gpus=2)
    rc = main(["sbatch", "-i", str(inv), "--nodes", "2", "--gpus-per-node", "2", "--job-id", "j1",
               "--partition", "gpu", "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=2\n" in out and "#SBATCH --gpus-per-node=2\n" in out
    assert "#SBATCH --partition=gpu\n" in out
    assert "2 nodes x 2 = 4 ranks" in err
    assert not (tmp_path / "work").exists()  # a dry run writes nothing


def test_cli_write_without_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = _write_ssh_inventory(tmp_path, gpus=0)
    assert main(["sbatch", "-i", str(inv), "--job-id", "j2", "--storage", "node-local"]) == 0
    job_dir = tmp_path / "work/.clusterkit/jobs/j2"
    assert (job_dir / "sbatch.sh").is_file() and (job_dir / "ds_config.json").is_file()
    assert (job_dir / "logs").is_dir()  # Slurm opens --output before the script runs
    assert "sbatch " in capsys.readouterr().out


ACCELERATE_SCRIPT = """\
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
accelerator.save_state("out/step_1")
"""


def test_an_accelerate_script_on_cpu_nodes_gets_its_hook_through_sbatch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The job dir's program files (issue 38: accelerate's CPU hook) are the launch's and
    the batch job's alike (LaunchPlan.job_files): sitecustomize.py in the job dir, the
    job dir first on the ranks' PYTHONPATH in the script."""
    inv = _write_ssh_inventory(tmp_path, gpus=0)
    script = tmp_path / "train_acc.py"
    script.write_text(ACCELERATE_SCRIPT)
    assert main(["sbatch", "-i", str(inv), "--job-id", "acc", str(script)]) == 0
    job_dir = tmp_path / "work/.clusterkit/jobs/acc"
    hook = job_dir / "sitecustomize.py"
    assert hook.is_file() and "install(__file__)" in hook.read_text()
    text = (job_dir / "sbatch.sh").read_text()
    assert f"export PYTHONPATH={job_dir}" in text, text[:3000]
    err = capsys.readouterr().err
    assert "program profile: accelerate" in err and "sitecustomize.py" in err, err


def test_cli_bad_partition_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = _write_ssh_inventory(tmp_path, gpus=0)
    rc = main(["sbatch", "-i", str(inv), "--partition", "a b", "--dry-run"])
    assert rc == 2
    assert "--partition" in capsys.readouterr().err


def test_cli_watch_needs_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sbatch", "-i", str(_write_ssh_inventory(tmp_path, 0)), "--watch"]) == 2
    assert "--watch needs --submit" in capsys.readouterr().err


def test_cli_status_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sbatch", "status"]) == 2
    assert "usage: clusterkit sbatch status JOBID" in capsys.readouterr().err


# --- issue 13: site flags, PATH, CPUs, logs, node pinning, shared-fs check, --json ---

def _dry(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str,
         gpus: int = 2, launcher: str = "torchrun") -> tuple[int, str, str]:
    inv = _write_ssh_inventory(tmp_path, gpus=gpus)
    rc = main(["sbatch", "-i", str(inv), "--nodes", "2", "--gpus-per-node", "2", "--job-id", "s1",
               "--launcher", launcher, "--dry-run", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_site_flags_become_sbatch_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _dry(tmp_path, capsys, "--exclusive", "--mem", "200G", "--constraint", "a800",
                        "--gpu-type", "a800", "--signal-lead", "300", "--cpus-per-task", "8",
                        "--sbatch-arg=--reservation=r1", "--sbatch-arg=#SBATCH --nice=10",
                        "--sbatch-arg=--exclude=node[3-4]")
    assert rc == 0, err
    for line in ("--exclusive", "--mem=200G", "--constraint=a800", "--gpus-per-node=a800:2",
                 "--signal=B:USR1@300", "--cpus-per-task=8", "--reservation=r1", "--nice=10",
                 "--exclude=node[3-4]",
                 "--open-mode=append"):
        assert f"#SBATCH {line}\n" in out, line
    assert "nothing written" in err and "--write-only" in err


@pytest.mark.parametrize(("flag", "value", "key"), [
    ("--sbatch-arg", "--comment=a b", "--sbatch-arg"), ("--sbatch-arg", "reservation", "--sbatch-arg"),
    ("--sbatch-arg", "--comment=$(id)", "--sbatch-arg"),
    ("--mem", "lots", "--mem"), ("--constraint", "a;b", "--constraint"), ("--signal-lead", "0",
                                                                          "--signal-lead")])
def test_bad_site_flags_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str,
                                     value: str, key: str) -> None:
    rc, _, err = _dry(tmp_path, capsys, f"{flag}={value}")
    assert rc == 2 and key in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1


def test_script_keeps_the_site_path_and_sets_threads(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for launcher, ranks_per_task in (("torchrun", 2), ("accelerate", 2), ("deepspeed", 1)):
        rc, out, err = _dry(tmp_path, capsys, launcher=launcher)
        assert rc == 0
        assert 'export PATH=/usr/bin:"$PATH"\n' not in out  # a system dir is not re-added
        assert "PATH=/usr/local/sbin" not in out  # the site's PATH is never replaced
        assert "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK" in out
        assert f"task_cpus / {ranks_per_task} > 1 ?" in out, launcher
        # one master port: the summary's is the script's (spec.ports, 20000-32767)
        port = re.search(r"master \S+:(\d+)", err)
        assert port and f"\nMASTER_PORT={port.group(1)}\n" in out, err
        assert 20000 <= int(port.group(1)) <= 32767
    rc, out, _ = _dry(tmp_path, capsys, "--set-env", "OMP_NUM_THREADS=3")
    assert "export OMP_NUM_THREADS=3" in out and "task_cpus / 2" not in out


def test_status_and_cancel_have_their_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    for action, needle in (("status", "scontrol show job"), ("cancel", "--batch")):
        with pytest.raises(SystemExit) as done:
            main(["sbatch", action, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: clusterkit sbatch {action} JOBID") and needle in out


def _patch_slurm_client(monkeypatch: pytest.MonkeyPatch, answers: list[object]) -> FakeSlurm:
    import clusterkit.cli.cmd_sbatch as cmd

    fake = FakeSlurm(answers)

    def client(timeout_s: float = 30.0) -> SlurmClient:
        return SlurmClient(timeout_s=timeout_s, runner=fake)

    monkeypatch.setattr(cmd, "SlurmClient", client)
    return fake


def test_submit_json_and_node_local_resubmit_pins_nodes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _write_ssh_inventory(tmp_path, gpus=0)
    args = ["sbatch", "-i", str(inv), "--job-id", "nl", "--storage", "node-local",
            "--cpus-per-task", "2", "--submit", "--json"]
    fake = _patch_slurm_client(monkeypatch, [("101\n", "", 0)])
    assert main(args) == 0
    out, _ = capsys.readouterr()
    job_dir = tmp_path / "work/.clusterkit/jobs/nl"
    assert json.loads(out) == {"slurm_job_id": "101", "job_id": "nl", "job_dir": str(job_dir),
                               "script": str(job_dir / "sbatch.sh")}
    assert "--nodelist" not in fake.calls[0][0]
    (job_dir / "slurm_nodes").write_text("n[1-2]\n")  # what the first run's script records
    fake = _patch_slurm_client(monkeypatch, [("102\n", "", 0)])
    assert main(args) == 0
    assert fake.calls[0][0][:3] == ["sbatch", "--parsable", "--nodelist=n[1-2]"]
    assert "are on n[1-2]: submitting with --nodelist=n[1-2]" in capsys.readouterr().err


def test_user_template_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tdir = tmp_path / "site"
    tdir.mkdir()
    rc, _, err = _dry(tmp_path, capsys, "--template-dir", str(tdir))
    assert rc == 2 and "no sbatch.sh.j2" in err
    (tdir / "sbatch.sh.j2").write_text("#!/bin/bash\n#SBATCH --nodes={{ nodes }}\nmodule load x\n"
                                       "{{ launch_line }}\n")
    rc, out, err = _dry(tmp_path, capsys, "--template-dir", str(tdir))
    assert rc == 0 and out.startswith("#!/bin/bash\n#SBATCH --nodes=2\nmodule load x\nsrun ")
    (tdir / "sbatch.sh.j2").write_text("#!/bin/bash\n{{ no_such_variable }}\n")
    rc, _, err = _dry(tmp_path, capsys, "--template-dir", str(tdir))
    assert rc == 2 and "no_such_variable" in err and "docs/sbatch.md" in err
    (tdir / "sbatch.sh.j2").write_text("#!/bin/bash\nif then {{ nodes }}\n")
    rc, _, err = _dry(tmp_path, capsys, "--template-dir", str(tdir))
    assert rc == 2 and "not valid bash" in err


STUBS = """
scontrol() {
    if [ "$2" = hostnames ]; then
        case "$3" in 'n[1-2]') printf 'n1\\nn2\\n' ;; 'n[3-4]') printf 'n3\\nn4\\n' ;; *) echo "$3" ;; esac
    else printf '%s\\n' n1; fi
}
getent() { printf '10.0.0.1 STREAM n1\\n'; }
"""


def _run_script(tmp_path: Path, capsys: pytest.CaptureFixture[str], srun_body: str,
                nodelist: str) -> subprocess.CompletedProcess[str]:
    inv = _write_ssh_inventory(tmp_path, gpus=0)
    assert main(["sbatch", "-i", str(inv), "--job-id", "run1", "--storage", "node-local",
                 "--cpus-per-task", "2", "--write-only"]) == 0
    capsys.readouterr()
    script = (tmp_path / "work/.clusterkit/jobs/run1/sbatch.sh").read_text()
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": nodelist,
           "SLURM_CPUS_PER_TASK": "4"}
    # On stdin: the script (with its node programs' sources) is longer than one argument may be.
    return subprocess.run(["bash", "-s"], input=STUBS + f"srun() {{ {srun_body}; }}\n" + script,
                          capture_output=True, text=True, env=env, timeout=30, check=False)


def test_script_names_nodes_that_cannot_see_the_job_dir(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = _run_script(tmp_path, capsys, "echo 'clusterkit-unseen n2'", "n[1-2]")
    assert r.returncode == 2
    assert "is not visible on n2 (put the inventory workdir" in r.stderr
    assert r.stdout.startswith("===== clusterkit: job run1 slurm=77 run 1 on n[1-2]")


def test_script_records_nodes_then_refuses_other_nodes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = _run_script(tmp_path, capsys, ":", "n[1-2]")  # srun does nothing: the step "succeeds"
    assert r.returncode == 0, r.stderr
    assert "OMP_NUM_THREADS=2" in r.stdout  # 4 CPUs for the task, 2 ranks in it
    nodes_file = tmp_path / "work/.clusterkit/jobs/run1/slurm_nodes"
    assert nodes_file.read_text() == "n[1-2]\n"
    r = _run_script(tmp_path, capsys, ":", "n[3-4]")
    assert r.returncode == 3
    assert "keeps node-local checkpoints on n[1-2], but this run got n[3-4]" in r.stderr
    assert "collect-ckpt --scatter" in r.stderr


# --- issue 24 / 25: the smaller sbatch items ---

@pytest.mark.parametrize("value", ["10", "90:30", "2:00:00", "48:00:00", "1-12", "1-12:30",
                                   "1-12:30:00", "UNLIMITED"])
def test_slurm_time_forms_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   value: str) -> None:
    rc, out, err = _dry(tmp_path, capsys, "--time", value)
    assert rc == 0 and f"#SBATCH --time={value}\n" in out, err


@pytest.mark.parametrize("value", ["99:99", "25:99:99", "99:99:99", "1:60", "1-24", "1-2:3:4:5",
                                   "soon", "-5"])
def test_slurm_time_typos_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  value: str) -> None:
    rc, out, err = _dry(tmp_path, capsys, f"--time={value}")
    assert rc == 2 and out == "", err
    (line,) = [ln for ln in err.splitlines() if "error" in ln]
    assert "--time" in line and "MM:SS, HH:MM:SS, D-HH" in line and "UNLIMITED" in line


def test_dry_run_json_is_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _dry(tmp_path, capsys, "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["dry_run"] is True and data["slurm_job_id"] is None and data["job_id"] == "s1"
    assert data["script_text"].startswith("#!/bin/bash\n")


def test_dry_run_is_the_submitted_script(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Byte for byte, --cpus-per-task default included (the dry run asks sinfo too)."""
    inv = _write_ssh_inventory(tmp_path, gpus=0)
    args = ["sbatch", "-i", str(inv), "--nodes", "2", "--job-id", "same"]
    _patch_slurm_client(monkeypatch, [("8\n", "", 0)])
    assert main([*args, "--dry-run"]) == 0
    dry = capsys.readouterr().out
    _patch_slurm_client(monkeypatch, [("8\n", "", 0), ("77\n", "", 0)])
    assert main([*args, "--submit"]) == 0
    assert "#SBATCH --cpus-per-task=8\n" in dry
    assert (tmp_path / "work/.clusterkit/jobs/same/sbatch.sh").read_text() == dry


def test_refused_submission_leaves_no_job_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _write_ssh_inventory(tmp_path, gpus=0)
    _patch_slurm_client(monkeypatch, [("", "sbatch: error: Batch job submission failed: Invalid "
                                "partition name specified\n", 1)])
    assert main(["sbatch", "-i", str(inv), "--job-id", "refused", "--cpus-per-task", "1",
                 "--submit"]) == 2
    assert "Invalid partition name" in capsys.readouterr().err
    assert not (tmp_path / "work/.clusterkit/jobs/refused").exists()


def test_missing_or_relative_script(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _write_ssh_inventory(tmp_path, gpus=0)
    monkeypatch.chdir(tmp_path)
    base = ["sbatch", "-i", str(inv), "--job-id", "rel", "--cpus-per-task", "1"]
    assert main([*base, "--write-only", "nosuch.py"]) == 2
    err = capsys.readouterr().err
    assert "nosuch.py does not exist" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "work/.clusterkit/jobs/rel").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/usertrain.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path / "mine")
    assert main([*base, "--write-only", "usertrain.py", "--lr", "1"]) == 0
    script = (tmp_path / "work/.clusterkit/jobs/rel/sbatch.sh").read_text()
    assert f" {tmp_path}/mine/usertrain.py --lr 1" in script


@pytest.mark.parametrize(("state", "code", "rc"), [("RUNNING", "0:0", 0), ("COMPLETED", "0:0", 0),
                                                   ("FAILED", "2:0", 1), ("CANCELLED", "0:15", 1),
                                                   ("TIMEOUT", "0:1", 1)])
def test_status_exit_code_is_the_outcome(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch, state: str, code: str,
                                         rc: int) -> None:
    _patch_slurm_client(monkeypatch, [(SHOW_JOB.replace("JobState=FAILED", f"JobState={state}")
                                .replace("ExitCode=138:0", f"ExitCode={code}"), "", 0)])
    assert main(["sbatch", "status", "7"]) == rc
    assert state in capsys.readouterr().out


def test_failure_hint_names_only_files_that_exist(tmp_path: Path) -> None:
    from clusterkit.slurm.jobinfo import output_hint

    out = tmp_path / "slurm-2.out"
    info = parse_job(SHOW_JOB.replace("/tmp/t1/logs/slurm-7.out", str(out))
                     .replace("/tmp/t1/logs/slurm-7.err", str(tmp_path / "slurm-2.err")), "7")
    assert "is not on this machine" in output_hint(info) and "node1" in output_hint(info)
    out.write_text("x\n")
    assert output_hint(info) == f"see {out}"


def test_cancel_help_lists_only_cancel_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sbatch", "cancel", "--help"])
    out = capsys.readouterr().out
    assert "--signal" in out and "--batch" in out
    assert "--watch" not in out and "--poll" not in out and "--ranks" not in out
    with pytest.raises(SystemExit):
        main(["sbatch", "status", "--help"])
    out = capsys.readouterr().out
    assert "--watch" in out and "--signal" not in out and "--batch" not in out


def test_no_nccl_variables_on_a_cpu_job(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A gloo job gets no NCCL_*/TORCH_NCCL_* (torch prints a deprecation warning on every
    rank for TORCH_NCCL_TRACE_BUFFER_SIZE); a GPU job keeps them; --set-env always wins."""
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    rc, out, err = _dry(tmp_path, capsys, gpus=0)
    assert rc == 0, err
    assert "NCCL_" not in out.replace("# ", "")  # neither exported nor on the srun line
    rc, out, _ = _dry(tmp_path, capsys, "--set-env", "NCCL_MINE=1", gpus=0)
    assert "NCCL_MINE=1" in out and "NCCL_DEBUG" not in out
    rc, out, _ = _dry(tmp_path, capsys, gpus=2)
    assert "NCCL_DEBUG=INFO" in out and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in out


def test_every_variant_gives_ranks_the_torch_variables(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """deepspeed (one Slurm task per rank): RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE from
    Slurm's own; torchrun/accelerate set them themselves. Every rank runs under the exit
    recorder (the first failing rank's status is the job's)."""
    rc, out, _ = _dry(tmp_path, capsys, launcher="deepspeed")
    assert rc == 0
    assert ('export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" WORLD_SIZE="$SLURM_NTASKS"'
            in out) and " LOCAL_WORLD_SIZE=2 sh -c " in out
    for launcher, no_python in (("torchrun", "--no-python"), ("accelerate", "--no_python")):
        rc, out, _ = _dry(tmp_path, capsys, launcher=launcher)
        assert rc == 0 and f" {no_python} sh -c " in out and "/exits " in out, launcher


# --- the batch script's verdicts, run with Slurm's commands stubbed (no cluster) ---

VERDICT_STUBS = """
scontrol() { echo "scontrol $*" >> "$CALLS"; printf '%s\\n' n1; }
scancel() { echo "scancel $*" >> "$CALLS"; }
getent() { printf '10.0.0.1 STREAM n1\\n'; }
srun() {
    case " $* " in
        *" --kill-on-bad-exit=1 "*) launch_step ;;
        *) return 0 ;;
    esac
}
"""


def _verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str], step: str, *flags: str,
             restarts: int = 0, stubs: str = "") -> tuple[subprocess.CompletedProcess[str], str, Path]:
    """Run the written sbatch.sh with ``step`` as the launch step's body (bash);
    ``stubs``: shell functions that replace VERDICT_STUBS' own. Node-local checkpoints
    (``--storage node-local`` in ``flags``) are kept in ``tmp_path/local``."""
    inv = _write_ssh_inventory(tmp_path, gpus=0, local_dir=str(tmp_path / "local"))
    assert main(["sbatch", "-i", str(inv), "--job-id", "v1", "--storage", "shared",
                 "--cpus-per-task", "2", "--write-only", *flags]) == 0
    capsys.readouterr()
    job_dir = tmp_path / "work/.clusterkit/jobs/v1"
    calls = tmp_path / "calls"
    calls.write_text("")
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n1",
           "SLURM_CPUS_PER_TASK": "4", "SLURM_RESTART_COUNT": str(restarts),
           "CALLS": str(calls)}
    body = f"launch_step() {{ {step}; }}\n"
    script = VERDICT_STUBS + stubs + body + (job_dir / "sbatch.sh").read_text()
    r = subprocess.run(["bash", "-s"], input=script,
                       capture_output=True, text=True, env=env, timeout=60, check=False)
    return r, calls.read_text(), job_dir


def test_script_names_the_first_failing_rank_and_exits_with_its_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = ('printf "200 n1 143\\n" > "$exits/rank0"; printf "100 n2 2\\n" > "$exits/rank3"; '
            "return 143")
    r, _, _ = _verdict(tmp_path, capsys, step)
    assert r.returncode == 2, r.stderr
    assert "clusterkit: rank 3 on n2 failed first (exit code 2)" in r.stderr
    assert "the [rank3] lines of" in r.stderr and "slurm-77.err" in r.stderr


def test_script_requeues_only_for_a_save_after_the_stop_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt/v1"
    # a contract-following step: the stop file appears, it saves into the checkpoint dir
    step = (f'kill -USR1 $$; while [ ! -e "$CLUSTERKIT_STOP_FILE" ]; do sleep 0.1; done; '
            f'sleep 1.1; mkdir -p {ckpt}/step4; echo x > {ckpt}/step4/done; return 0')
    r, calls, _ = _verdict(tmp_path, capsys, step)
    assert r.returncode == 0, r.stderr
    assert "scancel --signal=USR1 77" in calls and "scontrol requeue 77" in calls
    assert "saved after the stop request" in r.stdout and "requeueing job 77" in r.stdout
    # a step that ignores it: nothing saved since, no requeue, said on both files
    step = 'kill -USR1 $$; sleep 1.5; return 0'
    r, calls, job_dir = _verdict(tmp_path, capsys, step)
    assert r.returncode == 0 and "scontrol requeue" not in calls
    for text in (r.stdout, r.stderr):
        assert "stop requested, but nothing was saved in" in text and "not requeueing job 77" in text
    assert (job_dir / "stop").is_file()  # what the ranks could poll


def test_usr1_ends_the_step_of_a_program_that_does_not_save_on_it_after_a_save(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HF Trainer (``--program hf-trainer``) ignores USR1: the script asks no rank to save;
    a checkpoint written since the run began -> the step is ended (SIGTERM to the launch
    step) and the job requeued (row stop-end-step); none -> the step runs on, the line,
    no requeue (row stop-run-on)."""
    ckpt = tmp_path / "ckpt/v1"
    (tmp_path / "train.py").write_text("print('hi')\n")
    program = ("--program", "hf-trainer", str(tmp_path / "train.py"), "--output_dir", str(ckpt))
    step = (f'sleep 0.2; mkdir -p {ckpt}/checkpoint-10; echo x > {ckpt}/checkpoint-10/t.json; '
            'kill -USR1 $$; sleep 20 >/dev/null 2>&1 </dev/null; return 0')
    r, calls, job_dir = _verdict(tmp_path, capsys, step, *program)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "scancel --signal=USR1" not in calls and "scontrol requeue 77" in calls, calls
    assert f"it saved {ckpt}/checkpoint-10/t.json since this run began: ending the step" in r.stdout
    assert "the step was ended at USR1" in r.stdout and "the steps since that save are lost" in r.stderr
    assert (job_dir / "stop_ended").read_text().strip() == f"{ckpt}/checkpoint-10/t.json"
    step = 'kill -USR1 $$; sleep 1.5; return 0'  # the old checkpoint is no save of this run
    r, calls, job_dir = _verdict(tmp_path, capsys, step, *program)
    assert r.returncode == 0 and "scontrol requeue" not in calls and "scancel" not in calls, calls
    for text in (r.stdout, r.stderr):
        assert f"saved nothing in {ckpt} since this run began: not requeueing job 77" in text
    assert "stop requested" not in r.stdout + r.stderr and not (job_dir / "stop_ended").exists()


# One node-local "node" (this machine): the node program's steps run for real (n1's);
# `timeout -k 5 30 srun ...` (at USR1) runs the stub too.
NODE_PROGRAM_SRUN = """
timeout() { shift 3; "$@"; }
srun() {
    case " $* " in
        *" slurm.replica "*) while [ "${1#--}" != "$1" ]; do shift; done; SLURMD_NODENAME=n1 "$@" ;;
        *" --kill-on-bad-exit=1 "*) launch_step ;;
        *) return 0 ;;
    esac
}
"""


def test_usr1_on_node_local_storage_counts_only_a_checkpoint_complete_on_every_node(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Node-local, at USR1 for a program that does not save on it: every node's dir is
    listed beside the ranks (srun --overlap, replica.py ``list`` then ``saved``), and only
    the newest checkpoint complete on every node written since the run began ends the
    step (row stop-end-step); a newer save cut short (HF's trainer_state.json, no
    DeepSpeed files) is no save: the step runs on (row stop-run-on)."""
    ckpt = tmp_path / "local/v1"
    (tmp_path / "train.py").write_text("print('hi')\n")
    flags = ("--storage", "node-local", "--program", "hf-trainer", str(tmp_path / "train.py"),
             "--output_dir", str(ckpt))
    tag = ckpt / "checkpoint-10"
    ds = f"{tag}/global_step10"
    save = (f"mkdir -p {ds}; echo x > {tag}/trainer_state.json; "
            f"echo x > {ds}/mp_rank_00_model_states.pt; for r in 0 1; do "
            f"echo x > {ds}/zero_pp_rank_${{r}}_mp_rank_00_optim_states.pt; done; "
            f"echo global_step10 > {tag}/latest")
    step = f"sleep 0.2; {save}; kill -USR1 $$; sleep 20 >/dev/null 2>&1 </dev/null; return 0"
    r, calls, job_dir = _verdict(tmp_path, capsys, step, *flags, stubs=NODE_PROGRAM_SRUN)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("it saved checkpoint checkpoint-10 (complete on every node) since this run began: "
            "ending the step to requeue job 77") in r.stdout, r.stdout + r.stderr
    assert "requeuehold 77" in calls and (job_dir / "stop_ended").read_text() == "checkpoint-10\n"
    # The next run resumes from checkpoint-10; its own save of checkpoint-20 is cut short.
    cut = (f"sleep 0.2; mkdir -p {ckpt}/checkpoint-20; echo x > {ckpt}/checkpoint-20/trainer_state.json; "
           "kill -USR1 $$; sleep 1.5; return 0")
    r, calls, job_dir = _verdict(tmp_path, capsys, cut, *flags, stubs=NODE_PROGRAM_SRUN,
                                 restarts=1)
    assert r.returncode == 0 and "requeue" not in calls, r.stdout + r.stderr
    for text in (r.stdout, r.stderr):
        assert (f"saved no checkpoint complete on every node ({ckpt}) since this run began: "
                "not requeueing job 77") in text
    assert not (job_dir / "stop_ended").exists()


def test_a_step_that_ends_while_the_usr1_trap_runs_keeps_its_own_status(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The trap cuts the script's `wait` short (128 + USR1 = 138); when the step saves and
    exits 0 while the trap still runs (a slow scancel, a loaded machine), its status is 0,
    not the 138 of the cut-short wait: the job is requeued (a whole-suite run on the Slurm
    bed once said 'the step failed (exit 138): not requeueing')."""
    ckpt = tmp_path / "ckpt/v1"
    # The signal comes once the script waits on the step (as Slurm's does, mid-run).
    step = (f'sleep 1; kill -USR1 $$; while [ ! -e "$CLUSTERKIT_STOP_FILE" ]; do sleep 0.05; '
            f'done; sleep 1.1; mkdir -p {ckpt}/step4; echo x > {ckpt}/step4/done; return 0')
    slow = 'scancel() { echo "scancel $*" >> "$CALLS"; sleep 3; }\n'
    r, calls, _ = _verdict(tmp_path, capsys, step, stubs=slow)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exit 138" not in r.stdout + r.stderr
    assert "scontrol requeue 77" in calls and "requeueing job 77" in r.stdout


def test_script_requeues_a_hung_step_as_max_restarts_allows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = 'echo "no progress on any rank for 31 s (--hang-timeout 30)" > "$hang_file"; return 143'
    flags = ("--hang-timeout", "30", "--max-restarts", "1")
    r, calls, job_dir = _verdict(tmp_path, capsys, step, *flags)
    assert r.returncode == 124, r.stderr
    assert "scontrol requeue 77" in calls and "restart 1 of --max-restarts 1" in r.stdout
    # the watchdog got its arguments: --hang-timeout 30 and launch's start-up allowance, 60 s
    assert ' "$hang_dir" 30 60 "$launch_pid" 2 <<' in (job_dir / "sbatch.sh").read_text()
    assert "usage: slurm.watch" not in r.stderr, r.stderr
    assert (job_dir / "hang_restarts").read_text().strip() == "1"
    r, calls, _ = _verdict(tmp_path, capsys, step, *flags, restarts=1)
    assert r.returncode == 124 and "scontrol requeue" not in calls
    assert "not requeueing (--max-restarts 1 used: 1)" in r.stderr
