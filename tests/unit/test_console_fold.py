"""The folded console: identical rank lines once with a rank range, noise once per job."""

from __future__ import annotations

import io
import re

import pytest

from clusterkit.fold import LineFolder, fold_key, parse_ranks, rank_label
from clusterkit.launch.console import FoldingSink, PlainSink
from tests.paths import TESTS

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


# ------------------------------------------------------------------ launcher lines (issue 32)

FIXTURES = TESTS / "fixtures" / "launcher_teardown"
_RANK_LINE = re.compile(r"^\[default\d+\]:|^step \d+/1000 ")  # torchrun's rank label; launch.py's ranks
SOCKET = ("[W1127 00:56:14.779442919 socket.cpp:207] [c10d] The hostname of the client socket "
          "cannot be retrieved. err=-3")


def _launcher_lines(name: str) -> tuple[list[str], list[str]]:
    """A fixture's launcher lines (not its ranks'): before the SIGTERM and after it."""
    lines = [ln for ln in (FIXTURES / name).read_text().splitlines() if not _RANK_LINE.match(ln)]
    first = next(i for i, ln in enumerate(lines) if re.search(
        r"Received 15 death signal|sigkill_handler", ln))
    return lines[:first], lines[first:]


def test_the_same_launcher_line_from_several_nodes_folds_with_the_node_range() -> None:
    f = LineFolder(window_s=1.0, nodes=4)
    out = []
    for i, stamp in enumerate(("14.779442919", "15.001", "14.9", "16.2")):
        out += f.feed_node(f"node{i + 1}", SOCKET.replace("14.779442919", stamp), now=0.1 * i)
    assert _texts(out) == ["[node[1-4]] [W socket.cpp:207] [c10d] The hostname of the client "
                           "socket cannot be retrieved. err=-3 (4 nodes)"]
    # noise: once per job; the next attempt's copies (and the ranks' copy) are dropped
    out = f.feed_node("node1", SOCKET, now=5.0) + f.feed("node1", 0, SOCKET, now=5.0)
    assert out + f.release(9.0, final=True) == [] and f.suppressed == 2
    # one node: its own line as it came; lines differing in a pid or an address fold
    g = LineFolder(window_s=1.0, nodes=3)
    out = g.feed_node("node2", "Sending process 226 closing signal SIGTERM", now=0.0)
    out += g.feed_node("node3", "Sending process 9120 closing signal SIGTERM", now=0.1)
    out += g.feed_node("node1", "bound to 10.213.1.11:29500", now=0.2)
    out += g.release(5.0, final=True)
    assert _texts(out) == ["[node[2-3]] Sending process <pid> closing signal SIGTERM (2 nodes)",
                           "[node1] bound to 10.213.1.11:29500"]


@pytest.mark.parametrize("name", ["torchrun.txt", "accelerate.txt", "deepspeed_launch.txt"])
def test_what_each_launcher_prints_when_torn_down_is_one_line(name: str) -> None:
    """The real texts (tests/fixtures/launcher_teardown): three nodes' launchers, started
    the same way, then SIGTERMed by the teardown."""
    before, after = _launcher_lines(name)
    assert after, name
    buf = io.StringIO()
    sink = FoldingSink(PlainSink(buf), LineFolder(window_s=0.2, world_size=3, nodes=3),
                       tick_s=0.05, launcher_logs="/j/nodes/<node>/launcher.log")
    for node in ("node1", "node2", "node3"):
        for text in before:
            sink.line(node, None, text)
    sink.phase("tearing down")
    for node in ("node3", "node1", "node2"):
        for text in after:
            sink.line(node, None, text)
    sink.info("node2 failed (the SSH connection dropped): stopping the job on every node")
    sink.end_attempt()
    sink.close()
    lines = buf.getvalue().splitlines()
    n = 3 * len(after)
    assert lines[-2:] == [
        "[clusterkit] node2 failed (the SSH connection dropped): stopping the job on every node",
        f"[node[1-3]] teardown: the launchers on 3 nodes printed {n} lines while they were "
        "stopped (not shown; each node's log has them: /j/nodes/<node>/launcher.log)"]
    # what they printed before: once for the three nodes (timestamps and pids differ)
    assert len(lines) - 2 <= len([t for t in before if t.strip()]), lines
    assert all(ln.startswith("[node[1-3]] ") for ln in lines[:-2]), lines


