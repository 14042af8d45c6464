"""The batch job's end as a table (clusterkit.node.slurm.end.decide) row by row, as
docs/sbatch.md has it ("How the batch job decides"); the program gathering its facts
from a job dir's files; and the template left with the sequencing only (issue 36 item 2).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit import ship
from clusterkit.node.slurm import end
from clusterkit.node.slurm.end import (
    ANY,
    BOTH,
    ERR,
    NONE,
    OUT,
    PINNED,
    EndDecision,
    EndFacts,
    ExitRecord,
    JobEnd,
    Line,
    StopAnswer,
    at_usr1,
    decide,
)
from tests.paths import REPO

PYTHONS = [p for p in ("/root/.pyenv/versions/3.8.18/bin/python3.8", sys.executable)
           if os.path.exists(p)]
JOB = JobEnd(max_restarts=2, signal_lead=90, log_dir="/w/logs", job_name="ck-j",
             stop_var="CLUSTERKIT_STOP_FILE")
PINNED_JOB = dataclasses.replace(JOB, node_local=True)
REPLICA_JOB = dataclasses.replace(PINNED_JOB, replicas=1)
PER_RANK_JOB = dataclasses.replace(JOB, per_rank_files=True)
BASE = EndFacts(job=JOB, slurm_id="77", status=0, hang_dir="/w/hangs/77.1", ckpt_dir="/c/j",
                now=1000)
HANG = dataclasses.replace(BASE, status=143, hang="no progress on any rank for 31 s")
FAILED = dataclasses.replace(BASE, status=143,
                             first_exit=ExitRecord(100, "n2", 2, 3))
STOP = dataclasses.replace(BASE, stop_at=950, saved="/c/j/step4/done")

HUNG_AGAIN = ("clusterkit: the step hung (no progress on any rank for 31 s); requeueing job 77, "
              "restart 2 of --max-restarts 2")
HUNG_USED = ("clusterkit: the step hung (no progress on any rank for 31 s); not requeueing "
             "(--max-restarts 2 used: 2); stacks in /w/hangs/77.1")
RANK3 = ("clusterkit: rank 3 on n2 failed first (exit code 2); the other ranks were stopped "
         "after it. Its output: the [rank3] lines of /w/logs/slurm-77.err")
SAVED = "clusterkit: saved after the stop request (/c/j/step4/done); requeueing job 77 to resume"
ANY_NODES = ("clusterkit: requeueing job 77 on any free nodes (checkpoint parts replicated: "
             "--replicas 1)")

FRESH = "job j: the restarted program began at step 0 although checkpoint checkpoint-10 ..."

# A program that does not save on SIGUSR1 (HF Trainer): at USR1, end its step or not.
NOSAVE_JOB = dataclasses.replace(JOB, saves_on_usr1=False, program="hf-trainer", job_id="j")
NOSAVE = dataclasses.replace(BASE, job=NOSAVE_JOB, stop_at=950)
ENDED = ("clusterkit: the step was ended at USR1 (this program (hf-trainer) does not save on "
         "SIGUSR1); requeueing job 77 to resume from its newest complete checkpoint "
         "(/c/j/checkpoint-10/trainer_state.json was saved in this run): the steps since that "
         "save are lost")
ENDING = ("clusterkit: USR1 (time limit or preemption): this program (hf-trainer) does not save "
          "on SIGUSR1; it saved /c/j/checkpoint-10/trainer_state.json since this run began: "
          "ending the step to requeue job 77")
RUNS_ON = ("clusterkit: USR1 (time limit or preemption): this program (hf-trainer) does not save "
           "on SIGUSR1 and saved nothing in /c/j since this run began: not requeueing job 77 (it "
           "would begin where this run began); the step runs on to the time limit. Submit it "
           "again with --job-id j to resume from its newest checkpoint")

# (row of the doc table, facts) -> decision
TABLE: list[tuple[str, EndFacts, EndDecision]] = [
    ("ok", BASE, EndDecision(0)),
    ("hang-requeue", dataclasses.replace(HANG, hang_restarts=1),
     EndDecision(124, ANY, (Line(BOTH, HUNG_AGAIN),), count_hang=True)),
    ("hang-used", dataclasses.replace(HANG, hang_restarts=2),
     EndDecision(124, NONE, (Line(BOTH, HUNG_USED),))),
    # a hang is the whole answer: no failure line, no stop row
    ("hang-used", dataclasses.replace(HANG, hang_restarts=2, first_exit=FAILED.first_exit, stop_at=950),
     EndDecision(124, NONE, (Line(BOTH, HUNG_USED),))),
    ("hang-used", dataclasses.replace(HANG, job=dataclasses.replace(JOB, max_restarts=0), hang=""),
     EndDecision(124, NONE, (Line(BOTH, "clusterkit: the step hung (); not requeueing "
                                        "(--max-restarts 0 used: 0); stacks in /w/hangs/77.1"),))),
    ("rank-failed", FAILED, EndDecision(2, NONE, (Line(ERR, RANK3),))),
    ("rank-failed", dataclasses.replace(FAILED, job=PER_RANK_JOB,
                                        first_exit=ExitRecord(5, "n1", 137, 0)),
     EndDecision(137, NONE, (Line(ERR, "clusterkit: rank 0 on n1 failed first (killed by signal 9); "
                                      "the other ranks were stopped after it. Its output: "
                                      "/w/logs/ck-j-77-rank0.out"),))),
    # the script ended the step at USR1 for a save made in this run: requeue, whatever the
    # ranks killed by it recorded (the whole answer, as a hang's)
    ("stop-end-step", dataclasses.replace(NOSAVE, status=143, first_exit=FAILED.first_exit,
                                          ended="/c/j/checkpoint-10/trainer_state.json"),
     EndDecision(0, ANY, (Line(BOTH, ENDED),))),
    ("stop-end-step", dataclasses.replace(NOSAVE, job=dataclasses.replace(NOSAVE_JOB, node_local=True),
                                          status=0, ended="/c/j/checkpoint-10/trainer_state.json"),
     EndDecision(0, PINNED, (Line(BOTH, ENDED),))),
    # it ran on after USR1 and ended by itself: its own rows, no stop row, no requeue
    ("stop-run-on", dataclasses.replace(NOSAVE, saved="/c/j/checkpoint-20/x"), EndDecision(0)),
    ("stop-run-on", dataclasses.replace(NOSAVE, status=143, first_exit=FAILED.first_exit),
     EndDecision(2, NONE, (Line(ERR, RANK3),))),
    ("began-fresh", dataclasses.replace(BASE, began_fresh=FRESH),
     EndDecision(1, NONE, (Line(BOTH, f"clusterkit: {FRESH}"),))),
    # a failure is the answer: a run that failed did not finish from step 0
    ("rank-failed", dataclasses.replace(FAILED, began_fresh=FRESH),
     EndDecision(2, NONE, (Line(ERR, RANK3),))),
    ("step-failed", dataclasses.replace(BASE, status=1),
     EndDecision(1, NONE, (Line(ERR, "clusterkit: the launch step failed (exit 1) before any rank "
                                     "ended on its own; see /w/logs/slurm-77.err"),))),
    ("stop-unsaved", dataclasses.replace(STOP, saved=None),
     EndDecision(0, NONE, (Line(BOTH, "clusterkit: stop requested, but nothing was saved in /c/j "
                                      "since: not requeueing job 77 (a script saves on SIGUSR1 or "
                                      "when $CLUSTERKIT_STOP_FILE appears: docs/sbatch.md, "
                                      "Preemption)"),))),
    # the failure's line first, then the stop row with the rank's status
    ("stop-failed", dataclasses.replace(FAILED, stop_at=950, saved="/c/j/step4/done"),
     EndDecision(2, NONE, (Line(ERR, RANK3),
                           Line(BOTH, "clusterkit: stop requested and /c/j/step4/done written "
                                      "since, but the step failed (exit 2): not requeueing job 77")))),
    ("stop-late", dataclasses.replace(STOP, now=1041),
     EndDecision(0, NONE, (Line(BOTH, "clusterkit: stop requested, but the ranks ran on for 91 s "
                                      "(more than the signal lead, 90 s): they did not stop for "
                                      "it; not requeueing job 77"),))),
    ("stop-requeue", dataclasses.replace(STOP, now=1040), EndDecision(0, ANY, (Line(OUT, SAVED),))),
    ("requeue-plain", STOP, EndDecision(0, ANY, (Line(OUT, SAVED),))),
    ("requeue-pinned", dataclasses.replace(STOP, job=PINNED_JOB),
     EndDecision(0, PINNED, (Line(OUT, SAVED),))),
    ("requeue-pinned", dataclasses.replace(HANG, job=PINNED_JOB),
     EndDecision(124, PINNED, (Line(BOTH, HUNG_AGAIN.replace("restart 2", "restart 1")),),
                 count_hang=True)),
    ("requeue-any", dataclasses.replace(STOP, job=REPLICA_JOB),
     EndDecision(0, ANY, (Line(OUT, SAVED), Line(OUT, ANY_NODES)))),
    ("requeue-any", dataclasses.replace(HANG, job=REPLICA_JOB),
     EndDecision(124, ANY, (Line(BOTH, HUNG_AGAIN.replace("restart 2", "restart 1")),
                            Line(OUT, ANY_NODES)), count_hang=True)),
]


# At USR1, for a program that does not save on it (row, facts) -> what the script does then
AT_USR1: list[tuple[str, EndFacts, StopAnswer]] = [
    ("stop-end-step", dataclasses.replace(NOSAVE, saved_in_run="/c/j/checkpoint-10/trainer_state.json"),
     StopAnswer(True, (Line(BOTH, ENDING),))),
    ("stop-run-on", NOSAVE, StopAnswer(False, (Line(BOTH, RUNS_ON),))),
    # node-local: judged from every node's listing (node/slurm/replica.py ``saved``)
    ("stop-end-step", dataclasses.replace(NOSAVE, saved_in_run="checkpoint-10", listed=True),
     StopAnswer(True, (Line(BOTH, ENDING.replace(
         "/c/j/checkpoint-10/trainer_state.json", "checkpoint checkpoint-10 (complete on every "
         "node)")),))),
    ("stop-run-on", dataclasses.replace(NOSAVE, listed=True), StopAnswer(False, (Line(
        BOTH, RUNS_ON.replace("nothing in /c/j", "no checkpoint complete on every node (/c/j)")),))),
]


@pytest.mark.parametrize(("row", "facts", "want"), TABLE, ids=[f"{r[0]}-{i}" for i, r in enumerate(TABLE)])
def test_row(row: str, facts: EndFacts, want: EndDecision) -> None:
    assert decide(facts) == want


@pytest.mark.parametrize(("row", "facts", "want"), AT_USR1,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(AT_USR1)])
def test_row_at_usr1(row: str, facts: EndFacts, want: StopAnswer) -> None:
    assert at_usr1(facts) == want


def test_every_row_of_the_doc_table_has_a_test_row() -> None:
    text = (REPO / "docs" / "sbatch.md").read_text()
    header = "| row | when | exit status | requeue | the lines |"
    assert header in text, "docs/sbatch.md lost its table of the batch job's end"
    table = text.split(header, 1)[1].split("\n\n", 1)[0]
    doc = [ln.split("|")[1].strip().strip("`") for ln in table.strip().splitlines()[1:]]
    assert len(doc) == len(set(doc))
    assert sorted(set(doc) ^ {r[0] for r in TABLE}) == []
    assert {r[0] for r in AT_USR1} <= set(doc)
    module_rows = set(re.findall(r"^``([a-z-]+)``", end.__doc__ or "", re.M))
    assert module_rows == set(doc)  # the module docstring is the same table
    assert {want.requeue for *_, want in TABLE} == {NONE, ANY, PINNED}


def _end_conf(tmp_path: Path, **conf: object) -> dict[str, object]:
    job = tmp_path / "job"
    (job / "exits").mkdir(parents=True)
    (tmp_path / "ckpt").mkdir()
    base: dict[str, object] = {
        "max_restarts": 1, "signal_lead": 90, "replicas": 0, "node_local": True,
        "log_dir": str(job / "logs"), "job_name": "ck-j", "per_rank_files": False,
        "stop_var": "CLUSTERKIT_STOP_FILE", "ckpt_var": "CLUSTERKIT_CKPT_DIR",
        "stop_file": str(job / "stop"), "exits_dir": str(job / "exits"),
        "hang_file": str(job / "hang"), "count_file": str(job / "hang_restarts")}
    return {**base, **conf}


def _run_slurmend(conf: dict[str, object], tmp_path: Path, *args: str) -> tuple[int, str, str, str]:
    out, err, answer = io.StringIO(), io.StringIO(), io.StringIO()
    env = {"SLURM_JOB_ID": "77", "CLUSTERKIT_CKPT_DIR": str(tmp_path / "ckpt")}
    rc = end.run([json.dumps(conf), *args], env, out, err, answer)
    return rc, out.getvalue(), err.getvalue(), answer.getvalue()


def test_run_gathers_the_facts_from_the_job_dir(tmp_path: Path) -> None:
    conf = _end_conf(tmp_path)
    exits = tmp_path / "job/exits"
    (exits / "rank0").write_text("200 n1 143\n")
    (exits / "rank3").write_text("100 n2 2\n")
    (exits / "rank5").write_text("garbled\n")  # skipped, not a crash
    rc, out, err, answer = _run_slurmend(conf, tmp_path, "143", "", "")
    assert (rc, out, answer) == (0, "", "2 none\n")
    assert "rank 3 on n2 failed first (exit code 2)" in err
    # the watchdog's reason: one requeue (counted in the file), then no more
    (tmp_path / "job/hang").write_text("no progress for 31 s\n")
    rc, out, err, answer = _run_slurmend(conf, tmp_path, "143", "", "/h")
    assert answer == "124 pinned\n" and "restart 1 of --max-restarts 1" in out and out == err
    assert (tmp_path / "job/hang_restarts").read_text() == "1\n"
    rc, out, err, answer = _run_slurmend(conf, tmp_path, "143", "", "/h")
    assert answer == "124 none\n" and "used: 1); stacks in /h" in err
    assert (tmp_path / "job/hang_restarts").read_text() == "1\n"
    # no watchdog for this job: its hang file is not read
    rc, out, err, answer = _run_slurmend({**conf, "hang_file": ""}, tmp_path, "0", "", "")
    assert (answer, out, err) == ("0 none\n", "", "")


def test_run_reads_a_resumed_run_that_began_at_step_0_from_its_output(tmp_path: Path) -> None:
    """HF's lines (resume on stderr, losses on stdout: two files, no order between them):
    this run (run 2) was told to resume from checkpoint-10; losses without "Resuming
    training" end it exit 1, and run 1's lines do not count for run 2."""
    from clusterkit.node.contract import CKPT_TAG_TOKEN, SLURM_RESUMED_FROM
    from clusterkit.spec.programs import HF, PROFILES
    from clusterkit.spec.resume import began_fresh_line

    runs = tmp_path / "job/slurm-runs"
    (runs / "77.2").mkdir(parents=True)
    (runs / "77.2" / SLURM_RESUMED_FROM).write_text("checkpoint-10\n")
    conf = _end_conf(tmp_path, resumed_marker=PROFILES[HF].resumed_marker,
                     progress_marker=PROFILES[HF].progress_marker,
                     began_fresh=began_fresh_line(CKPT_TAG_TOKEN, "j"), tag_token=CKPT_TAG_TOKEN,
                     runs_dir=str(runs), resumed_from_file=SLURM_RESUMED_FROM)
    logs = tmp_path / "job/logs"
    logs.mkdir()
    head = "===== clusterkit: job j slurm=77 run {} on n[1-2] at T =====\n"
    resumed = "0: [rank0]:[INFO|trainer.py:1631] >>   Resuming training from checkpoint with epoch 0\n"
    (logs / "slurm-77.out").write_text(head.format(1) + "0: [rank0]:{'loss': '3.1'}\n"
                                       + head.format(2) + "0: [rank0]:{'loss': '3.1'}\n")
    (logs / "slurm-77.err").write_text(head.format(1) + resumed + head.format(2) + "noise\n")
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}
    facts = end.gather(conf, 0, "", "", env, 0)
    assert facts.began_fresh == began_fresh_line("checkpoint-10", "j")
    assert decide(facts).status == 1
    (logs / "slurm-77.err").write_text(head.format(1) + head.format(2) + resumed)
    assert end.gather(conf, 0, "", "", env, 0).began_fresh is None  # it resumed
    assert end.gather(conf, 0, "", "", {**env, "SLURM_RESTART_COUNT": "0"}, 0).began_fresh \
        is None  # run 1 was told nothing


