"""Issue 38 on the test bed for an ordinary accelerate program
(tests/programs/accelerate_save_state.py: ``Accelerator`` with ``DeepSpeedPlugin(zero_stage=2)``,
``save_state`` every 10 steps, ``load_state`` of the newest on start), unmodified, on 3 CPU
nodes x 1 rank, node-local /scratch, ``--replicas 1``, a spare.

The test bed's nodes have no GPU: accelerate 1.15 alone would make every rank process 0 of
1 (node/hooks/accelerate_cpu.py); clusterkit's hook (Profile.cpu_hook) gives them gloo. Each
test checks that the world really is 3 (``random_states_R.pkl`` of rank R on R's node).

* kill -9 of rank 1 at step 15, after step_10 is saved: the restart's ranks load step_10
  by themselves, log steps 11-15 with the very losses the killed attempt logged for them
  (restored weights, AdamW state and RNG: no reference run needed) and go on to step 20.
* node2 destroyed after step_10 is replicated (--drop-failed-nodes, spare node4): node2's
  part restored onto node4, the same end on the spare.
* the same with no spare (extended): the job goes on with node1 and node3, step_N
  converted to DeepSpeed's universal checkpoint in the place of pytorch_model, and the
  program's load_state resumes from it on 2 ranks; and (extended) a rank of that 2-node
  attempt killed before its next save: the next attempt resumes from the conversion again.

The reference: the same program, 3 ranks under torchrun on this machine, with what the job's
ranks get (the hook first on PYTHONPATH, ACCELERATE_DEEPSPEED_CONFIG_FILE at the node-local
library config); without the hook its numbers are those of a world of one.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from clusterkit.plan.profile import cpu_hook_source
from clusterkit.spec.programs import (
    ACCELERATE_CONFIG_ENV,
    CPU_HOOK_FILE,
    DERIVED_DS_CONFIG,
    LIBRARY_DS_CONFIG,
)
from tests.helpers import (
    REPO,
    Console,
    attempts_agree,
    continue_ranks,
    free_port,
    hold_past_save,
    lose_node_mid_run,
    reference_run,
    replicated_everywhere,
    train_env,
    went_on_with_fewer,
)
from tests.testbed import temporary

if TYPE_CHECKING:
    from tests.testbed.core import Testbed

PROGRAM = REPO / "tests" / "programs" / "accelerate_save_state.py"
FINAL = re.compile(r"final loss at step (\d+): ([0-9.]+)")
STEP_LOSS = re.compile(r"\bstep (\d+) loss ([0-9.]+)")
STEPS = 20


def _args(out: str, *extra: str) -> list[str]:
    return [str(PROGRAM), "--output_dir", out, "--steps", str(STEPS), "--save_every", "10",
            *extra]


def _accelerate_reference(tmp: Path) -> str:
    """The uninterrupted run, 3 CPU ranks here, given what the job's ranks are given."""
    hook = tmp / "ref-hook"
    hook.mkdir()
    (hook / CPU_HOOK_FILE).write_text(cpu_hook_source())
    config = tmp / "ref-ds.json"
    config.write_text(json.dumps(LIBRARY_DS_CONFIG))
    argv = ["env", f"PYTHONPATH={hook}:{REPO}", f"{ACCELERATE_CONFIG_ENV}={config}",
            sys.executable, "-m", "torch.distributed.run", f"--log-dir={tmp}/tr", "--nnodes",
            "1", "--nproc-per-node", "3", "--master_addr", "127.0.0.1", "--master_port",
            str(free_port()), *_args(str(tmp / "ref-out"))]
    text = reference_run(argv, tmp, lambda out: any(int(step) == STEPS
                                                    for step, _ in FINAL.findall(out)))
    return str(FINAL.findall(text)[-1][1])


def _launch_argv(inv: Path, job: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id", job,
            "--nodes", "3", "--storage", "node-local", "--replicas", "1", "--grace", "2",
            "--skip-checks", *args]


