"""The console of a library-driven run (issue 38 item 5): a real Hugging Face Trainer
run's output (tests/fixtures/hf_trainer_console, SOURCES says how it was recorded),
replayed through the node agent's line split and the folder, fits its budget.

The budget, :data:`HF_BUDGET`: 60 lines besides the loss lines for this run (2 ranks,
60 steps, 3 saves, 3 evaluations; 458 lines unfolded), about one screen. What it holds:
the start-up (each rank's "Process rank" line, the settings dump as one line, the
library warnings once, Trainer's 9-line "Running training" header: about 25 lines),
each save ("Saving model checkpoint to ...", once the files it wrote: 1 to 5 lines),
the progress bar's quarters (5) and the end (the metrics tables, 14 lines). Every loss
line stays whole, on its own line, as the program printed it.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

from clusterkit.fold import FOLD_WINDOW_S, LineFolder, library_pieces
from clusterkit.node.agent.output import AgentOutput, RankLogTail, tee_parts
from clusterkit.node.protocol import AgentSpec
from tests.paths import TESTS

FIX = TESTS / "fixtures" / "hf_trainer_console"
HF_BUDGET = 60
PACE_S = 0.005  # between two recorded lines in the replay (the run printed ~450 in 2-3 s)
LOSS_LINE = re.compile(r"\{'(?:loss|eval_loss|train_runtime)'|\b(?:train|eval)_loss\s+=")


def _folded(lines: list[tuple[str, int | None, str]]) -> list[str]:
    folder = LineFolder(FOLD_WINDOW_S, world_size=2, nodes=1)
    shown, now = [], 0.0
    for node, rank, text in lines:
        now += PACE_S
        items = (folder.feed_node(node, text, now) if rank is None
                 else folder.feed(node, rank, text, now))
        shown += [i.render() for i in items]
    return shown + [i.render() for i in folder.release(now + 10, final=True)]


def _tee_lines() -> list[tuple[str, int | None, str]]:
    """torchrun_tee.txt as the agent labels it (node1: ranks 0 and 1)."""
    out = AgentOutput(AgentSpec(job_id="j", node="node1", job_dir="",
                                rank_offsets={"node1": 0}), "", io.StringIO(), lambda why: None)
    raw = (FIX / "torchrun_tee.txt").read_text(encoding="utf-8").splitlines()
    return [out.classify(part) for line in raw for part in tee_parts(line)]


def _loss_lines(text: str) -> list[str]:
    return [m.group(0) for m in re.finditer(r"\{'(?:loss|eval_loss)'[^}]*\}", text)]


def _check(shown: list[str], recorded: str) -> None:
    other = [ln for ln in shown if not LOSS_LINE.search(ln)]
    print(f"{len(shown)} lines, {len(other)} besides the loss lines (budget {HF_BUDGET})")
    assert len(other) <= HF_BUDGET, "\n".join(other)
    # every loss dict the program printed is one whole line of its own
    losses = [ln.split("] ", 1)[1] for ln in shown if "{'loss'" in ln or "{'eval_loss'" in ln]
    assert losses == _loss_lines(recorded)
    assert sum("lines of settings, not shown" in ln for ln in shown) >= 1
    assert not any("%|" in ln and "{'" in ln for ln in shown)  # no bar glued to a line


def test_an_hf_trainer_console_through_torchruns_tee_fits_its_budget() -> None:
    lines = _tee_lines()
    assert len((FIX / "torchrun_tee.txt").read_text().splitlines()) == 458
    shown = _folded(lines)
    _check(shown, (FIX / "torchrun_tee.txt").read_text(encoding="utf-8"))
    dump = [ln for ln in shown if "TrainingArguments(" in ln]
    assert len(dump) == 1 and dump[0].startswith("[node1 r0-1] "), dump  # both ranks' dumps


def test_an_hf_trainer_console_from_each_ranks_own_output_fits_its_budget(tmp_path: Path) -> None:
    """The ranks' own bytes (tqdm's carriage returns inside a line), as the agent reads a
    rank's pipe or DeepSpeed's per-rank log; the two ranks' lines interleaved."""
    recorded = ""
    for r in (0, 1):
        data = b"".join((FIX / f"rank{r}.{s}.raw").read_bytes() for s in ("stdout", "stderr"))
        (tmp_path / f"run_rank{r}.log").write_bytes(data)
        recorded += data.decode("utf-8")
    tail = RankLogTail(str(tmp_path))
    per_rank: dict[int, list[str]] = {0: [], 1: []}
    for rank, text in tail.poll(final=True):
        per_rank[rank].append(text)
    tail.close()
    assert any("\r" in t for t in per_rank[0])  # the carriage-return updates are there
    lines = [("node1", r, per_rank[r][i]) for i in range(max(map(len, per_rank.values())))
             for r in (0, 1) if i < len(per_rank[r])]
    _check(_folded(lines), recorded)