def test_run_requeues_for_a_file_saved_after_the_stop_file(tmp_path: Path) -> None:
    import time

    conf = _end_conf(tmp_path)
    stop = tmp_path / "job/stop"
    old = tmp_path / "ckpt/step2/done"
    old.parent.mkdir()
    old.write_text("x")
    stop.write_text("2026-01-01T00:00:00Z\n")
    os.utime(old, ns=(stop.stat().st_mtime_ns - 10**9,) * 2)
    now = str(int(time.time()))
    _, out, err, answer = _run_slurmend(conf, tmp_path, "0", now, "")
    assert answer == "0 none\n" and f"nothing was saved in {tmp_path / 'ckpt'} since" in out
    new = tmp_path / "ckpt/step4/done"
    new.parent.mkdir()
    new.write_text("x")
    os.utime(new, ns=(stop.stat().st_mtime_ns + 10**6,) * 2)
    _, out, err, answer = _run_slurmend(conf, tmp_path, "0", now, "")
    assert answer == "0 pinned\n" and f"saved after the stop request ({new})" in out and err == ""
    _, out, err, answer = _run_slurmend(conf, tmp_path, "0", str(int(time.time()) - 91), "")
    assert answer == "0 none\n" and "ran on for" in err
    stop.unlink()  # the stop file could not be written: nothing counts as saved since
    _, out, _, answer = _run_slurmend(conf, tmp_path, "0", now, "")
    assert answer == "0 none\n" and "nothing was saved" in out


