"""clusterkit.slurm without a cluster: parsers, argv + timeouts + hints, the output follower."""

from __future__ import annotations

import io
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from clusterkit.cli.main import main
from clusterkit.slurm import JobInfo, SlurmClient, SlurmError, parse_job, parse_parsable
from clusterkit.slurm.jobinfo import SlurmParseError
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
    (FileNotFoundError("sbatch"), "login node"),
    (subprocess.TimeoutExpired("sbatch", 3), "scontrol ping"),
])
def test_errors_are_one_line_with_hint(answer: object, needle: str) -> None:
    client = SlurmClient(timeout_s=3, runner=FakeSlurm([answer]))
    with pytest.raises(SlurmError) as err:
        client.submit("/x/sbatch.sh")
    assert needle in err.value.one_line()
    assert "\n" not in err.value.one_line()


def _record(state: str, out: Path, restarts: int = 0) -> str:
    return (f"JobId=9 JobName=ck JobState={state} Reason=None Restarts={restarts} ExitCode=0:0 "
            f"NodeList=node1 StdErr={out} StdOut={out}\n")


def test_watch_follows_output_and_restart(tmp_path: Path) -> None:
    out_file = tmp_path / "slurm-9.out"
    steps = [("PENDING", None), ("RUNNING", "line 1\npart"), ("RUNNING", "line 1\npartial 2\n"),
             ("RUNNING", "again\n"), ("COMPLETED", "again\ndone")]
    answers: list[object] = []
    writes: list[str | None] = []
    for i, (state, text) in enumerate(steps):
        answers.append((_record(state, out_file, restarts=1 if i >= 3 else 0), "", 0))
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


def _inventory(tmp_path: Path, gpus: int) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(
        "schema_version: 1\ncluster: {name: unit}\n"
        f"defaults: {{transport: ssh, gpus: {gpus}, slots: 2, python: /usr/bin/python3, "
        f"workdir: {tmp_path}/work, checkpoint: {{shared_dir: {tmp_path}/ckpt, "
        f"local_dir: /scratch/ckpt}}}}\n"
        "hosts:\n  n1: {address: 10.0.0.1}\n  n2: {address: 10.0.0.2}\n")
    return path


def test_cli_dry_run_prints_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = _inventory(tmp_path, gpus=2)
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
    inv = _inventory(tmp_path, gpus=0)
    assert main(["sbatch", "-i", str(inv), "--job-id", "j2", "--storage", "node-local"]) == 0
    job_dir = tmp_path / "work/.clusterkit/jobs/j2"
    assert (job_dir / "sbatch.sh").is_file() and (job_dir / "ds_config.json").is_file()
    assert (job_dir / "logs").is_dir()  # Slurm opens --output before the script runs
    assert "sbatch " in capsys.readouterr().out


def test_cli_bad_partition_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = _inventory(tmp_path, gpus=0)
    rc = main(["sbatch", "-i", str(inv), "--partition", "a b", "--dry-run"])
    assert rc == 2
    assert "--partition" in capsys.readouterr().err


def test_cli_watch_needs_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sbatch", "-i", str(_inventory(tmp_path, 0)), "--watch"]) == 2
    assert "--watch needs --submit" in capsys.readouterr().err


def test_cli_status_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sbatch", "status"]) == 2
    assert "usage: clusterkit sbatch status JOBID" in capsys.readouterr().err
