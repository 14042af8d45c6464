"""The console of an HF Trainer run under ``clusterkit launch`` on the test bed (issue
38 item 5): tests/programs/hf_trainer.py (run_clm.py-style) on 3 nodes x 1 rank, ZeRO-2
with an all-"auto" ds_config, node-local storage, tqdm on (the default), HF's logging on
each node's first rank (its default, log_on_each_node: every rank here). The lines
besides the loss lines fit :data:`BUDGET` (tests/test_console_library.py replays a
recorded run through the same folding; this is the live path: agents, torchrun's tee)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HF_DS_AUTO, HF_TRAINER, train_env
from tests.testbed import Testbed

NODES = 3
# 20 steps, 2 saves, 3 ranks on 3 nodes: the start-up (about 25 lines: the settings dump
# as one line, the library warnings once), clusterkit's own lines (the agents, the
# profile, each save's replicas), the bar's quarters, a few lines a save: one screen.
BUDGET = 60
LOSS = re.compile(r"\{'(?:loss|eval_loss|train_runtime)'|\b(?:train|eval)_loss\s+=|"
                  r"final loss at step")

pytestmark = [pytest.mark.testbed(nodes=NODES), pytest.mark.slow]  # ~75 s: a 3-rank HF run


def test_an_hf_trainer_runs_console_fits_its_budget(testbed: Testbed, tmp_path: Path) -> None:
    testbed.ensure(NODES)
    nodes = testbed.nodes[:NODES]
    ds = tmp_path / "ds_config_z2.json"
    ds.write_text(json.dumps(HF_DS_AUTO, indent=1))
    inv = testbed.write_inventory(tmp_path / "inv.yaml", nodes, slots=1)
    out = str(testbed.local_mountpoint / "ckpt" / "hfconsole")
    argv = [sys.executable, "-m", "clusterkit", "launch", "-i", str(inv), "--job-id",
            "hfconsole", "--nodes", "3", "--storage", "node-local", "--replicas", "1",
            "--skip-checks", str(HF_TRAINER), "--output_dir", out, "--deepspeed", str(ds),
            "--use_cpu", "--max_steps", "20", "--save_steps", "10", "--logging_steps", "5",
            "--per_device_train_batch_size", "4", "--report_to", "none",
            "--learning_rate", "1e-3", "--seed", "7"]
    run = subprocess.run(argv, cwd=tmp_path, env=train_env(tmp_path), capture_output=True,
                         text=True, timeout=900)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    other = [ln for ln in lines if not LOSS.search(ln)]
    print(f"--- {len(lines)} lines, {len(other)} besides the loss lines (budget {BUDGET})")
    print("\n".join(lines))
    assert sum("{'loss'" in ln for ln in lines) == 4, run.stdout  # steps 5, 10, 15, 20
    assert not any("%|" in ln and "{'" in ln for ln in lines)  # no bar glued to a loss
    assert len(other) <= BUDGET, "\n".join(other)