def test_library_pieces() -> None:
    bar = " 10%|█         | 6/60 [00:00<00:01, 32.34it/s]"
    assert library_pieces(bar + "{'loss': '3.0'}") == [bar, "{'loss': '3.0'}"]
    assert library_pieces("\r  0%|   | 0/2 [00:00<?, ?it/s]\x1b[A\r" + " " * 40 + "\r") == [
        "  0%|   | 0/2 [00:00<?, ?it/s]"]
    assert library_pieces(" " * 46 + "[INFO|trainer.py:4149] >> Saving") == [
        "[INFO|trainer.py:4149] >> Saving"]
    assert library_pieces("plain text") == ["plain text"]


def test_tee_parts_split_a_line_glued_to_another_ranks() -> None:
    assert tee_parts("[default0]:  0%| | 0/60 [00:00<?, ?it/s][default1]:[WARNING|x] y") == [
        "[default0]:  0%| | 0/60 [00:00<?, ?it/s]", "[default1]:[WARNING|x] y"]
    assert tee_parts("[default0]:[rank0]:[W1128 reducer.cpp:1529] w") == [
        "[default0]:[rank0]:[W1128 reducer.cpp:1529] w"]
    assert tee_parts("node3: text") == ["node3: text"]


def test_a_progress_bar_shows_each_quarter_once_and_a_dump_is_one_line() -> None:
    f = LineFolder(window_s=0.0, world_size=1)
    out = []
    for n in range(0, 61, 3):
        out += f.feed("n1", 0, f"{100 * n // 60:3d}%|#| {n}/60 [00:00<00:00, 9it/s]", now=n)
    assert [i.text.split("|")[0].strip() for i in out] == ["0%", "25%", "50%", "75%", "100%"]
    lines = ["Args(", "a=1,", "b=2,", "c=3,", ")", "after"]
    out = [i.text for t, ln in enumerate(lines) for i in f.feed("n1", 0, ln, now=100 + t)]
    out += [i.text for i in f.release(200, final=True)]
    assert out == ["Args( ... ) (4 lines of settings, not shown; the rank's log has them)",
                   "after"]
    short = ["Cfg {", '"x": 1', "}"]  # under DUMP_MIN_LINES: shown as it is
    out = [i.text for t, ln in enumerate(short) for i in f.feed("n1", 0, ln, now=300 + t)]
    assert out + [i.text for i in f.release(400, final=True)] == short


def test_the_status_line_reads_an_hf_trainers_loss_and_bar() -> None:
    from clusterkit.launch.console import Progress

    p = Progress()
    assert p.update("{'loss': '2.869', 'grad_norm': '1.239', 'learning_rate': '0.00085'}")
    assert p.loss == "2.869"
    assert p.update(" 25%|██▌       | 15/60 [00:00<00:00, 68.51it/s]") and p.step == "15/60"
    assert not Progress().update("{'eval_loss': '2.343'}")  # not the training loss
    q = Progress()
    assert q.update("[clusterkit] step 10/30 | loss 4.8") and (q.step, q.loss) == ("10/30", "4.8")


def test_a_python_warning_shown_once_takes_its_source_line_along() -> None:
    warn = "/venv/lib/x.py:12: UserWarning: TypedStorage is deprecated"
    f = LineFolder(window_s=0.5, world_size=2)
    out = []
    for now, (rank, text) in enumerate([(0, warn), (0, "  warnings.warn("), (0, "step 1"),
                                        (1, warn), (1, "  warnings.warn("), (1, "step 1")]):
        out += f.feed("n1", rank, text, now=float(now))
    out += f.release(100.0, final=True)
    assert [i.render() for i in out] == [
        f"[n1 r0] {warn}", "[n1 r0]   warnings.warn(", "[n1 r0] step 1", "[n1 r1] step 1"]


def test_an_hf_record_whose_message_is_on_the_next_line_is_one_line() -> None:
    f = LineFolder(window_s=0.0, world_size=1)
    out = f.feed("n1", 0, "[INFO|trainer.py:2957] 2026-11-28 15:04:02,939 >> ", now=0.0)
    out += f.feed("n1", 0, "***** Running Evaluation *****", now=0.1)
    out += f.feed("n1", 0, "[INFO|trainer.py:2003] 2026-11-28 15:04:03,514 >> ", now=0.2)
    out += f.release(1.0, final=True)  # the run ended: the record's first line alone
    assert [i.text for i in out] == [
        "[INFO|trainer.py:2957] 2026-11-28 15:04:02,939 >> ***** Running Evaluation *****",
        "[INFO|trainer.py:2003] 2026-11-28 15:04:03,514 >>"]


def test_a_launcher_record_that_says_nothing_is_not_shown() -> None:
    """torchrun's OMP_NUM_THREADS banner: an empty record line, then its continuation."""
    f = LineFolder(window_s=0.0, nodes=1)
    banner = ["W1128 15:04:25.700000 6490 torch/distributed/run.py:874] ",
              "W1128 15:04:25.700000 6490 torch/distributed/run.py:874] *****",
              "W1128 15:04:25.700000 6490 torch/distributed/run.py:874] Setting OMP_NUM_THREADS "
              "environment variable for each process to be 1 in default"]
    out = [i for ln in banner for i in f.feed_node("node1", ln, now=0.0)]
    assert out + f.release(1.0, final=True) == [] and f.suppressed == 3
