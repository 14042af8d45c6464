"""clusterkit.slurm without a cluster: node_cpus (the --cpus-per-task default's base) and
following an output file that a requeued run appends to."""

from __future__ import annotations

import io
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from clusterkit.slurm.client import SlurmClient, SlurmError
from clusterkit.slurm.jobinfo import JobInfo, SlurmParseError, parse_sinfo_cpus
from clusterkit.slurm.watch import watch


@pytest.mark.parametrize(("text", "cpus"), [("4\n", 4), ("64+\n", 64), ("128\n64\n", 64),
                                            ("", None), ("  \n", None)])
def test_parse_sinfo_cpus(text: str, cpus: int | None) -> None:
    assert parse_sinfo_cpus(text) == cpus


def test_parse_sinfo_cpus_rejects_other_text() -> None:
    with pytest.raises(SlurmParseError):
        parse_sinfo_cpus("CPUS\n4\n")


def _client(stdout: str, rc: int = 0, stderr: str = "") -> tuple[SlurmClient, list[list[str]]]:
    calls: list[list[str]] = []

    def runner(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None,
               cwd: str | None) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        return subprocess.CompletedProcess(list(argv), rc, stdout, stderr)

    return SlurmClient(runner=runner, timeout_s=5), calls


def test_node_cpus_argv() -> None:
    client, calls = _client("48\n")
    assert client.node_cpus("gpu", ["n1", "n2"]) == 48
    assert calls == [["sinfo", "-h", "-o", "%c", "--partition=gpu", "--nodes=n1,n2"]]
    client, calls = _client("")
    assert client.node_cpus() is None and calls == [["sinfo", "-h", "-o", "%c"]]


def test_node_cpus_error_names_the_fix() -> None:
    client, _ = _client("", rc=1, stderr="sinfo: error: Unable to contact slurm controller\n")
    with pytest.raises(SlurmError) as err:
        client.node_cpus("gpu")
    assert "scontrol ping" in err.value.one_line()


class _Jobs:
    """`scontrol show job` answers in turn; between answers the job's output grows."""

    def __init__(self, out: Path, steps: list[tuple[str, int, str]]) -> None:
        self.out, self.steps = out, steps

    def show(self, job_id: str) -> JobInfo:
        state, restarts, more = self.steps.pop(0)
        with open(self.out, "a") as fh:
            fh.write(more)
        return JobInfo(job_id=job_id, name="ck-j", state=state, reason="None", exit_code=0,
                       exit_signal=0, nodes="node[1-2]", stdout=str(self.out),
                       stderr=str(self.out) + ".err", restarts=restarts)


def test_watch_follows_an_appended_output_across_a_requeue(tmp_path: Path) -> None:
    out = tmp_path / "slurm-9.out"
    run1 = "===== clusterkit: job j slurm=9 run 1 on node[1-2]\nstep 1/4\n"
    run2 = "===== clusterkit: job j slurm=9 run 2 on node[1-2]\nresumed\nstep 4/4\n"
    jobs = _Jobs(out, [("RUNNING", 0, run1), ("PENDING", 1, ""), ("RUNNING", 1, run2),
                       ("COMPLETED", 1, "")])
    sink, err = io.StringIO(), io.StringIO()
    info = watch(jobs, "9", sink, err, sleep=lambda s: None)  # type: ignore[arg-type]
    assert info.succeeded
    assert sink.getvalue() == run1 + run2  # each run once, in order, nothing lost
    assert "was requeued (restart 1)" in err.getvalue()
