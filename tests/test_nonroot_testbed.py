"""Issue 31 item 7 (launch): replication, spare restore and reshard as a user who is not root.

The test bed's unprivileged user (``temporary(n, user=...)``, tests/testbed/users.py) logs
in on every node with its own key, home and node-local directory, and the launcher runs
as that user too (``Testbed.user_argv``: ``setpriv`` in a private mount namespace), so
neither end of clusterkit has root. Bundled workload, 3 nodes x 1 rank, ZeRO-2,
node-local checkpoints, ``--replicas 1``; node4 is the spare.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from clusterkit.node.agent_hangs import proc_state
from clusterkit.node.contract import marker_name, tag_step
from tests.helpers import (
    Console,
    Run,
    assert_trained,
    rank_pid,
    replica_manifests,
    train_argv,
    train_env,
    workload_summary,
)
from tests.testbed import Testbed, temporary

USER = "ckuser"
RING = ("node1", "node2", "node3")
LOST, SPARE = "node2", "node4"  # node index 1; its ring successor node3 holds its copy
STEPS, SAVE_EVERY = 48, 16  # three saves: the loss comes after the first or the second
TAG = f"global_step{SAVE_EVERY}"


def _argv(tb: Testbed, inv: Path, job: str, *extra: str, exclude: str = "") -> list[str]:
    """``clusterkit launch`` of the bundled workload on 3 nodes (``exclude``: on the
    inventory's nodes but that one), run as the bed's user."""
    argv = train_argv(inv, job, "native", 3, 1, "node-local", STEPS,
                      ["--zero-stage", "2", "--save-every", str(SAVE_EVERY), "--replicas", "1",
                       *extra])
    if exclude:  # no --nodes/--gpus-per-node with --exclude (the CLI refuses the mix)
        at = argv.index("--nodes")
        argv[at:at + 4] = ["--exclude", exclude]
    return tb.user_argv(argv)


def _console(tb: Testbed, argv: Sequence[str]) -> Console:
    assert tb.user is not None
    home = tb.user.home
    return Console(argv, tb.user_env(train_env(home)), home)


def _run(tb: Testbed, argv: Sequence[str], timeout: float = 600) -> Run:
    run = _console(tb, argv)
    code = run.finish(timeout=timeout)
    return Run(code, run.text, workload_summary(run.text) if code == 0 else {})


def _local(tb: Testbed) -> str:
    """The user's node-local checkpoint dir, relative to the node-local mount point."""
    assert tb.user is not None
    return f"{tb.user.name}/ckpt"


def _owned_by_user(tb: Testbed, paths: Sequence[Path]) -> None:
    assert tb.user is not None
    owners = {p: p.stat().st_uid for p in paths}
    assert set(owners.values()) == {tb.user.uid}, owners


@contextlib.contextmanager
def _bed(nodes: int, spare: bool) -> Iterator[tuple[Testbed, Path]]:
    with temporary(nodes, user=USER) as tb:
        assert tb.user is not None
        inv = tb.write_inventory(tb.user.home / "inv.yaml", slots=1, as_user=True)
        if spare:
            inv.write_text(inv.read_text() + f"spares: [{SPARE}]\n")
        yield tb, inv


def _rank_pids(run: Console, job: str, world: int) -> list[int]:
    """Every rank's host pid, once all have started."""
    found: dict[int, int] = {}

    def all_found() -> bool:
        for rank in range(world):
            pid = found.get(rank) or rank_pid(job, rank)
            if pid is not None:
                found[rank] = pid
        return len(found) == world

    run.wait_for(all_found, 400, f"every rank of {world} in /proc")
    return [found[r] for r in range(world)]


def _signal(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _stopped(pids: Sequence[int], timeout: float = 10.0) -> None:
    """Wait until every pid is in the stopped state ('T'); fails if one ended first (the
    job ran past the save the test stops it at)."""
    deadline = time.monotonic() + timeout
    while True:
        states = {pid: proc_state(pid) for pid in pids}
        for pid, state in states.items():
            if state in ("?", "Z", "X"):
                pytest.fail(f"rank pid {pid} ended before it was stopped: the job ran past "
                            f"{TAG} while the test stopped it")
        if all(s in ("T", "t") for s in states.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"ranks not stopped after SIGSTOP: {states}")
        time.sleep(0.05)


def _node_dir(tb: Testbed, node: str, job: str) -> Path:
    return tb.node_local_path(node, f"{_local(tb)}/{job}")


def _complete_on_disk(tb: Testbed, job: str, tag: str) -> bool:
    """Every node's completion marker of ``tag`` is in its node-local tag dir."""
    return all((_node_dir(tb, node, job) / tag / marker_name(i)).is_file()
               for i, node in enumerate(RING))


def _newest_complete_on_disk(tb: Testbed, job: str) -> str:
    tags = {p.name for p in _node_dir(tb, RING[0], job).glob("global_step*")}
    done = [t for t in tags if _complete_on_disk(tb, job, t)]
    assert done, f"no complete checkpoint of {job} on disk"
    return max(done, key=tag_step)


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
    """Stop the ranks as soon as ``TAG``'s save is complete on disk, wait for every node's
    copy of the newest complete save, then destroy node2; that save's tag.

    The tiny model runs 16 steps in about a second and the console's lines come late on a
    loaded machine (they pass through each node's agent and SSH), so the test watches the
    completion markers on the nodes' disks, not the console, and checks that each rank is
    stopped: the newest complete save on disk is the one the job must resume from."""
    pids = _rank_pids(run, job, len(RING))
    run.wait_for(lambda: _complete_on_disk(tb, job, TAG), 400, f"{TAG} on disk", poll=0.02)
    _signal(pids, signal.SIGSTOP)
    try:
        _stopped(pids)
        tag = _newest_complete_on_disk(tb, job)
        assert tag != f"global_step{STEPS}", f"the job ended before the loss:\n{run.text[-3000:]}"
        manifests = replica_manifests(tb, RING, job, tag, _local(tb))
        run.wait_for(lambda: all(m.exists() for m in manifests), 120, f"replicas of {tag}")
        _owned_by_user(tb, manifests)
        tb.destroy(LOST)
    finally:
        _signal(pids, signal.SIGCONT)
    return tag


@pytest.mark.testbed
@pytest.mark.slow
def test_as_a_user_replicas_and_a_lost_node_continued_on_the_spare(
        testbed_required: None) -> None:
    """(a) the uninterrupted run replicates its saves, every file the user's; (b) node2
    destroyed after the step-16 copies, ``--max-restarts 1 --drop-failed-nodes``: the
    launcher restores node2's part onto the spare from node3 and ends on (a)'s loss."""
    with _bed(4, spare=True) as (tb, inv):
        ref = _run(tb, _argv(tb, inv, "ref"))
        assert_trained(ref, STEPS, 3)
        manifests = [m for tag in (TAG, f"global_step{STEPS}")
                     for m in replica_manifests(tb, RING, "ref", tag, _local(tb))]
        assert all(m.exists() for m in manifests), [str(m) for m in manifests if not m.exists()]
        _owned_by_user(tb, manifests)
        files = [p for n in RING for p in tb.node_local_path(n, _local(tb)).rglob("*")]
        _owned_by_user(tb, files)
        assert "checkpoints replicated: " in ref.text, ref.text[-3000:]

        run, tag = _run_losing_node2(tb, _argv(tb, inv, "auto", "--max-restarts", "1",
                                               "--drop-failed-nodes"), "auto", 600)
        assert run.proc.returncode == 0, run.text[-4000:]
        assert f"restored {tag} of node index 1 ({LOST}) onto {SPARE}" in run.text, \
            run.text[-4000:]
        summary = workload_summary(run.text)
        assert summary["resumed_from"] == tag and summary["world_size"] == 3, summary
        assert summary["final_loss"] == ref.summary["final_loss"], (summary, ref.summary)
        restored = list(tb.node_local_path(SPARE, f"{_local(tb)}/auto/{tag}").rglob("*"))
        assert restored, "nothing restored on the spare"
        _owned_by_user(tb, restored)


@pytest.mark.testbed
@pytest.mark.extended
def test_as_a_user_without_a_spare_the_job_reshards_onto_two_nodes(
        testbed_required: None) -> None:
    """(c) node2 destroyed after the step-16 copies, no spare: relaunched with
    ``--exclude node2``, the job gathers, converts to a universal checkpoint, pushes it
    to the 2 nodes left and finishes, all as the user."""
    with _bed(3, spare=False) as (tb, inv):
        run, tag = _run_losing_node2(tb, _argv(tb, inv, "shrink"), "shrink", 300)
        assert run.proc.returncode != 0, run.text[-3000:]
        again = _run(tb, _argv(tb, inv, "shrink", exclude=LOST))
        assert again.code == 0, again.text[-5000:]
        for step in ("1/3 gathering it here", "2/3 converting it", "3/3 pushing"):
            assert step in again.text, again.text[-5000:]
        assert again.summary["resumed_from"] == f"{tag}_universal", again.summary
        assert again.summary["world_size"] == 2 and again.summary["finished"], again.summary
