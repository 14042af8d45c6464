"""The folded console: identical rank lines once with a rank range, noise once per job."""

from __future__ import annotations

import io

import pytest

from clusterkit.fold import LineFolder, fold_key, parse_ranks, rank_label
from clusterkit.launch.console import FoldingSink, PlainSink

ACCEL = ("[2026-11-23 09:45:06,725] [WARNING] [real_accelerator.py:213:get_accelerator] "
         "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
FUTURE = ("/usr/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: "
          "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...")


def _texts(items: list) -> list[str]:
    return [i.render() for i in items]


def test_rank_label_shapes() -> None:
    assert rank_label([5], ["node3"]) == "[node3 r5]"
    assert rank_label([4, 5], ["node3", "node3"]) == "[node3 r4-5]"
    assert rank_label([0, 1, 2, 3, 4, 5, 6, 7, 9], ["a"] * 5 + ["b"] * 4) == "[r0-7,9]"


def test_timestamps_do_not_split_groups() -> None:
    assert fold_key(ACCEL) == fold_key(ACCEL.replace("06,725", "07,032"))
    # torch's C++ warnings: "[W1123 12:50:40.891008724 Utils.hpp:137]" per rank
    glog = "[W1123 12:50:40.891008724 Utils.hpp:137] Warning: Environment variable X"
    assert fold_key(glog) == fold_key(glog.replace("40.891008724", "41.000000001"))
    assert fold_key(glog) == "[W Utils.hpp:137] Warning: Environment variable X"


def test_noise_outside_the_groups_counts_once() -> None:
    # a node launcher's own noise line (sbatch --watch) and then the ranks' copies
    f = LineFolder(window_s=0.0)
    assert f.show_once(ACCEL) and not f.show_once(ACCEL) and f.show_once("not noise")
    assert f.feed("n1", 0, ACCEL, now=0.0) == [] and f.suppressed == 2


def test_identical_lines_from_all_ranks_fold_at_once() -> None:
    f = LineFolder(window_s=5.0, world_size=4)
    out = []
    for rank in range(4):
        out += f.feed(f"node{rank // 2 + 1}", rank, f"hello from the same code {rank * 0}", now=0.1 * rank)
    assert _texts(out) == ["[r0-3] hello from the same code 0"]


def test_window_releases_partial_groups_in_first_seen_order() -> None:
    f = LineFolder(window_s=1.0, world_size=4)
    assert f.feed("n1", 0, "a", now=0.0) == []
    assert f.feed("n1", 1, "a", now=0.2) == []
    assert f.feed("n1", 0, "b", now=0.3) == []
    # b waits behind a even when it is ready, so rank 0's lines stay in order
    assert _texts(f.release(now=1.05)) == ["[n1 r0-1] a"]
    assert _texts(f.release(now=1.4)) == ["[n1 r0] b"]


def test_a_rank_repeating_its_line_keeps_both() -> None:
    f = LineFolder(window_s=1.0)
    f.feed("n1", 0, "tick", now=0.0)
    f.feed("n1", 0, "tick", now=0.1)
    assert _texts(f.release(now=5.0)) == ["[n1 r0] tick", "[n1 r0] tick"]


def test_noise_is_shown_once_per_job_even_when_late_ranks_straggle() -> None:
    f = LineFolder(window_s=1.0, world_size=14)
    out = []
    for rank in range(7):
        out += f.feed(f"node{rank // 2 + 1}", rank, ACCEL, now=0.0)
    out += f.release(now=2.0)
    for rank in range(7, 14):  # 10 s later: slow imports on a loaded node
        out += f.feed(f"node{rank // 2 + 1}", rank, ACCEL, now=10.0)
    out += f.release(now=20.0, final=True)
    assert len(out) == 1 and out[0].label == "[r0-6]"
    assert f.suppressed == 7


def test_non_noise_late_line_still_shown() -> None:
    f = LineFolder(window_s=1.0)
    f.feed("n1", 0, "RuntimeError: boom", now=0.0)
    f.release(now=2.0)
    out = f.feed("n2", 5, "RuntimeError: boom", now=3.0) + f.release(now=9.0)
    assert _texts(out) == ["[n2 r5] RuntimeError: boom"]


def test_summary_line_is_left_to_the_launcher() -> None:
    f = LineFolder(window_s=0.0)
    assert f.feed("n1", 0, 'CLUSTERKIT_SUMMARY {"x": 1}', now=0.0) == []
    assert f.release(now=1.0, final=True) == []


def test_rank_selection() -> None:
    assert parse_ranks("all") is None
    assert parse_ranks("0") == frozenset({0})
    assert parse_ranks("0,4-6") == frozenset({0, 4, 5, 6})
    for bad in ("abc", "3-1", "", "1-"):
        with pytest.raises(ValueError):
            parse_ranks(bad)
    f = LineFolder(window_s=0.0, ranks=frozenset({0}))
    out = f.feed("n1", 1, "x", now=0.0) + f.feed("n1", 0, "y", now=0.0) + f.release(1.0, final=True)
    assert _texts(out) == ["[n1 r0] y"]


def test_folding_sink_default_startup_prints_no_line_per_rank() -> None:
    """The start-up lines of a 7 x 2 job: one line each, not one per rank."""
    buf = io.StringIO()
    sink = FoldingSink(PlainSink(buf), LineFolder(window_s=0.3, world_size=14), tick_s=0.05)
    for text in (ACCEL, FUTURE, "  return func(*args, **kwargs)"):
        for rank in range(14):
            sink.line(f"node{rank // 2 + 1}", rank, text)
    sink.line("node1", 0, "[clusterkit] step 10/30 | loss 4.8")
    sink.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith("[r0-13] [WARNING]")
    assert lines[-1] == "[node1 r0] [clusterkit] step 10/30 | loss 4.8"


def test_selected_ranks_do_not_wait_for_the_others() -> None:
    # --ranks 0 of 4: rank 0's line is complete at once (no window to wait out)
    f = LineFolder(window_s=5.0, world_size=4, ranks=frozenset({0}))
    assert _texts(f.feed("n1", 0, "mine", now=0.0)) == ["[n1 r0] mine"]
    f = LineFolder(window_s=5.0, world_size=4, ranks=frozenset({2, 3, 9}))
    assert f.feed("n2", 2, "x", now=0.0) == []
    assert _texts(f.feed("n2", 3, "x", now=0.1)) == ["[n2 r2-3] x"]


# ------------------------------------------------------------------ collateral (issue 25)

GLOO = [
    "Traceback (most recent call last):",
    '  File "/work/train.py", line 40, in <module>',
    "    dist.all_reduce(t)",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
    "Connection closed by peer [127.0.0.1]:29500",
]


def _kill_rank0(f: LineFolder, world: int, failed_at: float) -> list:
    """Rank 0 raises (its traceback first); the others' gloo tracebacks follow, some
    before the launcher hears of rank 0's failure, some after."""
    out = []
    for text in ("Traceback (most recent call last):", "ValueError: bad batch"):
        out += f.feed("node1", 0, text, now=0.0)
    for rank in range(1, world - 1):  # in the window when the failure is reported
        for text in GLOO:  # (rank 13 prints nothing: "Traceback" waits for it)
            out += f.feed(f"node{rank // 2 + 1}", rank, text, now=0.1)
    assert f.fail(0, now=0.3) and not f.fail(3, now=0.4)  # only the first failure counts
    for rank in range(1, world - 1):  # after: 60 more lines each
        for i in range(60):
            out += f.feed(f"node{rank // 2 + 1}", rank, f"  frame {i}", now=failed_at + 0.01 * i)
    out += f.feed("node1", 0, "rank 0 says goodbye", now=failed_at + 1)
    return out + f.release(now=failed_at + 5, final=True)


def test_collateral_tracebacks_fold_into_one_line_after_the_first_failure() -> None:
    f = LineFolder(window_s=1.0, world_size=14)
    shown = _texts(_kill_rank0(f, 14, failed_at=0.5))
    # rank 0's traceback in full (its "Traceback" line no longer merged with others')
    assert shown == ["[node1 r0] Traceback (most recent call last):",
                     "[node1 r0] ValueError: bad batch", "[node1 r0] rank 0 says goodbye"]
    item = f.collateral("node1 rank 0", "/j/nodes/<node>/rank<N>.log")
    assert item is not None
    assert item.render() == (
        "[r1-12] collateral: 12 ranks printed 768 lines after node1 rank 0 failed "
        "(not shown; each rank's log has them: /j/nodes/<node>/rank<N>.log)")
    # the next attempt starts fresh: its lines show again, no second collateral line
    assert f.failed is None and f.collateral("x", "") is None
    assert _texts(f.feed("node2", 3, "attempt 2 line", now=9.0) + f.release(20.0, final=True)) \
        == ["[node2 r3] attempt 2 line"]


def test_no_failure_no_collateral_and_one_rank_singular() -> None:
    f = LineFolder(window_s=0.0)
    assert f.collateral("n1 rank 0", "") is None
    f.fail(1, now=0.0)
    f.feed("n1", 0, "RuntimeError: x", now=0.0)
    item = f.collateral("", "")
    assert item is not None
    assert item.render() == "[n1 r0] collateral: 1 rank printed 1 line after rank 1 failed (not shown)"


def test_after_the_failure_a_rank_is_shown_until_its_error_output_begins() -> None:
    """Rank 0 saves a checkpoint on the teardown's SIGTERM, then fails in a collective:
    the save is news, the traceback is collateral."""
    f = LineFolder(window_s=0.0)
    f.fail(3, now=0.0)
    out = []
    for text in ("checkpoint global_step86 complete in 0.1s", "[rank0]: Traceback (most recent "
                 "call last):", '[rank0]:   File "train.py", line 3', "[rank0]: saving more?"):
        out += f.feed("n1", 0, text, now=1.0)
    assert _texts(out + f.release(2.0, final=True)) == [
        "[n1 r0] checkpoint global_step86 complete in 0.1s"]
    item = f.collateral("n2 rank 3", "")
    assert item is not None and "1 rank printed 3 lines" in item.text


def test_lines_from_before_the_failure_stay_lines() -> None:
    """Only what came shortly before the report is collateral: an earlier line waiting
    behind another group is still shown."""
    f = LineFolder(window_s=5.0, world_size=4)
    f.feed("n1", 1, "rank 1 ready", now=0.0)
    f.feed("n2", 3, "step 7 on rank 3", now=2.0)
    f.feed("n1", 0, "checkpoint global_step20 complete in 0.07s", now=2.8)  # a peer's news
    f.feed("n2", 3, "[rank3]: Traceback (most recent call last):", now=2.85)
    f.feed("n2", 3, "[rank3]:     dist.all_reduce(t)", now=2.9)
    f.fail(1, now=3.0)  # rank 1 was killed
    assert _texts(f.release(9.0, final=True)) == [
        "[n1 r1] rank 1 ready", "[n2 r3] step 7 on rank 3",
        "[n1 r0] checkpoint global_step20 complete in 0.07s"]
    item = f.collateral("n1 rank 1", "")
    assert item is not None and item.label == "[n2 r3]" and "printed 2 lines " in item.text
    from clusterkit.fold import ERROR_START

    for line in ("[rank1]: RuntimeError: [../gloo/pair.cc:534] Connection closed by peer",
                 "[rank1]:[E1123 12:50:40.891 ProcessGroupNCCL.cpp:616] Watchdog caught",
                 "torch.distributed.DistBackendError: NCCL error", "ERROR: failed"):
        assert ERROR_START.search(line), line
    assert not ERROR_START.search("step 10/30 | loss 4.8 | no errors so far")


def test_folding_sink_prints_the_collateral_line_at_the_end_of_the_attempt() -> None:
    buf = io.StringIO()
    sink = FoldingSink(PlainSink(buf), LineFolder(window_s=0.2, world_size=4), tick_s=0.05)
    sink.line("n1", 0, "boom")
    sink.failed_first(0, "n1 rank 0", "~/j/nodes/<node>/rank<N>.log")
    for rank in (1, 2, 3):
        for text in GLOO:
            sink.line(f"n{rank // 2 + 1}", rank, text)
    sink.info("n1 rank 0 failed (exit code 1): stopping the job on every node")
    sink.end_attempt()
    sink.close()
    assert buf.getvalue().splitlines() == [
        "[n1 r0] boom",
        "[clusterkit] n1 rank 0 failed (exit code 1): stopping the job on every node",
        "[r1-3] collateral: 3 ranks printed 12 lines after n1 rank 0 failed (not shown; "
        "each rank's log has them: ~/j/nodes/<node>/rank<N>.log)"]


# ------------------------------------------------------------------ the status line (issue 25)


def test_status_line_names_the_phase_and_the_time_since_launch() -> None:
    from clusterkit.launch.console import StatusLine, clock

    st = StatusLine(total=2, started_at=100.0)
    assert st.text(101.0) == (" connecting | 1 s since launch | nodes up 0/2 | step - | loss - | "
                              "tokens/s -")
    st.set_phase("gate", "1/2 nodes", now=103.0)
    assert st.text(104.5).startswith(" gate 1/2 nodes 1 s | 4 s since launch |")
    st.up.update({"n1", "n2"})
    st.set_phase("initialising", "", now=110.0)
    # the 80 s of "step -" under load now say what they are and for how long
    assert st.text(190.0).startswith(" initialising 1:20 | 1:30 since launch | nodes up 2/2 | "
                                     "step -")
    st.progress.update("[clusterkit] step 10/30 | loss 4.8143 | 5,205 tok/s")
    st.set_phase("training", "", now=191.0)
    assert st.text(200.0) == (" training | 1:40 since launch | nodes up 2/2 | step 10/30 | "
                              "loss 4.8143 | tokens/s 5,205")
    st.done["n2"] = 1
    assert "| failed 1 |" in st.text(201.0)
    assert (clock(59.9), clock(60), clock(3725)) == ("59 s", "1:00", "1:02:05")
