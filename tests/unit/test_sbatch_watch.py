"""`clusterkit sbatch --watch` folds like `clusterkit launch`, on real Slurm output.

The inputs are the logs/ of one real 2 x 2 job per batch-script variant, captured on
the Slurm test bed (tests/fixtures/sbatch_watch/SOURCES.md); the watch reads them as
it reads a finished job's files.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from clusterkit.fold import parse_ranks
from clusterkit.node.contract import SUMMARY_PREFIX
from clusterkit.slurm.client import SlurmClient
from clusterkit.slurm.ranklines import (
    SRUN_PIECE_BYTES,
    JobShape,
    LabelJoiner,
    RankLine,
    node_of_rank,
    parse_labelled,
    parse_shape,
    rank_of_file,
)
from clusterkit.slurm.watch import watch
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "sbatch_watch"
SLURM_IDS = {"torchrun": "1", "accelerate": "2", "deepspeed": "3"}
NODES = ["node1", "node2"]
SHAPE = JobShape("torchrun", 4, 2)
ACCEL = ("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. "
         "If you have GPU or other accelerator, we were unable to detect it.")
LR = "[WARNING] [lr_schedules.py:894:__init__] total_num_steps 3 is less than warmup_num_steps 10"


def _lines(variant: str, name: str) -> list[str]:
    return (FIXTURES / variant / name).read_text().splitlines()


def test_shape_line_of_the_batch_script() -> None:
    line = _lines("deepspeed", "slurm-3.out")[1]
    assert parse_shape(line) == JobShape("srun-per-rank", 4, 2)
    # a site template from before (no world_size): the variant alone
    old = "clusterkit: job j slurm=5 head=n1 (10.0.0.1:20005) variant=torchrun OMP_NUM_THREADS=2"
    assert parse_shape(old) == JobShape("torchrun")
    assert parse_shape("clusterkit: job j is not visible") is None


@pytest.mark.parametrize(("variant", "name"), [("torchrun", "slurm-1.out"), ("torchrun", "slurm-1.err"),
                                               ("accelerate", "slurm-2.out"),
                                               ("accelerate", "slurm-2.err")])
def test_every_captured_line_has_its_writer(variant: str, name: str) -> None:
    ranks = set()
    for line in _lines(variant, name):
        parsed = parse_labelled(line, NODES, SHAPE)
        if parsed.node is None:  # the batch script's own lines
            assert line.startswith(("=====", "clusterkit: ")), line
        elif parsed.rank is None:  # the node's launcher (torchrun, accelerate launch)
            assert not parsed.text.startswith("[rank"), line
        else:
            assert parsed.node == NODES[parsed.rank // 2], line  # ranks 0-1 on node1
            ranks.add(parsed.rank)
    assert ranks == {0, 1, 2, 3}


def test_labels_parsed() -> None:
    assert parse_labelled("1: [rank3]:text: a", NODES, None) == RankLine("node2", 3, "text: a")
    assert parse_labelled("0: [W1123 x] launcher", NODES, None) == RankLine("node1", None,
                                                                           "[W1123 x] launcher")
    assert parse_labelled(" 9: [rank19]:x", NODES, None) == RankLine("node#9", 19, "x")  # padded
    assert parse_labelled("step 3: done", NODES, SHAPE) == RankLine(None, None, "step 3: done")


def test_old_torch_local_rank_label() -> None:
    # torch < 2.2 ignores the prefix template: the capture's lines as it writes them.
    for line in _lines("torchrun", "slurm-1.out"):
        parsed = parse_labelled(line, NODES, SHAPE)
        if parsed.rank is None:
            continue
        old = line.replace(f"[rank{parsed.rank}]:", f"[default{parsed.rank % 2}]:")
        assert parse_labelled(old, NODES, SHAPE) == parsed
        # without the script's ranks_per_node the rank is unknown: a node line, not a guess
        assert parse_labelled(old, NODES, None).rank is None


def test_rank_files() -> None:
    assert rank_of_file("/j/logs/ck-cap-deepspeed-3-rank12.out") == 12
    assert rank_of_file("/j/logs/slurm-3.out") is None
    assert [node_of_rank(r, NODES, SHAPE) for r in range(4)] == ["node1", "node1", "node2", "node2"]


def _watch(variant: str, tmp_path: Path, ranks: str = "all") -> tuple[str, str]:
    """Watch the captured logs as a finished job's files: one poll, then the end."""
    logs = tmp_path / "logs"
    shutil.copytree(FIXTURES / variant, logs)
    sid = SLURM_IDS[variant]
    record = (f"JobId={sid} JobName=ck-cap-{variant} JobState=COMPLETED Reason=None Restarts=0 "
              f"ExitCode=0:0 NodeList=node[1-2] StdErr={logs}/slurm-{sid}.err "
              f"StdOut={logs}/slurm-{sid}.out\n")
    return _watch_record(record, sid, ranks)