def _world_of_three(tb: Testbed, out: str, nodes: dict[str, int]) -> None:
    """Rank R's random state in step_20 on its node: accelerate saw 3 processes."""
    for node, rank in nodes.items():
        res = tb.exec(node, ["ls", f"{out}/step_20"])
        assert f"random_states_{rank}.pkl" in res.stdout, (node, res.stdout, res.stderr)


PROFILE_LINE = ("program profile: accelerate (its source calls accelerate's save_state); "
                "resumes by itself; on CPU ranks (node[1-3]) accelerate picks no process group")


@pytest.mark.testbed
@pytest.mark.slow  # a 3-rank training, killed and restarted
def test_accelerate_killed_rank_resumes_from_the_newest_complete_save(
        testbed_required: None, tmp_path: Path) -> None:
    with temporary(4) as tb:
        inv = tb.write_inventory(tmp_path / "inv.yaml", slots=1)
        inv.write_text(inv.read_text() + "spares: [node4]\n")
        out = str(tb.local_mountpoint / "ckpt" / "acckill")
        marker = tb.shared_dir / "acckill-crashed"
        # two restarts: the kill's, and room for torch's exit-time abort (helpers.EXIT_ABORT)
        run = subprocess.run(
            _launch_argv(inv, "acckill", "--max-restarts", "2",
                         *_args(out, "--crash_at_step", "15", "--crash_rank", "1",
                                "--crash_once", str(marker))),
            cwd=tmp_path, env=train_env(tmp_path), capture_output=True, text=True, timeout=900)
        text = run.stdout + run.stderr
        assert run.returncode == 0, text[-5000:]
        assert marker.exists(), text[-3000:]  # the rank was killed
        assert PROFILE_LINE in text, text[:3000]
        assert "restarting (attempt 2 of 3): accelerate resumes by itself; clusterkit readies " \
            "the newest checkpoint complete on every node" in text, text[-5000:]
        assert "resumed from step_10" in text, text[-5000:]  # the program's own load_state
        got = FINAL.findall(text)
        assert got and int(got[-1][0]) == STEPS, text[-3000:]
        attempts_agree([(int(s), loss) for s, loss in STEP_LOSS.findall(text)], range(11, 16))
        _world_of_three(tb, out, {"node1": 0, "node2": 1, "node3": 2})


@pytest.mark.testbed
@pytest.mark.extended
def test_accelerate_node_lost_goes_on_on_the_spare(testbed_required: None,
                                                   tmp_path: Path) -> None:
    with temporary(4) as tb:
        inv = tb.write_inventory(tmp_path / "inv.yaml", slots=1)
        inv.write_text(inv.read_text() + "spares: [node4]\n")
        out = str(tb.local_mountpoint / "ckpt" / "acclost")
        argv = _launch_argv(inv, "acclost", "--max-restarts", "2", "--drop-failed-nodes",
                            *_args(out, "--step_sleep", "1.5"))
        run = Console(argv, train_env(tmp_path), tmp_path)
        replicated = "replicas step_10: 3/3"
        code = lose_node_mid_run(tb, run, "node2", [(lambda: replicated in run.text, 600,
                                                     replicated)], 900)
        text = run.text
        assert code == 0, text[-5000:]
        assert "node index 1 (node2)" in text and "node4" in text, text[-5000:]
        assert re.search(r"resumed from step_(10|20)", text), text[-5000:]
        got = FINAL.findall(text)
        assert got and int(got[-1][0]) == STEPS, text[-3000:]
        _world_of_three(tb, out, {"node1": 0, "node4": 1, "node3": 2})
    assert got[-1][1] == _accelerate_reference(tmp_path)