def test_the_testbed_console_before_issue32_folds_to_a_few_lines() -> None:
    """tests/fixtures/launcher_teardown/testbed_console_before.txt: the torchrun agents'
    126 lines of a 3-node run with a lost node and a failed restart, replayed with each
    attempt's teardown where the launcher began it (its "stopping the job" line)."""
    lines = (FIXTURES / "testbed_console_before.txt").read_text().splitlines()
    label = re.compile(r"^\[(node\d+)\] (.*)$")
    buf = io.StringIO()
    sink = FoldingSink(PlainSink(buf), LineFolder(window_s=0.2, world_size=3, nodes=3),
                       tick_s=0.05, launcher_logs="/j/nodes/<node>/launcher.log")
    for ln in lines:
        m = label.match(ln)
        if m:
            sink.line(m.group(1), None, m.group(2))
        elif "stopping the job on every node" in ln:
            sink.info(ln.removeprefix("[clusterkit] "))
            sink.phase("tearing down")
        elif ln.startswith("[clusterkit] checkpoints replicated"):
            sink.end_attempt()  # the attempt's end: its folded lines
    sink.close()
    shown = [ln for ln in buf.getvalue().splitlines() if not ln.startswith("[clusterkit]")]
    assert sum(1 for ln in lines if label.match(ln)) == 126
    logs = "(not shown; each node's log has them: /j/nodes/<node>/launcher.log)"
    assert shown == [
        "[node[1-3]] [W socket.cpp:207] [c10d] The hostname of the client socket cannot be "
        "retrieved. err=-3 (3 nodes)",  # attempt 2's copies: noise, shown once per job
        f"[node[1,3]] teardown: the launchers on 2 nodes printed 6 lines while they were stopped {logs}",
        # the launcher's word on the failure, before the stop: shown
        "[node4] E1127 02:12:53.320000 534 site-packages/torch/distributed/elastic/"
        "multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 539) of binary: "
        "/root/.pyenv/versions/3.11.7/bin/python3",
        f"[node[1,3-4]] teardown: the launchers on 3 nodes printed 113 lines while they were "
        f"stopped {logs}"]


def test_fold_key_leaves_out_what_differs_between_nodes() -> None:
    # torch.distributed.elastic's own log format: level+date, time, pid, file:line]
    elastic = ("W1127 02:09:04.960000 14511 site-packages/torch/distributed/elastic/"
               "multiprocessing/api.py:1028] Sending process 14693 closing signal SIGTERM")
    assert fold_key(elastic) == ("[W site-packages/torch/distributed/elastic/multiprocessing/"
                                 "api.py:1028] Sending process <pid> closing signal SIGTERM")
    for a, b in (("Connection closed by peer [10.213.1.11]:29500", "Connection closed by peer "
                  "[10.213.1.13]:41022"), ("exitcode  : -9 (pid: 20825)", "exitcode  : -9 (pid: 7)"),
                 ("Killing subprocess 16173", "Killing subprocess 16174"),
                 ("listening on port 29511", "listening on port 29512")):
        assert fold_key(a) == fold_key(b), (a, b)
    # what says something different stays different
    assert fold_key("exitcode  : -9 (pid: 1)") != fold_key("exitcode  : 1 (pid: 1)")
    assert fold_key("step 10/30 | loss 4.8") != fold_key("step 20/30 | loss 4.8")


def test_teardown_folds_launcher_lines_only_and_each_attempt_starts_afresh() -> None:
    f = LineFolder(window_s=0.0, nodes=2)
    assert f.teardown("/j/nodes/<node>/launcher.log") is None  # nothing held: no line
    f.tear_down()
    out = f.feed_node("n2", "Received 15 death signal, shutting down workers", now=0.0)
    out += f.feed("n1", 0, "checkpoint global_step86 complete", now=0.0)  # a rank: shown
    out += f.release(1.0, final=True)
    assert _texts(out) == ["[n1 r0] checkpoint global_step86 complete"]
    item = f.teardown("")
    assert item is not None and item.render() == (
        "[n2] teardown: the launchers on 1 node printed 1 line while they were stopped "
        "(not shown)")
    assert not f.tearing  # the next attempt's launcher lines are shown again
    assert _texts(f.feed_node("n2", "hello", now=2.0) + f.release(3.0, final=True)) == ["[n2] hello"]


def test_a_saves_replicas_are_one_line_and_a_failed_copy_shows_at_once() -> None:
    from clusterkit.launch.replica_events import ReplicaLedger
    from clusterkit.node.protocol import REPLICA_ALREADY_THERE, Replica

    ledger = ReplicaLedger()
    logs = "/j/nodes/<node>/rank<N>.log"

    def copy(source: int, target: str, tag: str = "step8", **kw: object) -> list[str]:
        ev = Replica("x", tag=tag, source=source, target=target, state="complete",
                     bytes=2_000_000, seconds=0.2)
        return ledger.report(Replica(**{**ev.__dict__, **kw}), 3, logs)

    assert copy(0, "node2") == [] and copy(1, "node3") == []
    failed = copy(2, "node1", tag="step16", state="failed", detail="boom (giving up, try 5/5)")
    assert failed == ["replica step16: copy of node index 2's files to node1 failed: "
                      "boom (giving up, try 5/5)"]
    assert copy(2, "node1", detail=REPLICA_ALREADY_THERE, bytes=0) == [
        "replicas step8: 3/3 nodes' files copied to another node (4.0 MB, sha256 verified; "
        "each copy in /j/nodes/<node>/launcher.log)"]
    assert copy(0, "node3") == []  # a second copy (--replicas 2): the line was said
    assert ledger.replicated("step8") == 3 and ledger.replicated("step16") == 0


