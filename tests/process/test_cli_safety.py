"""CLI safety (issue 11, "What was seen"): each case a new user hit, with its new behaviour.

Bad input is one line naming the flag or inventory key the user wrote, exit 2, before
anything starts; DeepSpeed/torchrun spellings work where the meaning is the same.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from clusterkit.cli.main import build_parser, main
from clusterkit.launch.registry import JobRecord, NodeRecord, Registry
from clusterkit.remote.base import SSHTarget


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CLUSTERKIT_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    # A dry run checks the script as a launch would (issue 25): the one these cases name.
    (tmp_path / "train.py").write_text("print('train')\n")


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *want: str) -> str:
    """Exit 2 with exactly one `clusterkit: error:` line containing every ``want``."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clusterkit: error: "), err
    for w in want:
        assert w in lines[0], lines[0]
    return lines[0]


def _no_job_started(tmp_path: Path) -> None:
    assert not (tmp_path / "home" / "jobs").exists() or not Registry(tmp_path / "home").all()


# ------------------------------------------------------------------ flags after the script


def test_launch_flags_after_the_script_are_refused(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    # Issue 25: --lr is the script's (the workload group passes through); --dry-run is
    # launch control, so the run never starts.
    line = _fails(["launch", "--nodes", "2", "train.py", "--lr", "3e-4", "--dry-run"], capsys,
                  "train.py", "before train.py", "`train.py -- --dry-run")
    assert line.startswith("clusterkit: error: --dry-run: "), line
    line = _fails(["launch", "train.py", "--my-lr", "3e-4", "--dry-run"], capsys,
                  "--dry-run", "train.py -- --dry-run")
    assert "--my-lr" not in line  # not a clusterkit flag: the script's own
    _no_job_started(tmp_path)
    _fails(["launch", "train.py", "--nodes=5"], capsys, "--nodes")
    _fails(["launch", "train.py", "-i", "inv.yaml"], capsys, "-i: ")
    _fails(["launch", "-m", "mypkg.train", "data", "--dry-run"], capsys, "--dry-run", "mypkg.train")


def test_after_the_script_everything_else_is_the_scripts(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    """The issue's acceptance line: all six words reach train.py (no prefix matching)."""
    import json

    words = ["--deepspeed", "--deepspeed_config", "ds.json", "--steps", "5", "--save", "2"]
    assert main(["render", "--dry-run", "--nodes", "2", "train.py", *words]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out[out.index("\n", out.index("===== plan.json")):])
    assert plan["program"] == ["train.py", *words]
    assert main(["launch", "--dry-run", "--nodes", "2", "train.py", *words]) == 0
    assert "-u train.py " + " ".join(words) in capsys.readouterr().out
    # single-dash words of the script: -m is the script's after SCRIPT, -i is launch's
    assert main(["launch", "--dry-run", "train.py", "-m", "gpt", "-x", "1", "--steps=3"]) == 0
    assert "-u train.py -m gpt -x 1 --steps=3" in capsys.readouterr().out
    _no_job_started(tmp_path)


def test_after_a_double_dash_they_go_to_the_script(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    assert main(["launch", "--dry-run", "--nodes", "1", "--gpus-per-node", "1", "train.py",
                 "--", "--steps", "3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "-u train.py --steps 3 --dry-run" in out  # the separator itself is dropped
    assert main(["launch", "--dry-run", "--nodes", "1", "--gpus-per-node", "1", "--",
                 "train.py", "--steps", "3"]) == 0
    assert "-u train.py --steps 3" in capsys.readouterr().out
    _no_job_started(tmp_path)


# ------------------------------------------------------------------ former exit 70


def test_render_out_existing_file_and_unwritable_dir(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    (tmp_path / "exists.txt").write_text("x")
    _fails(["render", "--out", "exists.txt"], capsys, "--out", "exists.txt", "not a directory")
    _fails(["render", "--out", "/proc/nope"], capsys, "--out", "/proc/nope", "cannot write")
    assert (tmp_path / "exists.txt").read_text() == "x"


def test_plan_without_deepspeed_is_one_line(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    _fails(["plan", "--nodes", "2", "--gpus-per-node", "8", "--gpu-mem", "80G"], capsys, "deepspeed",
           "cannot be imported")


def test_collect_for_a_job_on_hosts_the_inventory_lacks(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    target = SSHTarget(name="gone1", address="10.9.9.9")
    record = JobRecord(job_id="old-job", backend="torchrun", created=0.0, launcher_pid=0,
                       nodes=[NodeRecord(node="gone1", python="/usr/bin/python3",
                                         job_dir="/w/.clusterkit/jobs/old-job", target=target)])
    Registry(tmp_path / "home").save(record)
    _fails(["collect-ckpt", "old-job"], capsys, "gone1", "old-job", "does not list")


# ------------------------------------------------------------------ values at parse time


@pytest.mark.parametrize(("argv", "flag"), [
    (["launch", "--grace", "-1", "--dry-run"], "--grace"),
    (["stop", "--grace", "-1", "somejob"], "--grace"),
    (["render", "--local-ranks-filter", "abc", "--dry-run"], "--local-ranks-filter"),
    (["doctor", "--master-port", "70000"], "--master-port"),
    (["sbatch", "--cpus-per-task", "0", "--dry-run"], "--cpus-per-task"),
    (["launch", "--steps", "0", "--dry-run"], "--steps"),
])
def test_bad_values_fail_before_anything_starts(argv: list[str], flag: str,
                                                capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    line = _fails(argv, capsys, flag)
    assert line.startswith(f"clusterkit: error: {flag}: ")
    _no_job_started(tmp_path)


def test_unknown_model_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    try:  # argparse's choices= (the shared job flags) or the safety check: exit 2 either way
        code = main(["launch", "--model", "llama-7b", "--dry-run"])
    except SystemExit as e:
        code = int(str(e.code))
    assert code == 2
    assert "--model" in capsys.readouterr().err
    _no_job_started(tmp_path)


# ------------------------------------------------------------------ inventory validate


@pytest.mark.parametrize(("body", "want"), [
    ("defaults:\n  env: {'A B': '1'}\nhosts:\n  n1: {address: 10.0.0.1}\n",
     ["defaults.env", "'A B'", ":3:"]),
    ("hosts:\n  n1: {address: 10.0.0.1}\n  n2: {address: 10.0.0.1}\n",
     ["n2", "same address", "n1", ":4:"]),
    ("defaults:\n  python: /opt/$ENV/bin/python\nhosts:\n  n1: {address: 10.0.0.1}\n",
     ["defaults.python", "'$'"]),
])
def test_inventory_validate_refuses(body: str, want: list[str], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "inv.yaml").write_text("schema_version: 1\n" + body)
    line = _fails(["inventory", "validate", "-i", "inv.yaml"], capsys, *want)
    assert "PATH" not in line  # the key the user wrote, not the variable built from it


def test_same_address_on_other_ssh_ports_is_fine(tmp_path: Path) -> None:
    (tmp_path / "inv.yaml").write_text(
        "schema_version: 1\nhosts:\n  n1: {address: 10.0.0.1, ssh: {port: 2201}}\n"
        "  n2: {address: 10.0.0.1, ssh: {port: 2202}}\n")
    assert main(["inventory", "validate", "-i", "inv.yaml"]) == 0


# ------------------------------------------------------------------ DeepSpeed habits


def test_deepspeed_spellings_are_aliases(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    assert main(["launch", "--dry-run", "--num_nodes", "2", "--num_gpus", "1"]) == 0
    assert "2 nodes, 2 ranks" in capsys.readouterr().out
    args = build_parser().parse_args(["doctor", "--master_port", "29511"])
    assert args.master_port == 29511
    (tmp_path / "hostfile").write_text("local1 slots=2\nlocal2 slots=2\n")
    # --skip-checks: local1/local2 are names of no machine; the plan is what is tested
    assert main(["launch", "--dry-run", "--skip-checks", "--hostfile", "hostfile", "--storage", "shared",
                 "--ckpt-dir", str(tmp_path / "ck"), "train.py"]) == 0
    out = capsys.readouterr().out
    assert "2 nodes, 4 ranks" in out and "local2: ranks 2-3" in out


def test_dash_i_with_a_node_spec_suggests_include(capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["launch", "-i", "node1@node2", "--dry-run"], capsys, "did you mean --include node1@node2")
    _fails(["launch", "-i", "node1:0,1", "--dry-run"], capsys, "did you mean --include")
    line = _fails(["launch", "-i", "missing.yaml", "--dry-run"], capsys, "not found")
    assert "did you mean" not in line


def test_help_does_not_show_the_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    out = capsys.readouterr().out
    assert "--num_nodes" not in out and "--nodes" in out


# ------------------------------------------------------------------ lazy verbs


def test_the_verb_index_names_what_each_module_builds() -> None:
    """main.VERBS (which module to import for a verb) matches what the modules register."""
    from importlib import import_module

    from clusterkit.cli.main import VERB_MODULES, VERBS

    built: dict[str, str] = {}
    for module in VERB_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        import_module(module).add_parser(sub)
        built.update(dict.fromkeys(sub.choices, module))
    assert built == VERBS


def _verbs(parser: argparse.ArgumentParser) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_only_the_verb_being_run_is_built() -> None:
    from clusterkit.cli.main import VERBS

    assert _verbs(build_parser(["-i", "x.yaml"])) == _verbs(build_parser()) == set(VERBS)
    assert _verbs(build_parser(["launch", "--nodes", "2"])) == {"launch"}
    assert _verbs(build_parser(["--help", "doctor"])) == set(VERBS)
    assert _verbs(build_parser(["doctr"])) == set(VERBS)  # argparse lists every verb
    assert _verbs(build_parser(["collect-ckpt"])) == {"collect-ckpt"}


def test_a_real_launch_hands_the_script_all_its_words(tmp_path: Path) -> None:
    """Issue 25's acceptance line, run for real on the embedded default's local nodes."""
    import os
    import subprocess

    (tmp_path / "argv.py").write_text(
        "import os, sys\nprint('ARGV', os.environ['RANK'], ' '.join(sys.argv[1:]))\n")
    words = ["--deepspeed", "--deepspeed_config", "ds.json", "--steps", "5", "--save", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "clusterkit", "launch", "--nodes", "2", "--gpus-per-node", "1",
         "--skip-checks", "argv.py", *words], cwd=tmp_path, capture_output=True, text=True,
        env=dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home")), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"ARGV {rank} {' '.join(words)}" in proc.stdout, proc.stdout


def test_a_job_registry_that_cannot_be_written_is_one_line_before_anything_starts(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CLUSTERKIT_HOME (or ~/.cache) the user cannot write, e.g. HOME still root's after
    su: one line naming the record and the fix, exit 2, not an internal error."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "file" / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--nodes", "1", "--gpus-per-node", "1", "--steps", "1",
                 "--job-id", "j"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"clusterkit: error: {tmp_path}/file/home/jobs/j/job.json: cannot write the "
                   f"job record (Not a directory) — make {tmp_path}/file/home/jobs writable for "
                   "you, or point the clusterkit home at a directory you can write "
                   "(docs/launch.md, the error table)")
