"""Issue 31 item 7 (launch): replication, spare restore and reshard as a user who is not root.

The test bed's unprivileged user (``temporary(n, user=...)``, tests/testbed/users.py) logs
in on every node with its own key, home and node-local directory, and the launcher runs
as that user too (``Testbed.user_argv``: ``setpriv`` in a private mount namespace), so
neither end of clusterkit has root. Bundled workload, 3 nodes x 1 rank, ZeRO-2,
node-local checkpoints, ``--replicas 1``; node4 is the spare.

No uninterrupted reference job (issue 37 item 6: it was 3 more rank start-ups and 48
steps, about a third of the test): the job that loses node2 is its own reference. The
test holds it (every rank SIGSTOPped, tests/helpers.hold_past_save) once a save is
complete, none newer begun and two steps after it logged (``--log-every 1``), waits for
that save's copies and destroys node2 while the ranks are stopped: the restart resumes
from exactly that save, and its losses for the steps both attempts logged (at least
the two after the save: the second needs the restored optimizer and LR state) must
equal the first attempt's, float for float (DeepSpeed's CSV monitor in the user's
shared job dir).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from clusterkit.node.contract import tag_step
from tests.helpers import (
    Console,
    Run,
    continue_ranks,
    hold_past_save,
    monitor_losses,
    node_local_saves,
    replica_manifests,
    train_argv,
    train_env,
    workload_summary,
)
from tests.testbed import Testbed, temporary
from tests.testbed.users import assert_owned_by_user

USER = "ckuser"
RING = ("node1", "node2", "node3")
LOST, SPARE = "node2", "node4"  # node index 1; its ring successor node3 holds its copy
STEPS, SAVE_EVERY = 48, 16  # three saves: the loss comes after the first or the second


def _user_launch_argv(tb: Testbed, inv: Path, job: str, *extra: str, exclude: str = "") -> list[str]:
    """``clusterkit launch`` of the bundled workload on 3 nodes (``exclude``: on the
    inventory's nodes but that one), run as the bed's user."""
    argv = train_argv(inv, job, "native", 3, 1, "node-local", STEPS,
                      ["--zero-stage", "2", "--save-every", str(SAVE_EVERY), "--replicas", "1",
                       *extra, "--", "--log-every", "1"])
    if exclude:  # no --nodes/--gpus-per-node with --exclude (the CLI refuses the mix)
        at = argv.index("--nodes")
        argv[at:at + 4] = ["--exclude", exclude]
    return tb.user_argv(argv)


def _console(tb: Testbed, argv: Sequence[str]) -> Console:
    assert tb.user is not None
    home = tb.user.home
    return Console(argv, tb.user_env(train_env(home)), home)


def _run_launch_as_user(tb: Testbed, argv: Sequence[str], timeout: float = 600) -> Run:
    run = _console(tb, argv)
    code = run.finish(timeout=timeout)
    return Run(code, run.text, workload_summary(run.text) if code == 0 else {})


def _local(tb: Testbed) -> str:
    """The user's node-local checkpoint dir, relative to the node-local mount point."""
    assert tb.user is not None
    return f"{tb.user.name}/ckpt"


@contextlib.contextmanager
def _bed(nodes: int, spare: bool) -> Iterator[tuple[Testbed, Path]]:
    with temporary(nodes, user=USER) as tb:
        assert tb.user is not None
        inv = tb.write_inventory(tb.user.home / "inv.yaml", slots=1, as_user=True)
        if spare:
            inv.write_text(inv.read_text() + f"spares: [{SPARE}]\n")
        yield tb, inv


def _run_dir(tb: Testbed, job: str) -> Path:
    """The workload's run dir: the job dir in the user's (shared) workdir."""
    assert tb.user is not None
    return tb.user.workdir / ".clusterkit" / "jobs" / job / "run"


def _run_losing_node2(tb: Testbed, argv: Sequence[str], job: str,
                      timeout: float) -> tuple[Console, str]:
    """Run ``argv`` through node2's loss after a save's copies; the finished console and
    the tag of that save."""
    run = _console(tb, argv)
    try:
        tag = _lose_node2_after_the_replicated_save(tb, run, job)
        run.finish(timeout=timeout)
    except BaseException:
        run.finish(timeout=1)
        raise
    return run, tag


def _lose_node2_after_the_replicated_save(tb: Testbed, run: Console, job: str) -> str:
    """Hold the job (every rank stopped) once a save is complete, no newer one begun and
    two steps after it logged, wait for every node's copy of that save, then destroy
    node2; that save's tag.

    The tiny model runs 16 steps in about a second and the console's lines come late on a
    loaded machine (they pass through each node's agent and SSH), so the test watches the
    completion markers on the nodes' disks and rank 0's loss CSV, not the console, and
    checks them with the ranks stopped: that save is the one the job must resume from."""
    step, pids = hold_past_save(
        run, job, len(RING), lambda: node_local_saves(tb, RING, _local(tb), job),
        lambda: next(iter(monitor_losses(_run_dir(tb, job))), {}))
    try:
        tag = f"global_step{step}"
        assert step < STEPS, f"the job ended before the loss:\n{run.text[-3000:]}"
        manifests = replica_manifests(tb, RING, job, tag, _local(tb))
        run.wait_for(lambda: all(m.exists() for m in manifests), 120, f"replicas of {tag}")
        assert_owned_by_user(tb.user, manifests)
        tb.destroy(LOST)
    finally:
        continue_ranks(pids)
    return tag


@pytest.mark.testbed
@pytest.mark.slow
def test_as_a_user_replicas_and_a_lost_node_continued_on_the_spare(
        testbed_required: None) -> None:
    """(a) the job replicates its saves, every file the user's; (b) node2 destroyed
    after a save's copies, ``--max-restarts 1 --drop-failed-nodes``: the launcher restores
    node2's part onto the spare from node3 and the job goes on exactly where the first
    attempt was (the steps both attempts logged: equal losses)."""
    with _bed(4, spare=True) as (tb, inv):
        run, tag = _run_losing_node2(tb, _user_launch_argv(tb, inv, "auto", "--max-restarts", "1",
                                               "--drop-failed-nodes"), "auto", 600)
        assert run.proc.returncode == 0, run.text[-4000:]
        assert f"restored {tag} of node index 1 ({LOST}) onto {SPARE}" in run.text, \
            run.text[-4000:]
        summary = workload_summary(run.text)
        assert summary["resumed_from"] == tag and summary["world_size"] == 3, summary
        assert summary["finished"] and summary["steps"] == STEPS, summary
        _assert_resumed_exactly(monitor_losses(_run_dir(tb, "auto")), tag_step(tag), summary)
        restored = list(tb.node_local_path(SPARE, f"{_local(tb)}/auto/{tag}").rglob("*"))
        assert restored, "nothing restored on the spare"
        # (a) every save replicated on the ring (node index 1 now on the spare), every
        # checkpoint file and copy the user's
        ring = (RING[0], SPARE, RING[2])
        final = replica_manifests(tb, ring, "auto", f"global_step{STEPS}", _local(tb))
        assert all(m.exists() for m in final), [str(m) for m in final if not m.exists()]
        assert_owned_by_user(tb.user,
                             [p for n in ring for p in tb.node_local_path(n, _local(tb)).rglob("*")])
        assert "checkpoints replicated: " in run.text, run.text[-3000:]
        print("\n".join(ln for ln in run.text.splitlines() if ln.startswith("[clusterkit]"))[-3000:])


def _assert_resumed_exactly(runs: list[dict[int, float]], resumed: int,
                            summary: dict[str, object]) -> None:
    """Two attempts in the loss CSV; the second logged from the step after ``resumed`` to
    the end, and every step both logged (at least the two after ``resumed``) has the same
    loss, float for float; the final loss is the second's last."""
    assert len(runs) == 2, [sorted(r)[:3] for r in runs]
    first, second = runs
    assert min(first) == 1 and min(second) == resumed + 1 and max(second) == STEPS, \
        (resumed, sorted(first), sorted(second))
    overlap = sorted(set(first) & set(second))
    assert overlap[:2] == [resumed + 1, resumed + 2], (resumed, sorted(first))
    assert all(first[n] == second[n] for n in overlap), [(n, first[n], second[n]) for n in overlap]
    assert summary["final_loss"] == second[STEPS], (summary, second[STEPS])
    print(f"resumed from step {resumed}: steps {overlap} equal in both attempts")


@pytest.mark.testbed
@pytest.mark.extended
def test_as_a_user_without_a_spare_the_job_reshards_onto_two_nodes(
        testbed_required: None) -> None:
    """(c) node2 destroyed after the step-16 copies, no spare: relaunched with
    ``--exclude node2``, the job gathers, converts to a universal checkpoint, pushes it
    to the 2 nodes left and finishes, all as the user."""
    with _bed(3, spare=False) as (tb, inv):
        run, tag = _run_losing_node2(tb, _user_launch_argv(tb, inv, "shrink"), "shrink", 300)
        assert run.proc.returncode != 0, run.text[-3000:]
        again = _run_launch_as_user(tb, _user_launch_argv(tb, inv, "shrink", exclude=LOST))
        assert again.code == 0, again.text[-5000:]
        for step in ("1/3 gathering it here", "2/3 converting it", "3/3 pushing"):
            assert step in again.text, again.text[-5000:]
        assert again.summary["resumed_from"] == f"{tag}_universal", again.summary
        assert again.summary["world_size"] == 2 and again.summary["finished"], again.summary