def test_usr1_ends_the_step_only_for_a_save_since_the_run_began(tmp_path: Path) -> None:
    """``slurm.end CONF usr1``: a file of the checkpoint dir older than the run's start
    stamp is no progress of this run ("run", the line); one newer is ("end", recorded in
    the ended file), and the end of the run then requeues (row stop-end-step)."""
    import time

    conf = _end_conf(tmp_path, saves_on_usr1=False, program="hf-trainer", job_id="j",
                     started_file=str(tmp_path / "job/run_started"),
                     ended_file=str(tmp_path / "job/stop_ended"))
    old = tmp_path / "ckpt/checkpoint-10/trainer_state.json"
    old.parent.mkdir()
    old.write_text("{}")
    started = tmp_path / "job/run_started"
    started.write_text("")
    os.utime(old, ns=(started.stat().st_mtime_ns - 10**9,) * 2)
    rc, out, err, answer = _run_slurmend(conf, tmp_path, "usr1")
    assert (rc, answer) == (0, "run\n") and out == err and "saved nothing in" in out
    assert "Submit it again with --job-id j" in out and not (tmp_path / "job/stop_ended").exists()
    now = str(int(time.time()))
    _, out, _, answer = _run_slurmend(conf, tmp_path, "0", now, "")  # it ran on and finished
    assert (answer, out) == ("0 none\n", "")
    new = tmp_path / "ckpt/checkpoint-20/trainer_state.json"
    new.parent.mkdir()
    new.write_text("{}")
    os.utime(new, ns=(started.stat().st_mtime_ns + 10**6,) * 2)
    rc, out, err, answer = _run_slurmend(conf, tmp_path, "usr1")
    assert answer == "end\n" and f"it saved {new} since this run began" in out
    assert (tmp_path / "job/stop_ended").read_text() == f"{new}\n"
    (tmp_path / "job/exits/rank1").write_text("100 n2 143\n")  # the ranks the TERM ended
    _, out, err, answer = _run_slurmend(conf, tmp_path, "143", now, "")
    assert answer == "0 pinned\n" and f"({new} was saved in this run)" in out and out == err
    assert "failed first" not in err


