"""SlurmClient.node_cpus (the --cpus-per-task default's base) without a cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence

import pytest

from clusterkit.slurm import SlurmClient, SlurmError
from clusterkit.slurm.jobinfo import SlurmParseError, parse_sinfo_cpus


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
