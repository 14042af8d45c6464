"""The Python API (clusterkit/api.py, docs/api.md): its example runs as written, its
refusals are the CLI's, and the CLI verbs go through it (one path, not two)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clusterkit import api
from clusterkit.cli.main import main
from clusterkit.errors import ClusterkitError, LaunchError, SelectionError
from clusterkit.spec.job import JobOptions
from tests.paths import REPO

DOC = (REPO / "docs" / "api.md").read_text()


def _example() -> str:
    """The one Python block of docs/api.md's "Example" section, as a user copies it."""
    section = DOC.split("## Example", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)\n```", section, flags=re.S)
    assert len(blocks) == 1, blocks
    return str(blocks[0])


@pytest.mark.slow
def test_the_docs_example_runs_the_embedded_default_end_to_end(tmp_path: Path) -> None:
    """launch, status, collect on the embedded default, from Python, as docs/api.md has it."""
    (tmp_path / "example.py").write_text(_example())
    env = {**os.environ, "CLUSTERKIT_HOME": str(tmp_path / "home")}
    env.pop("CLUSTERKIT_INVENTORY", None)
    run = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^finished: local-\S+ \d", run.stdout, flags=re.M), run.stdout[-2000:]
    assert "succeeded [('local1', 0), ('local2', 0)]" in run.stdout
    assert f"collected global_step2 into {tmp_path / 'collected'}" in run.stdout
    assert (tmp_path / "collected" / "global_step2" / "mp_rank_00_model_states.pt").is_file()
    # The job is in the registry the CLI reads: `clusterkit status` lists it.
    listed = subprocess.run([sys.executable, "-m", "clusterkit", "status"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "succeeded  exit 0" in listed.stdout, listed.stdout


def test_status_and_stop_of_no_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path))
    assert api.status() == []
    for call in (lambda: api.status("nojob"), lambda: api.stop("nojob")):
        with pytest.raises(LaunchError) as info:
            call()
        assert "nojob" in info.value.one_line()


def test_a_refusal_is_the_clis_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The same input refused from Python and from the shell: one exception, one line."""
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path))
    monkeypatch.delenv("CLUSTERKIT_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ClusterkitError) as info:
        api.launch(JobOptions(job_id="", include="nosuch"))
    assert isinstance(info.value, SelectionError) and info.value.key == "--include"
    with pytest.raises(LaunchError):  # what the parser refuses first in the shell
        api.launch(JobOptions(job_id="", max_restarts=-1))
    assert main(["launch", "--include", "nosuch"]) == 2
    assert capsys.readouterr().err.strip() == f"clusterkit: error: {info.value.one_line()}"


@pytest.mark.parametrize(("argv", "name"), [
    (["launch", "--steps", "2"], "launch"),
    (["status"], "status"),
    (["status", "j1"], "status"),
    (["stop", "j1", "--grace", "5"], "stop"),
    (["doctor", "--nodes", "1"], "doctor"),
])
def test_each_verb_calls_the_api(argv: list[str], name: str, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI verbs are parsing and printing around the API function of their name."""
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path))
    monkeypatch.setenv("CLUSTERKIT_DEBUG", "1")  # main lets the stand-in's exception through
    monkeypatch.delenv("CLUSTERKIT_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Called(Exception):
        pass

    def record(*args: Any, **kwargs: Any) -> None:
        calls.append((args, kwargs))
        raise Called

    monkeypatch.setattr(api, name, record)
    with pytest.raises(Called):
        main(argv)
    assert len(calls) == 1
    if name == "stop":
        assert calls[0] == (("j1",), {"grace_s": 5.0})
    if name == "launch":
        options = calls[0][0][0]
        assert isinstance(options, JobOptions) and options.steps == 2 and options.job_id == ""


NODES_INV = """\
schema_version: 1
cluster: {name: t}
hosts:
  node[1-3]:
    address: 10.0.0.[1-3]
    slots: 2
"""


@pytest.mark.parametrize(("argv", "name", "want"), [
    (["nodes", "install", "--wheel", "w.whl"], "install_nodes", {"wheel": "w.whl"}),
    (["nodes", "env", "--node-python", "/usr/bin/python3"], "copy_env",
     {"node_python": "/usr/bin/python3", "python": None}),
    (["nodes", "build-ops", "--op", "CPUAdamBuilder", "--remove-stale-locks"], "build_ops",
     {"ops": ["CPUAdamBuilder"], "remove_stale_locks": True, "ds_config": None}),
])
def test_node_preparation_verbs_call_the_api(argv: list[str], name: str, want: dict[str, Any],
                                             tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`clusterkit nodes install|env|build-ops` are printing around api.install_nodes,
    api.copy_env and api.build_ops: the inventory and the selection words reach them."""
    monkeypatch.setenv("CLUSTERKIT_DEBUG", "1")
    inv = tmp_path / "inv.yaml"
    inv.write_text(NODES_INV)
    calls: list[dict[str, Any]] = []

    class Called(Exception):
        pass

    def record(*args: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        raise Called

    monkeypatch.setattr(api, name, record)
    with pytest.raises(Called):
        main([*argv, "-i", str(inv), "--nodes", "2"])
    assert len(calls) == 1
    assert {k: calls[0][k] for k in want} == want
    assert calls[0]["nodes"] == 2 and calls[0]["exclude"] == ""