@pytest.mark.parametrize("python", PYTHONS)
def test_the_shipped_program_answers_on_fd_3(python: str, tmp_path: Path) -> None:
    """As the script runs it: bootstrap + sources on stdin, the lines on stdout/stderr,
    the answer alone on file descriptor 3 (on the oldest Python found here too)."""
    conf = json.dumps(_end_conf(tmp_path))
    cmd = ship.node_command(python, "slurm.end", [conf, "1", "", ""])
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77"}
    answer = tmp_path / "answer"
    proc = subprocess.run(["bash", "-c", 'exec "$@" 3>"$0"', str(answer), *cmd.argv],
                          input=cmd.stdin, capture_output=True, env=env, timeout=60,
                          cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    assert answer.read_text() == "1 none\n" and proc.stdout == b""
    assert b"the launch step failed (exit 1)" in proc.stderr
    bad = subprocess.run(cmd.argv[:-4], input=cmd.stdin, capture_output=True, timeout=60,
                         cwd=tmp_path, check=False)
    assert bad.returncode == 2 and b"usage: slurm.end" in bad.stderr


def test_the_template_only_performs_the_answer() -> None:
    """Acceptance of issue 36 item 2: after the launch step, sbatch.sh.j2 holds no
    decision of the table (no restart count, stop check, signal lead, status wording)."""
    text = (REPO / "templates" / "sbatch.sh.j2").read_text()
    end = text.split("{{ launch_line }} &", 1)[1]
    code = "\n".join(ln for ln in end.splitlines() if not ln.lstrip().startswith("#"))
    for decision in ("max_restarts", "signal_lead", "hang_restarts", "-newer", "failed first",
                     "-lt", "-gt", "stop_at=", "status=$rc", "requeue()", "{% if variant",
                     "{% elif node_local", "$hang_file"):
        assert decision not in code, decision
    assert code.count("scontrol requeue \"") == 1 and code.count("scontrol requeuehold") == 1
