"""Every mistake on the command line is one line and exit 2 (issue 25).

A table of bad inputs across the verbs: each must end with exit code 2 and exactly one
stderr line starting ``clusterkit: error:`` (no traceback, no usage text), holding the
words that say what was wrong. Run in-process through ``main(argv)`` (fast); a handful
again as a real ``python -m clusterkit`` process. Nothing here reaches a node: every
row fails before anything connects.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit.cli.main import main
from tests.paths import REPO

# A two-node, one-slot-each local inventory: a job of 2 ranks.
INVENTORY = ("schema_version: 1\ncluster: {name: t}\ndefaults: {transport: local, slots: 1}\n"
             "hosts:\n  l[1-2]:\n    address: 127.0.0.[1-2]\n")
L, R, S = ["launch", "--dry-run"], ["render", "--dry-run"], ["sbatch", "--dry-run"]


def _rows_job_verbs() -> list[tuple[list[str], str]]:
    """The shared job flags and the program words: the same answer from all three verbs."""
    rows: list[tuple[list[str], str]] = []
    for verb in (L, R, S):
        rows += [
            ([*verb, "--nodes", "x"], "--nodes: expected a whole number, got 'x'"),
            ([*verb, "--nodes", "0"], "--nodes: must be a number >= 1"),
            ([*verb, "--nodes", "1.5"], "--nodes: expected a whole number"),
            ([*verb, "--gpus-per-node", "0"], "--gpus-per-node"),
            ([*verb, "--steps", "0"], "--steps"),
            ([*verb, "--steps", "nan"], "--steps: expected a whole number"),
            ([*verb, "--micro-batch", "0"], "--micro-batch"),
            ([*verb, "--lr", "nan"], "--lr: must be a number > 0"),
            ([*verb, "--lr", "inf"], "--lr"),
            ([*verb, "--lr", "-1"], "--lr"),
            ([*verb, "--clip", "nan"], "--clip"),
            ([*verb, "--zero-stage", "5"], "--zero-stage: invalid choice 5"),
            ([*verb, "--launcher", "pdsh"], "--launcher: invalid choice 'pdsh'"),
            ([*verb, "--model", "huge"], "--model"),
            ([*verb, "--precision", "fp8"], "--precision"),
            ([*verb, "--hang-timeout", "nan"], "--hang-timeout: 'nan' is not a duration"),
            ([*verb, "--hang-timeout", "-5"], "--hang-timeout"),
            ([*verb, "--hang-timeout", "inf"], "--hang-timeout"),
            ([*verb, "--job-id", ""], "--job-id: '' is not a job id"),
            ([*verb, "--job-id", "a b"], "letters, digits"),
            ([*verb, "--job-id", "../up"], "--job-id"),
            ([*verb, "--job-id", "a;rm -rf /"], "--job-id"),
            ([*verb, "--job-id", "x" * 65], "--job-id"),
            ([*verb, "--master-addr", "1.2.3.4;rm -rf /"], "is not a host name or IP address"),
            ([*verb, "--master-addr", ""], "--master-addr"),
            ([*verb, "--stesp", "5"], "unknown flag --stesp — did you mean --steps?"),
            ([*verb, "--zero", "2"], "unknown flag --zero — did you mean --zero-stage?"),
            ([*verb, "--steps"], "--steps: needs a value"),
            ([*verb, "--local-ranks-filter", "a,b"], "--local-ranks-filter"),
            ([*verb, "--env", ""], "--env"),
            ([*verb, "--nvme-path", ""], "--nvme-path: needs a value, got an empty string"),
            ([*verb, "--ckpt-dir", " "], "--ckpt-dir: needs a value"),
            ([*verb, "train.py", "--nodes", "2"], "--nodes: a clusterkit launch flag after"),
            ([*verb, "train.py", "--dry-run"], "after `--` to hand it to your script"),
            ([*verb, "train.py", "-i", "x.yaml"], "-i: a clusterkit launch flag"),
            ([*verb, "train.py", "--launcher=torchrun"], "--launcher"),
            ([*verb, "train.py", "--job-id", "j"], "--job-id"),
            ([*verb, "-m", "pkg.train", "--include", "l1"], "--include"),
        ]
    return rows


ROWS: list[tuple[list[str], str]] = [
    # an empty path or name (`-i "$UNSET"`) is not "not given"
    (["inventory", "validate", "-i", ""], "--inventory: needs a value, got an empty string"),
    ([*L, "-i", ""], "--inventory: needs a value"),
    ([*L, "--hostfile", ""], "--hostfile: needs a value"),
    ([*L, "--sync", ""], "--sync: needs a value"),
    (["render", "--out", ""], "--out: needs a value"),
    (["doctor", "--fix-env", ""], "--fix-env: needs a value"),
    (["nodes", "install", "--wheel", ""], "--wheel: needs a value"),
    (["collect-ckpt", "--to", ""], "--to: needs a value"),
    (["collect-ckpt", "--dir", ""], "--dir: needs a value"),
    (["sync", ".", "--exclude-from", ""], "--exclude-from: needs a value"),
    (["inventory", "export-hostfile", "-o", ""], "--out: needs a value"),
    ([*S, "--template-dir", ""], "--template-dir: needs a value"),
    # verbs and the top level
    (["lanch"], "unknown verb 'lanch' — did you mean `clusterkit launch`?"),
    (["--bogus"], "unknown flag --bogus"),
    (["inventory", "--jsn", "show"], "unknown flag --jsn"),
    (["--bogus", "launch"], "unknown flag --bogus"),
    ([], "missing VERB"),
    (["inventory"], "missing VERB"),
    (["inventory", "validat"], "did you mean `clusterkit inventory validate`?"),
    (["nodes", "instal"], "did you mean `clusterkit nodes install`?"),
    *_rows_job_verbs(),
    # launch
    ([*L, "--grace", "nan"], "--grace: 'nan' is not a duration"),
    ([*L, "--grace", "-1"], "--grace"),
    ([*L, "--grace", ""], "--grace"),
    ([*L, "--keepalive-timeout", "nan"], "--keepalive-timeout"),
    ([*L, "--keepalive-timeout", "inf"], "--keepalive-timeout"),
    ([*L, "--keepalive-timeout", "-1"], "--keepalive-timeout"),
    ([*L, "--time", "25:99:99", "train.py"], "--time: only for clusterkit sbatch"),
    ([*L, "--partition", "a b"], "--partition: only for clusterkit sbatch"),
    ([*L, "--cpus-per-task", "4"], "only for clusterkit sbatch"),
    ([*L, "--submit"], "unknown flag --submit — --submit is a flag of `clusterkit sbatch`"),
    ([*L, "--zero_stage", "2"], "did you mean --zero-stage?"),
    (["render", "--grace", "3"], "--grace is a flag of `clusterkit launch` and `clusterkit stop`"),
    ([*L, "--ranks", "5-2"], "--ranks: bad rank range"),
    ([*L, "--ranks", "x"], "--ranks"),
    ([*L, "-i", "inv.yaml", "--storage", "shared", "--ckpt-dir", "/tmp/ck", "--ranks", "9"],
     "--ranks: rank 9 is not in this job: it has ranks 0-1"),
    ([*L, "train.py", "--grace", "5"], "--grace"),
    ([*L, "train.py", "--sync=."], "--sync"),
    ([*L, "--sync"], "--sync: needs a value"),
    ([*L, "--set-env", "NOEQUALS"], "--set-env"),
    ([*L, "--drop-failed-nodes"], "--drop-failed-nodes: does nothing without --max-restarts K"),
    # render
    (["render", "--out", "afile"], "--out: is a file, not a directory"),
    (["render", "--out", "/proc/x"], "--out: cannot write there"),
    (["render", "--out", "/nonexistent/dir/x"], "directory /nonexistent/dir does not exist"),
    (["render", "--out", "x", "--dry-run"], "--dry-run: cannot be combined with --out"),
    (["render"], "--out: say where to write the files"),
    (["render", "--out", "outdir"], "outdir/hostfile: cannot write hostfile: Is a directory"),
    # sbatch (refused while parsing: Slurm is never asked)
    (["sbatch", "--dry-run", "--submit"], "cannot be combined with --dry-run"),
    (["sbatch", "--write-only", "--dry-run"], "cannot be combined"),
    ([*S, "--poll", "0"], "--poll: must be more than 0 seconds"),
    ([*S, "--poll", "nan"], "--poll"),
    ([*S, "--poll", "-1"], "--poll"),
    ([*S, "--slurm-timeout", "0"], "--slurm-timeout"),
    ([*S, "--slurm-timeout", "nan"], "--slurm-timeout"),
    ([*S, "--signal-lead", "nan"], "--signal-lead"),
    ([*S, "--signal-lead", "-3"], "--signal-lead"),
    ([*S, "--signal-lead", "0"], "--signal-lead: must be more than 0"),
    ([*S, "--signal-lead", "1.5"], "--signal-lead: must be whole seconds"),
    ([*S, "--ranks", "x"], "--ranks"),
    ([*S, "--signal", "USR1"], "--signal: only for `clusterkit sbatch cancel JOBID`"),
    ([*S, "--full"], "--full: only for `clusterkit sbatch cancel JOBID`"),
    # status / stop
    (["stop", "somejob", "--grace", "nan"], "--grace"),
    (["stop", "a b"], "JOB: 'a b' is not a job id"),
    (["stop"], "missing JOB"),
    (["status", "../x"], "JOB"),
    (["status", "--jsno"], "did you mean --json?"),
    # doctor
    (["doctor", "--connect-timeout", "nan"], "--connect-timeout: 'nan' is not a duration"),
    (["doctor", "--connect-timeout", "0"], "--connect-timeout: must be more than 0"),
    (["doctor", "--connect-timeout", "-1"], "--connect-timeout"),
    (["doctor", "--connect-timeout", "inf"], "--connect-timeout"),
    (["doctor", "--connect-timeout", "x"], "--connect-timeout"),
    (["doctor", "--master-port", "70000"], "--master-port"),
    (["doctor", "--master-port", "x"], "--master-port"),
    (["doctor", "--ckpt-size", "abc"], "--ckpt-size"),
    (["doctor", "--bandwidth-size", "0"], "--bandwidth-size"),
    (["doctor", "--bandwidth-size", "8M"], "--bandwidth-size: only goes with --bandwidth"),
    (["doctor", "--fix-env", "adir"], "--fix-env: is a directory, not a file"),
    (["doctor", "--fix-env", "/nonexistent/dir/env"], "does not exist"),
    (["doctor", "--launcher", "pdsh"], "--launcher: invalid choice"),
    (["doctor", "--job-id", "a b"], "--job-id"),
    (["doctor", "--strcit"], "did you mean --strict?"),
    # plan
    (["plan", "--gpu-mem", "abc"], "--gpu-mem"),
    (["plan", "--gpu-mem", "80G", "--gpu-fraction", "2"], "--gpu-fraction"),
    (["plan", "--gpu-mem", "80G", "--gpu-fraction", "nan"], "--gpu-fraction"),
    (["plan", "--gpu-mem", "80G", "--gpu-fraction", "0"], "--gpu-fraction"),
    (["plan"], "missing --gpu-mem"),
    (["plan", "--gpu-mem", "80G", "--model", "huge"], "--model"),
    # sync
    (["sync", ".", "--exclude-from", "/missing"], "/missing: --exclude-from: no such file"),
    (["sync", ".", "--exclude-from", "adir"], "--exclude-from: is a directory"),
    (["sync", "frob"], "frob is not a directory"),
    (["sync", "--delet"], "did you mean --delete?"),
    # nodes install
    (["nodes", "install", "--wheel", "/missing.whl"], "--wheel: does not exist"),
    (["nodes", "install", "--wheel", "afile"], "--wheel: is not a wheel"),
    (["nodes", "install", "--wheel", "adir"], "--wheel: is a directory"),
    # inventory: output files like cp
    (["inventory", "import-hostfile", "hostfile", "-o", "adir"], "-o: is a directory, not a file"),
    (["inventory", "import-hostfile", "hostfile", "-o", "/nonexistent/dir/x.yaml"],
     "directory /nonexistent/dir does not exist"),
    (["inventory", "export-hostfile", "-o", "adir"], "-o: is a directory"),
    (["inventory", "export-hostfile", "-o", "/nonexistent/dir/hf"], "does not exist"),
    (["inventory", "show", "--bogus"], "unknown flag --bogus"),
    # collect-ckpt: the destination and the flags
    (["collect-ckpt", "--dir", "adir", "--to", "afile"], "--to: is a file, not a directory"),
    (["collect-ckpt", "--dir", "adir", "--to", "/proc/dest"], "--to: cannot write there"),
    (["collect-ckpt", "--dir", "adir", "--to", "/nonexistent/dir/x"], "does not exist"),
    (["collect-ckpt", "--jobs", "x"], "--jobs"),
    (["collect-ckpt", "--jobs", "0"], "--jobs"),
    (["collect-ckpt", "--world-size", "0"], "--world-size"),
    (["collect-ckpt", "--via", "ftp"], "--via: invalid choice 'ftp'"),
    (["collect-ckpt", "--consolidate", "pickle"], "--consolidate"),
    (["collect-ckpt", "--max-shard-size", "big"], "--max-shard-size"),
]


@pytest.fixture
def refusal_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CLUSTERKIT_INVENTORY", raising=False)
    monkeypatch.delenv("CLUSTERKIT_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "afile").write_text("not an inventory\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "outdir" / "hostfile").mkdir(parents=True)  # in the way of render's file
    (tmp_path / "inv.yaml").write_text(INVENTORY)
    (tmp_path / "hostfile").write_text("node1 slots=2\nnode2 slots=2\n")
    return tmp_path


def _one_line(code: int, err: str) -> str:
    assert "Traceback" not in err and "usage:" not in err, err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("clusterkit: error: "), err
    return lines[0]


def test_the_table_is_big_enough() -> None:
    assert len(ROWS) >= 100
    assert len({tuple(a) for a, _ in ROWS}) == len(ROWS)  # no row twice


@pytest.mark.parametrize(("argv", "want"), ROWS, ids=[" ".join(a) or "(none)" for a, _ in ROWS])
def test_refused_in_one_line(argv: list[str], want: str, refusal_scratch: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(main(argv), capsys.readouterr().err)
    assert want in line, line
    assert not Path("/nonexistent").exists()  # no parent directory made on the way
    if argv[:1] in (["launch"], ["stop"]):
        assert not (refusal_scratch / "home" / "jobs").exists()  # nothing started


SUBPROCESS_ROWS = [
    ["lanch"],
    ["launch", "--dry-run", "--keepalive-timeout", "nan"],
    ["doctor", "--connect-timeout", "nan"],
    ["collect-ckpt", "--dir", "adir", "--to", "afile"],
    ["nodes", "install", "--wheel", "afile"],
    ["inventory", "import-hostfile", "hostfile", "-o", "adir"],
]


@pytest.mark.parametrize("argv", SUBPROCESS_ROWS, ids=" ".join)
def test_refused_in_one_line_as_a_process(argv: list[str], refusal_scratch: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "clusterkit", *argv], cwd=refusal_scratch, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    _one_line(proc.returncode, proc.stderr)
    assert proc.stdout == ""


# ------------------------------------------------------------------ --json


@pytest.mark.parametrize("argv", [
    ["doctor", "--json", "--connect-timeout", "x"],  # a parse error
    ["status", "--json", "a b"],  # a bad JOB
    ["inventory", "show", "--json", "-i", "missing.yaml"],  # an error of the verb itself
    ["plan", "--json", "--gpu-mem", "80G", "--gpu-fraction", "nan"],
])
def test_json_verbs_answer_errors_in_json(argv: list[str], refusal_scratch: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = main(argv)
    out, err = capsys.readouterr()
    line = _one_line(code, err)
    answer = json.loads(out)
    assert answer["exit_code"] == 2 and answer["error"] in line
    assert set(answer) == {"error", "key", "hint", "exit_code"}


def test_no_json_on_a_verb_without_it(refusal_scratch: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", "--steps", "0"]) == 2
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ what is accepted


@pytest.mark.parametrize("argv", [
    [*L, "--grace", "1m", "--keepalive-timeout", "90s", "--hang-timeout", "1h30m", "train.py"],
    [*L, "--keepalive-timeout", "01:30:00", "--hang-timeout", "0"],
    [*L, "train.py", "--steps", "5", "--lr", "3e-4", "--save", "2", "-m", "x", "--deepspeed"],
    [*L, "train.py", "--", "--nodes", "2"],
    [*L, "--", "--steps", "5"],
    [*R, "--partition", "gpu", "--time", "1:00:00", "train.py", "--steps", "5"],
    [*R, "--master-addr", "::1", "--job-id", "Run_3.b-x"],
    ["doctor", "--help"],
])
def test_good_inputs_still_work(argv: list[str], refusal_scratch: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # --help
        code = int(exc.code or 0)
    assert code == 0, capsys.readouterr().err


def test_render_passes_slurm_flags_after_the_script_to_it(refusal_scratch: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # render and sbatch take --time themselves: after SCRIPT it is theirs to refuse
    line = _one_line(main([*R, "train.py", "--time", "5"]), capsys.readouterr().err)
    assert "--time: a clusterkit launch flag after the program train.py" in line


# ------------------------------------------------------------------ no prefix matching


def _parsers(parser: object) -> list[object]:
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    out: list[object] = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                out += _parsers(sub)
    return out


def test_every_clusterkit_parser_matches_exact_flags_only() -> None:
    from clusterkit.cli.argparser import Parser
    from clusterkit.cli.main import build_parser

    parsers = _parsers(build_parser())
    assert len(parsers) > 12  # every verb and every nested action
    for p in parsers:
        assert isinstance(p, Parser) and p.allow_abbrev is False, p


def test_every_other_argument_parser_in_the_repo_has_allow_abbrev_off() -> None:
    """Node programs, the bundled workload, bench scripts and the example script build
    their parsers with argparse directly: each call must say allow_abbrev=False."""
    missing = []
    for base in ("clusterkit", "bench", "docs/examples"):
        for path in sorted((REPO / base).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                    continue
                if node.func.attr == "ArgumentParser" or (
                        node.func.attr == "add_parser" and "clusterkit/cli" not in str(path)):
                    kw = {k.arg: k.value for k in node.keywords}
                    value = kw.get("allow_abbrev")
                    if not (isinstance(value, ast.Constant) and value.value is False):
                        missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, missing


def test_sbatch_refuses_an_explicit_native_launcher(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 24: `sbatch --launcher native` silently rendered torchrun. Typed, it is refused
    (native's agents start the ranks; Slurm's srun does here); left out, the shared default
    still means the torchrun variant."""
    from clusterkit.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    assert main(["sbatch", "--dry-run", "--launcher", "native", "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["clusterkit: error: --launcher: native is clusterkit launch's own (its agents "
                   "start the ranks); a Slurm batch script starts them with srun — leave "
                   "--launcher out (torchrun under srun), or pick torchrun, accelerate or "
                   "deepspeed"], err
    assert main(["sbatch", "--dry-run", "train.py"]) == 0