def _goes_on_with_fewer_nodes(tb: Testbed, tmp_path: Path, job: str, restarts: int,
                              after_loss: Callable[[Console], object] | None = None
                              ) -> tuple[str, int]:
    """3 x 1, no spare: node2 destroyed after step_10 is replicated, ``--max-restarts
    RESTARTS --drop-failed-nodes``, then ``after_loss(run)`` while the job goes on. The
    restart goes on with node1 and node3: step_N is gathered (node2's part from its
    replica), its pytorch_model converted to DeepSpeed's universal checkpoint in its own
    place (the old world's tag kept as pytorch_model.set-aside on both nodes), the
    attempt's ACCELERATE_DEEPSPEED_CONFIG_FILE gets load_universal, and the program's own
    load_state resumes from it on 2 ranks and trains to the last step with finite losses;
    step_20 is saved by a world of 2. Returns the console from the restart on (what the
    2-node attempts printed) and N."""
    inv = tb.write_inventory(tmp_path / "inv.yaml", slots=1)
    out = str(tb.local_mountpoint / "ckpt" / job)
    argv = _launch_argv(inv, job, "--max-restarts", str(restarts), "--drop-failed-nodes",
                        *_args(out, "--step_sleep", "1.5"))
    run = Console(argv, train_env(tmp_path), tmp_path)
    replicated = "replicas step_10: 3/3"
    code = lose_node_mid_run(tb, run, "node2", [(lambda: replicated in run.text, 600,
                                                 replicated)], 900,
                             after_loss=None if after_loss is None else lambda: after_loss(run))
    text = run.text
    after = went_on_with_fewer(code, text, "node2")
    found = re.search(r"resharding step_(10|20) \(3 nodes\) for 2 nodes", after)
    assert found, text[-6000:]
    n = int(found.group(1))
    assert "accelerate's load_state loads" in after, text[-6000:]
    assert "checkpoint.load_universal on" in after, text[-6000:]
    assert f"resumed from step_{n}" in after, text[-6000:]  # the program's own load_state
    losses = [(int(s), float(loss)) for s, loss in STEP_LOSS.findall(after)]
    assert losses and all(s > n for s, _ in losses), (losses, text[-6000:])
    assert all(math.isfinite(loss) for _, loss in losses), losses
    got = FINAL.findall(after)
    assert got and int(got[-1][0]) == STEPS, text[-6000:]
    # The converted step_N is finished on both nodes by its conversion's files, not by
    # the new ranks' shards (node/replicas/done.py): each node's copy went to the other.
    replicated_everywhere(after, f"step_{n}", 2)
    for node in ("node1", "node3"):
        res = tb.exec(node, ["cat", f"{out}/step_{n}/latest_universal",
                             f"{out}/step_{n}/pytorch_model/clusterkit-universal.json"])
        assert res.stdout.startswith("pytorch_model\n"), (node, res.stdout, res.stderr)
        assert f'"source_tag": "step_{n}/pytorch_model.set-aside"' in res.stdout, res.stdout
        kept = tb.exec(node, ["ls", f"{out}/step_{n}/pytorch_model.set-aside"])
        assert "optim_states.pt" in kept.stdout, (node, kept.stdout, kept.stderr)
    # step_20 was saved by a world of 2: rank R's random state on its node
    for node, rank in (("node1", 0), ("node3", 1)):
        res = tb.exec(node, ["ls", f"{out}/step_20"])
        assert f"random_states_{rank}.pkl" in res.stdout, (node, res.stdout)
        assert "random_states_2.pkl" not in res.stdout, (node, res.stdout)
    return after, n


@pytest.mark.testbed
@pytest.mark.extended
def test_accelerate_node_lost_goes_on_with_fewer_nodes(testbed_required: None,
                                                        tmp_path: Path) -> None:
    """No spare: node2 destroyed after step_10 is replicated, --max-restarts 1
    --drop-failed-nodes; the job goes on on 2 nodes from step_10 converted in its place
    (_goes_on_with_fewer_nodes)."""
    with temporary(3) as tb:
        _goes_on_with_fewer_nodes(tb, tmp_path, "accfew", 1)