def _watch_record(record: str, sid: str, ranks: str = "all") -> tuple[str, str]:
    """The watch's stdout and stderr for a job scontrol describes with ``record``."""
    def runner(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None,
               cwd: str | None) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(list(argv), 0, record, "")

    out, err = io.StringIO(), io.StringIO()
    watch(SlurmClient(runner=runner), sid, out, err, poll_s=0, ranks=parse_ranks(ranks),
          sleep=lambda _: None)
    return out.getvalue(), err.getvalue()


@pytest.mark.parametrize("variant", ["torchrun", "accelerate", "deepspeed"])
def test_watch_folds_each_variant(variant: str, tmp_path: Path) -> None:
    out, err = _watch(variant, tmp_path)
    lines = out.splitlines()
    # what all four ranks said: once, with the rank range
    assert lines.count(f"[r0-3] {LR}") == 1, out
    assert sum("total_num_steps" in ln for ln in lines) == 1
    # known noise: once per job (the launcher's own copy counts too: accelerate)
    assert sum("Setting accelerator to CPU" in ln for ln in lines) == 1, out
    assert f"[r0-3] {ACCEL}" in lines or variant == "accelerate"
    everything = out + err
    assert everything.count("The hostname of the client socket cannot be retrieved") == 1
    assert everything.count("FutureWarning") == 1
    # rank 0's own lines keep their node and rank; the summary is printed once, last
    assert any(ln.startswith("[node1 r0] [clusterkit] step 3/3") for ln in lines)
    assert sum(SUMMARY_PREFIX in ln for ln in lines) == 1 and lines[-1].startswith(SUMMARY_PREFIX)
    # the batch script's own lines as they were
    assert lines[0].startswith("===== clusterkit: job cap-") and "variant=" in lines[1]


def test_watch_ranks_selects_whose_lines(tmp_path: Path) -> None:
    out, err = _watch("torchrun", tmp_path, ranks="2-3")
    rank_lines = [ln for ln in (out + err).splitlines() if ln.startswith("[") and " r" in ln[:14]]
    assert rank_lines and all(ln.startswith("[node2 r2-3] ") for ln in rank_lines), rank_lines
    assert f"[node2 r2-3] {LR}" in out.splitlines()
    assert "[clusterkit] step" not in out  # rank 0's progress is not selected
    assert SUMMARY_PREFIX in out  # the job's summary still, once
    out, _ = _watch("deepspeed", tmp_path / "ds", ranks="0")
    assert "[node1 r0] [clusterkit] step 3/3" in out and "r0-3" not in out


def test_output_files_keep_every_line(tmp_path: Path) -> None:
    _watch("torchrun", tmp_path)
    for name in ("slurm-1.out", "slurm-1.err"):
        assert (tmp_path / "logs" / name).read_bytes() == (FIXTURES / "torchrun" / name).read_bytes()


def test_a_line_one_poll_late_still_joins_its_group(tmp_path: Path) -> None:
    out_file = tmp_path / "slurm-9.out"
    polls = ["0: [rank0]:same\n", "0: [rank0]:same\n1: [rank1]:same\n", None]
    record = (f"JobId=9 JobName=ck JobState={{}} Reason=None Restarts=0 ExitCode=0:0 "
              f"NodeList=node[1-2] StdErr={tmp_path}/none.err StdOut={out_file}\n")
    states = ["RUNNING", "RUNNING", "COMPLETED"]

    def runner(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None,
               cwd: str | None) -> subprocess.CompletedProcess[str]:
        text = polls.pop(0)
        if text is not None:
            out_file.write_text(text)
        return subprocess.CompletedProcess(list(argv), 0, record.format(states.pop(0)), "")

    clock = iter([0.0, 1.0, 2.5])  # each poll 1 s apart (poll_s), the end later
    out = io.StringIO()
    watch(SlurmClient(runner=runner), "9", out, io.StringIO(), poll_s=1.0, sleep=lambda _: None,
          clock=lambda: next(clock))
    assert out.getvalue() == "[r0-1] same\n"


