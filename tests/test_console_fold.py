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
