"""Which tool reads a rank's Python stacks (issue 25 item 7, the py-spy part).

py-spy is looked up beside the job's Python (a venv's ``bin/``, also when the venv is
not on PATH), beside the agent's Python, then on PATH; where no tool gives a stack,
the dump says why and how to get py-spy, in one clean line plus one ``fix:`` line.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clusterkit.launch.stacks import read_stack, summarize
from clusterkit.node.agent import core as agent_mod
from clusterkit.node.agent import hangs
from clusterkit.node.protocol import EVENT_PREFIX, AgentSpec


def _binary(path: str | None) -> bool:
    if not path or not os.path.isfile(path):
        return False
    with open(path, "rb") as fh:
        return fh.read(4) == b"\x7fELF"


# The real binary (a pyenv shim is a shell script that needs pyenv's own PATH).
REAL_SPY = next((p for p in (os.path.join(os.path.dirname(sys.executable), "py-spy"),
                             shutil.which("py-spy")) if _binary(p)), None)

RANK = textwrap.dedent("""\
    import time
    def waiting_for_data():
        print("ready", flush=True)
        time.sleep(60)
    waiting_for_data()
""")


@pytest.fixture()
def venv(tmp_path: Path) -> Path:
    """A venv whose bin/ holds the job's python3 (a symlink, as venvs make)."""
    root = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    return root


@pytest.fixture()
def no_spy_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the agent's own Python dir nor PATH has py-spy."""
    bare = tmp_path / "agentpy" / "bin"
    bare.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(bare / "python3"))
    monkeypatch.setenv("PATH", str(bare))
    monkeypatch.setattr(hangs, "DUMP_WAIT_S", 0.3)
    monkeypatch.delenv("CLUSTERKIT_STACK_TOOL", raising=False)


def _agent(tmp_path: Path, python: str) -> agent_mod.Agent:
    spec = AgentSpec(job_id="spyjob", node="node1", job_dir=str(tmp_path / "job"),
                          argv=[python, "-u", "train.py"], rank_offsets={"node1": 0},
                          env={"PATH": os.environ["PATH"]})
    a = agent_mod.Agent(spec, io.StringIO())
    a.prepare()
    return a


def _dump(a: agent_mod.Agent, python: str) -> dict[str, dict[str, str]]:
    """Start one rank of the agent's job with ``python``; the agent's stacks event."""
    env = dict(os.environ, CLUSTERKIT_JOB_ID="spyjob", CLUSTERKIT_NODE="node1", RANK="0",
               LOCAL_RANK="0")
    proc = subprocess.Popen([python, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        a.dump_stacks()
    finally:
        proc.kill()
        proc.wait()
    out = a.output.out.getvalue()  # type: ignore[attr-defined]
    line = next(ln for ln in out.splitlines() if ln.startswith(EVENT_PREFIX) and '"stacks"' in ln)
    return dict(json.loads(line[len(EVENT_PREFIX):])["ranks"])


@pytest.mark.skipif(REAL_SPY is None, reason="py-spy is not installed")
def test_py_spy_in_the_venv_bin_dir_only_reads_the_rank(
        tmp_path: Path, venv: Path, no_spy_elsewhere: None) -> None:
    assert REAL_SPY is not None
    shutil.copy(REAL_SPY, venv / "bin" / "py-spy")
    python = str(venv / "bin" / "python3")
    a = _agent(tmp_path, python)
    assert a.job_pythons() == [python]  # as typed: the venv's path, not the resolved one
    assert hangs.py_spy(a.job_pythons()) == str(venv / "bin" / "py-spy")
    res = _dump(a, python)["0"]
    assert res["tool"] == "py-spy", res
    st = read_stack(0, "node1", res["text"])
    assert st.frames and st.frames[-1].func == "<module>", res["text"]
    assert any(f.func == "waiting_for_data" for f in st.frames), res["text"]


def test_a_bare_interpreter_name_is_found_on_the_ranks_path(
        tmp_path: Path, venv: Path, no_spy_elsewhere: None) -> None:
    (venv / "bin" / "py-spy").write_text("#!/bin/sh\nexit 1\n")
    (venv / "bin" / "py-spy").chmod(0o755)
    a = _agent(tmp_path, "python3")
    a.spec.env["PATH"] = str(venv / "bin")  # the ranks' PATH (the inventory's env)
    assert a.job_pythons() == [str(venv / "bin" / "python3")]
    assert hangs.py_spy(a.job_pythons()) == str(venv / "bin" / "py-spy")
    assert hangs.py_spy([], str(venv / "bin")) == str(venv / "bin" / "py-spy")
    assert hangs.py_spy([]) is None


def test_no_py_spy_and_no_handler_says_why_once_and_how_to_get_py_spy(
        tmp_path: Path, venv: Path, no_spy_elsewhere: None) -> None:
    python = str(venv / "bin" / "python3")
    a = _agent(tmp_path, python)
    res = _dump(a, python)["0"]
    assert res["tool"] == "none", res
    first, fix = res["text"].splitlines()
    assert first == (f"py-spy is not beside {python} nor on PATH, and no faulthandler dump "
                     "(the program registers none on SIGWINCH)")
    assert fix.startswith(f"fix: {python} -m pip install py-spy on every node")
    summary = summarize({r: read_stack(r, "node1", res["text"], tool="none") for r in (0, 1)}, 2)
    lines = summary.lines()
    assert lines == [f"  ranks 0-1 (node1): no Python stack: {first}", f"  {fix}"], lines
    assert "((" not in "\n".join(lines)


def test_py_spy_that_cannot_read_the_rank_is_named_with_its_error(
        tmp_path: Path, venv: Path, no_spy_elsewhere: None) -> None:
    spy = venv / "bin" / "py-spy"
    spy.write_text("#!/bin/sh\necho 'Error: Operation not permitted (os error 1)' >&2\nexit 1\n")
    spy.chmod(0o755)
    python = str(venv / "bin" / "python3")
    res = _dump(_agent(tmp_path, python), python)["0"]
    first, fix = res["text"].splitlines()
    assert first == (f"{spy} could not read the process (Error: Operation not permitted "
                     "(os error 1)), and no faulthandler dump (the program registers none "
                     "on SIGWINCH)"), first
    assert "ptrace" in fix