def test_a_two_node_accelerate_teardown_from_the_testbed_is_one_line() -> None:
    """tests/fixtures/launcher_teardown/testbed_accelerate_node{1,2}_launcher.log: what the
    launchers printed, in the order the console got it; node2's failure report before the
    stop is shown, the 82 lines after it are one line."""
    logs = {n: (FIXTURES / f"testbed_accelerate_{n}_launcher.log").read_text().splitlines()
            for n in ("node1", "node2")}
    cause = next(i for i, ln in enumerate(logs["node2"]) if "failed (exitcode: -9)" in ln) + 1
    buf = io.StringIO()
    sink = FoldingSink(PlainSink(buf), LineFolder(window_s=0.2, world_size=4, nodes=2),
                       tick_s=0.05, launcher_logs="/j/nodes/<node>/launcher.log")
    for text in logs["node1"][:2]:
        sink.line("node1", None, text)
    for text in logs["node2"][:cause]:
        sink.line("node2", None, text)
    sink.info("node2 rank 3 failed (killed by SIGKILL): stopping the job on every node")
    sink.phase("tearing down")
    for node, lines in (("node1", logs["node1"][2:]), ("node2", logs["node2"][cause:])):
        for text in lines:
            sink.line(node, None, text)
    sink.end_attempt()
    sink.close()
    shown = buf.getvalue().splitlines()
    want = ["[node[1-2]] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator",
            "[node[1-2]] [W socket.cpp:207] [c10d] The hostname of the client socket",
            "[node2] W1127 02:24:55.089000 441 site-packages/torch/distributed/elastic/"
            "multiprocessing/api.py:1028] Sending process 444 closing signal SIGTERM",
            "[node2] E1127 02:24:55.284000 441 site-packages/torch/distributed/elastic/"
            "multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 445)",
            "[clusterkit] node2 rank 3 failed (killed by SIGKILL): stopping the job",
            "[node[1-2]] teardown: the launchers on 2 nodes printed 82 lines while they were "
            "stopped (not shown; each node's log has them: /j/nodes/<node>/launcher.log)"]
    assert len(shown) == len(want) and all(map(str.startswith, shown, want)), shown


def test_deepspeeds_runner_prints_nothing_when_stopped() -> None:
    """tests/fixtures/launcher_teardown/testbed_deepspeed_node1_launcher.log: the runner
    on node1 (pdsh to both nodes) SIGTERMed after node2's rank died: its log ends with
    the ranks' start; there is no teardown text, so no teardown line."""
    lines = (FIXTURES / "testbed_deepspeed_node1_launcher.log").read_text().splitlines()
    assert "spawned with command" in lines[-1]
    f = LineFolder(window_s=0.0, nodes=2)
    for text in lines:
        f.feed_node("node1", text, now=0.0)
    f.tear_down()
    assert f.teardown("/j/nodes/<node>/launcher.log") is None


# A clean 3 x 1 torchrun run's end (whole-suite run, 2026-11-27): one node's elastic
# agent logged a failed exit barrier as one record of several lines, all with its header.
_BARRIER = "E1127 07:11:56.570000 128 site-packages/torch/distributed/elastic/agent/server/api.py:1008] "
EXIT_BARRIER = [_BARRIER + t for t in (
    "Error waiting on exit barrier. Elapsed: 0.019173860549926758 seconds",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3/site-packages/torch/distributed/elastic/agent/server/api.py", '
    "line 994, in _exit_barrier",
    "    store_util.barrier(",
    "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely "
    "closed. Did the remote server shutdown or crash?")]


def test_a_launcher_log_record_of_several_lines_shows_its_first_line() -> None:
    f = LineFolder(window_s=1.0, nodes=3)
    out = [item for i, line in enumerate(EXIT_BARRIER)
           for item in f.feed_node("node3", line, now=0.01 * i)]
    out += f.feed_node("node3", "W1127 07:11:57.100000 128 torch/x.py:5] another record", now=0.2)
    out += f.release(5.0, final=True)
    assert _texts(out) == ["[node3] " + EXIT_BARRIER[0],
                           "[node3] W1127 07:11:57.100000 128 torch/x.py:5] another record"]
    assert f.suppressed == 4


def test_a_launchers_cpp_backtrace_shows_its_glog_line_only() -> None:
    """tests/fixtures/launcher_teardown/torchrun_exit_barrier.txt: node2's torchrun agent
    at the end of a clean 3 x 1 run on a loaded machine (node1's agent, the store's
    host, had exited): a store client's C++ backtrace (15 lines) and the exit-barrier
    record. The console shows the two headline lines; the log has the rest."""
    lines = (FIXTURES / "torchrun_exit_barrier.txt").read_text().splitlines()
    f = LineFolder(window_s=1.0, nodes=3)
    out = [item for i, line in enumerate(lines) for item in f.feed_node("node2", line, now=0.01 * i)]
    out += f.release(5.0, final=True)
    assert _texts(out) == ["[node2] " + lines[0], "[node2] " + lines[-1]]
    assert f.suppressed == len(lines) - 2