CONVERTED_AGAIN = ("step_10: resuming from its DeepSpeed tag converted by the reshard "
                   "(latest_universal), checkpoint.load_universal on for this attempt")


@pytest.mark.testbed
@pytest.mark.extended
def test_accelerate_resharded_then_killed_resumes_from_the_conversion_again(
        testbed_required: None, tmp_path: Path) -> None:
    """The job above with one more restart (--max-restarts 2), and in its 2-node attempt,
    after it resumed from the converted step_10 and logged steps 11 and 12, before its
    next save (step_20), rank 1 (node3) killed with SIGKILL. step_10 then holds the
    conversion as pytorch_model and the old world's tag as pytorch_model.set-aside: the
    next attempt must resume from the conversion again, with checkpoint.load_universal
    still on in its derived config (jobs/reshard.converted_inside, jobs/recover.py), not
    from step 0 and not from the set-aside; it logs the steps the killed attempt logged
    with the very same losses (same conversion, RNG states and data shards) and trains to
    the end."""
    job = "accfewkill"
    with temporary(3) as tb:
        out = str(tb.local_mountpoint / "ckpt" / job)

        def kill_before_the_next_save(run: Console) -> None:
            """Both ranks held (SIGSTOP) with step_10 the newest save begun anywhere and
            steps 11-12 logged: rank 1 killed, rank 0 let go (it fails on rank 1)."""
            step, pids = hold_past_save(run, job, 2, lambda: _newest_saves(tb, out),
                                        lambda: _resharded_losses(run.text))
            try:
                assert step == 10, (step, run.text[-4000:])
                os.kill(pids[1], signal.SIGKILL)
            finally:
                continue_ranks(pids)

        after, n = _goes_on_with_fewer_nodes(tb, tmp_path, job, 2,
                                             after_loss=kill_before_the_next_save)
        assert n == 10, after[-6000:]
        killed, said, last = after.partition(CONVERTED_AGAIN)
        assert said, after[-6000:]
        assert "resumed from step_10" in killed and "resumed from step_10" in last, after[-6000:]
        # the killed attempt's steps (11, 12 and what it logged after), all trained again
        # from the same state: the same losses, float for float as printed
        first = [int(s) for s, _ in STEP_LOSS.findall(killed)]
        assert first[:2] == [11, 12] and max(first) < STEPS, (first, after[-6000:])
        attempts_agree([(int(s), loss) for s, loss in STEP_LOSS.findall(after)], first)
        redone = [int(s) for s, _ in STEP_LOSS.findall(last)]
        assert redone == list(range(11, STEPS + 1)), (redone, after[-6000:])
        # the last attempt's config (the shared job dir's, ACCELERATE_DEEPSPEED_CONFIG_FILE)
        config = json.loads((tb.root / "work" / ".clusterkit" / "jobs" / job / DERIVED_DS_CONFIG)
                            .read_text())
        assert config["checkpoint"]["load_universal"] is True, config
        print("\n".join(ln for ln in after.splitlines() if "clusterkit" in ln
                        or STEP_LOSS.search(ln) or "resumed from" in ln)[-6000:])


def _newest_saves(tb: Testbed, out: str) -> tuple[int, int]:
    """(the newest step_N on any of node1 and node3, the newest on both): a save begun
    anywhere, one the 2-node attempts hold everywhere (the converted step_10, then
    step_20)."""
    newest = [max((int(m.group(1)) for d in tb.node_local_path(node, out).glob("step_*")
                   if (m := re.fullmatch(r"step_(\d+)", d.name))), default=0)
              for node in ("node1", "node3")]
    return max(newest), min(newest)


def _resharded_losses(text: str) -> dict[int, float]:
    """The losses the 2-node attempt logged so far: its rank 0's console lines after its
    load_state (a late line of the 3-node attempt's is not one of them)."""
    after = text.partition("going on with fewer nodes")[2].partition("resumed from step_")[2]
    return {int(s): float(loss) for s, loss in STEP_LOSS.findall(after)}