@pytest.mark.parametrize("argv", [["status", "5", "--watch", "--ranks", "0-1"],
                                  ["--ranks", "0-1", "--watch", "status", "5"]])
def test_cli_passes_ranks_to_the_watch(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from clusterkit.cli import cmd_sbatch
    from clusterkit.cli.main import main

    seen: dict[str, object] = {}

    def fake_watch(client: object, job_id: str, out: object, err: object, **kw: object) -> object:
        seen.update(kw, job_id=job_id)
        return type("Info", (), {"succeeded": True})()

    monkeypatch.setattr(cmd_sbatch, "watch", fake_watch)
    assert main(["sbatch", *argv]) == 0
    assert seen["job_id"] == "5" and seen["ranks"] == frozenset({0, 1})


def test_srun_label_pieces_of_a_long_line_are_joined() -> None:
    # srun --label cut a 3000-byte line into 1024 + 1024 + 952 (seen on the Slurm bed),
    # each piece labelled; another task's line may come in between.
    text = "X" * 3000
    cuts = [text[:SRUN_PIECE_BYTES], text[SRUN_PIECE_BYTES:2 * SRUN_PIECE_BYTES],
            text[2 * SRUN_PIECE_BYTES:]]
    j = LabelJoiner()
    assert j.feed(f" 0: {cuts[0]}\n") == []
    assert j.feed("1: other\n") == ["1: other\n"]
    assert j.feed(f" 0: {cuts[1]}\n") == []
    assert j.feed(f" 0: {cuts[2]}\n") == [f" 0: {text}\n"]
    assert j.feed("plain script line\n") == ["plain script line\n"]
    assert j.feed(f"0: {cuts[0]}\n") == [] and j.flush() == [f"0: {cuts[0]}\n"]


def test_torchrun_tee_repeated_header_is_dropped() -> None:
    # torch's tail_logfile printed a half-written line in two parts, the header twice.
    parsed = parse_labelled('0: [rank0]:CLUSTERKIT_SUMMARY {"a": 1, [rank0]:"b": 2}', NODES, SHAPE)
    assert parsed == RankLine("node1", 0, 'CLUSTERKIT_SUMMARY {"a": 1, "b": 2}')


def _watch_file(out_file: Path, start: str = "Unknown") -> str:
    record = (f"JobId=9 JobName=ck JobState=COMPLETED Reason=None Restarts=0 ExitCode=0:0 "
              f"StartTime={start} NodeList=node[1-2] StdErr={out_file.parent}/none.err "
              f"StdOut={out_file}\n")
    return _watch_record(record, "9")[0]


def test_watch_prints_a_long_summary_whole(tmp_path: Path) -> None:
    out_file = tmp_path / "slurm-9.out"
    summary = SUMMARY_PREFIX + '{"k": "' + "v" * 1500 + '"}'
    line = "0: [rank0]:" + summary
    pieces = [line[i + 3:i + 3 + SRUN_PIECE_BYTES] for i in range(0, len(line) - 3,
                                                                   SRUN_PIECE_BYTES)]
    out_file.write_text("".join(f"0: {p}\n" for p in pieces) + "1: [rank1]:done\n")
    assert _watch_file(out_file).splitlines()[-1] == summary


def test_a_summary_cut_short_of_1024_bytes_is_rejoined(tmp_path: Path) -> None:
    # The final suite run's raw file: srun cut rank 0's summary after 714 bytes (its own
    # message boundary, not 1024), the rest on the task's next line without [rank0]:.
    summary = SUMMARY_PREFIX + '{"losses": [' + ", ".join(["1.25"] * 200) + '], "z": 1}'
    out_file = tmp_path / "slurm-9.out"
    out_file.write_text(f"0: [rank0]:{summary[:714]}\n1: [rank2]:other\n"
                        f"0: {summary[714:]}\n1: [rank3]:done\n")
    lines = _watch_file(out_file).splitlines()
    assert lines[-1] == summary
    assert not any(summary[714:740] in ln for ln in lines[:-1])  # the rest is not a line of its own


def test_the_saved_summary_file_beats_the_line(tmp_path: Path) -> None:
    # <job dir>/logs/slurm-9.out and <job dir>/run/summary.json, as clusterkit's script has them
    logs, run = tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    run.mkdir()
    (logs / "slurm-9.out").write_text(f'0: [rank0]:{SUMMARY_PREFIX}{{"steps": 3, "cut\n')
    (run / "summary.json").write_text('{\n "steps": 3,\n "finished": true\n}\n')
    want = SUMMARY_PREFIX + '{"finished": true, "steps": 3}'
    assert _watch_file(logs / "slurm-9.out").splitlines()[-1] == want
    # Left by an earlier job in the same job dir (written before this job started): not used.
    os.utime(run / "summary.json", (1_000_000_000, 1_000_000_000))
    last = _watch_file(logs / "slurm-9.out", start="2026-01-01T00:00:00").splitlines()[-1]
    assert last == f'{SUMMARY_PREFIX}{{"steps": 3, "cut'


def test_the_run_header_is_shown_once(tmp_path: Path) -> None:
    """The batch script writes each run's header to the .out and the .err file."""
    header = "===== clusterkit: job j slurm=9 run 1 on node1 at 2026-11-25T10:00:00Z =====\n"
    out_file, err_file = tmp_path / "slurm-9.out", tmp_path / "slurm-9.err"
    out_file.write_text(header + "hello\n")
    err_file.write_text(header)
    record = (f"JobId=9 JobName=ck JobState=COMPLETED Reason=None Restarts=0 ExitCode=0:0 "
              f"NodeList=node1 StdErr={err_file} StdOut={out_file}\n")
    out, err = io.StringIO(), io.StringIO()

    def runner(argv: object, timeout: float, env: object, cwd: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess([], 0, record, "")

    watch(SlurmClient(runner=runner), "9", out, err, poll_s=0, sleep=lambda _: None)
    assert (out.getvalue() + err.getvalue()).count("===== clusterkit: job j") == 1


def test_a_rank_0_only_line_is_not_held_a_window_after_the_first(tmp_path: Path) -> None:
    """Rank 0's progress lines: the first waits the fold window (no other rank says it),
    the next ones of the same shape leave in the poll that read them."""
    out_file = tmp_path / "slurm-9.out"
    shape = "clusterkit: job j slurm=9 head=n1 (10.0.0.1:20009) variant=torchrun world_size=4 " \
            "ranks_per_node=2 OMP_NUM_THREADS=1\n"
    text = shape
    polls = ["0: [rank0]:step 1 loss 0.91\n", "", "", "", "", "", "", "",
             "0: [rank0]:step 2 loss 0.85\n", "0: [rank0]:step 3 loss 0.80\n", None]
    record = (f"JobId=9 JobName=ck JobState={{}} Reason=None Restarts=0 ExitCode=0:0 "
              f"NodeList=node[1-2] StdErr={tmp_path}/none.err StdOut={out_file}\n")
    seen: list[str] = []
    out = io.StringIO()

    def runner(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None,
               cwd: str | None) -> subprocess.CompletedProcess[str]:
        nonlocal text
        seen.append(out.getvalue())
        piece = polls.pop(0)
        text += piece or ""
        out_file.write_text(text)
        return subprocess.CompletedProcess(list(argv), 0, record.format(
            "COMPLETED" if piece is None else "RUNNING"), "")

    clock = iter(float(t) for t in range(20))
    watch(SlurmClient(runner=runner), "9", out, io.StringIO(), poll_s=1.0, sleep=lambda _: None,
          clock=lambda: next(clock))
    step1 = next(i for i, o in enumerate(seen) if "step 1 " in o)
    assert step1 >= 6  # the first one waited its window (5 s + one poll)
    # the second and third: printed by the poll that read them
    assert "step 2 " not in seen[8] and "[node1 r0] step 2 loss 0.85" in seen[9]
    assert "[node1 r0] step 3 loss 0.80" in seen[10]
