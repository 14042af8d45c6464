"""Issue 31 item 3 on the test bed: a user's own DeepSpeed script (docs/examples/train.py)
on fewer nodes after a node is lost for good. 4 x 1 ZeRO-2, node-local, --replicas 1:
the job saves step4 (node3's part replicated onto node4) and ends; node3 is destroyed;
the relaunch with --exclude node3 gathers step4 (node3's part from its replica), converts
it, and the script loads step4_universal on 3 ranks: its fp32 weights right after the
load equal the consolidated step4 weights, and the job finishes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, Run, snapshot_tag, train_env, workload_summary
from tests.testbed import temporary

TRAIN = REPO / "docs" / "examples" / "train.py"
NODES = ("node1", "node2", "node3", "node4")
LOST = "node3"  # node index 2; its ring successor node4 holds its copy
TAG = "step4"


def _universal_launch_argv(inv: Path, job: str, steps: int, *extra: str, script: tuple[str, ...] = ()
            ) -> list[str]:
    return [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id", job,
            "--storage", "node-local", "--zero-stage", "2", "--steps", "12",
            "--replicas", "1", "--grace", "2", "--skip-checks", *extra, str(TRAIN), "--",
            "--steps", str(steps), "--save-every", "4", *script]


def _run_training_summary(argv: list[str], tmp: Path) -> Run:
    proc = subprocess.run(argv, capture_output=True, text=True, env=train_env(tmp), cwd=tmp,
                          timeout=900)
    text = proc.stdout + proc.stderr
    return Run(proc.returncode, text, workload_summary(text) if proc.returncode == 0 else {})


@pytest.mark.testbed
@pytest.mark.extended
def test_a_users_script_goes_on_on_three_nodes(testbed_required: None, tmp_path: Path) -> None:
    import torch

    from clusterkit.checkpoints.convert.consolidate import consolidate, load_state_dict_dir

    with temporary(4) as tb:
        inv = tb.write_inventory(tmp_path / "inv.yaml", slots=1)
        first = _run_training_summary(_universal_launch_argv(inv, "ushrink", 8, "--nodes", "4"), tmp_path)
        assert first.code == 0 and first.summary["world_size"] == 4, first.text[-4000:]
        before = snapshot_tag(tb, NODES, "ushrink", TAG, tmp_path / "before")
        tb.destroy(LOST)
        loaded = tb.shared_dir / "user-loaded-weights.pt"
        again = _run_training_summary(_universal_launch_argv(inv, "ushrink", 12, "--exclude", LOST,
                             script=("--dump-loaded-weights", str(loaded))), tmp_path)
        assert again.code == 0, again.text[-5000:]
        for line in ("1/3 gathering it here", "2/3 converting it", "3/3 pushing",
                     "world size 4 -> 3: your script loads step4_universal",
                     "data order: your script owns it"):
            assert line in again.text, again.text[-5000:]
        s = again.summary
        assert (s["resumed_from"], s["world_size"], s["steps_run"], s["finished"]) == \
            ("step4_universal", 3, 8, True), s
        consolidate(str(before), TAG, "fp32")
        want = load_state_dict_dir(str(before / f"{TAG}-fp32"))
        got = torch.load(loaded, map_location="cpu")
        assert set(got) == set(want), (sorted(got), sorted(want))
        for name, tensor in got.items():
            assert torch.equal(tensor, want[name]), name
        print("\n".join(ln for ln in again.text.splitlines()
                        if "[clusterkit]" in ln and "r0]" not in ln)[-3000:])


@pytest.mark.testbed
@pytest.mark.extended
def test_a_users_script_goes_on_on_three_nodes_on_its_own(testbed_required: None,
                                                          tmp_path: Path) -> None:
    """--max-restarts 1 --drop-failed-nodes, no spare: node3 destroyed while the script
    trains, after its step400 part is replicated; the launcher's own restart drops node3,
    reshards step400 and the script goes on from step400_universal on 3 ranks."""
    from clusterkit.node.contract import REPLICA_MANIFEST
    from tests.helpers import Console, lose_node_mid_run

    job, tag = "uauto", "step400"  # ~35 ms a step on the bed's 2 cores: ~14 s between saves
    with temporary(4) as tb:
        inv = tb.write_inventory(tmp_path / "inv.yaml", slots=1)
        argv = _universal_launch_argv(inv, job, 1200, "--nodes", "4", "--max-restarts", "1",
                       "--drop-failed-nodes")
        argv[argv.index("--save-every") + 1] = "400"
        run = Console(argv, train_env(tmp_path), tmp_path)
        replica = tb.node_local_path("node4", f"ckpt/{job}.replicas/node2/{tag}/{REPLICA_MANIFEST}")

        def in_time() -> None:
            assert "checkpoint step800 complete" not in run.text, "too fast: node3 lost too late"

        code = lose_node_mid_run(tb, run, LOST, [
            (lambda: f"checkpoint {tag} complete" in run.text, 600, tag),
            (replica.exists, 120, f"node3's replica of {tag}")], 900, in_time)
        text = run.text
        assert code == 0, text[-5000:]
        for line in (f"no spare for {LOST}", "going on with fewer nodes",
                     f"resharding {tag} (4 nodes) for 3 nodes, 3 ranks",
                     "node index 2 from its replica on node4",
                     f"world size 4 -> 3: your script loads {tag}_universal",
                     "restarting (attempt 2 of 2)"):
            assert line in text, (line, text[-5000:])
        s = workload_summary(text)
        assert (s["resumed_from"], s["world_size"], s["steps_run"], s["finished"]) == \
            (f"{tag}_universal", 3, 800, True), s
        print("\n".join(ln for ln in text.splitlines() if "[clusterkit]" in ln and "r0]" not in ln)
              [-3000:])
