"""clusterkit plan: the memory advisor behind a CLI verb."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clusterkit.cli.main import main
from tests.paths import REPO


def test_plan_recommends_fastest_fitting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "medium", "--nodes", "7", "--gpus-per-node", "2",
                 "--gpu-mem", "2GiB", "--cpu-mem", "16GiB"]) == 0
    out = capsys.readouterr().out
    recommended = [line for line in out.splitlines() if "recommended" in line]
    assert len(recommended) == 1 and recommended[0].startswith("ZeRO-2 ")


def test_plan_shape_from_inventory_and_json() -> None:
    # A process of its own: DeepSpeed's import-time "Setting accelerator to CPU" line went
    # to stdout and broke the JSON (an earlier import in the same process hid it).
    inv = str(REPO / "hostfiles" / "h100-2x8-ib.yaml")
    res = subprocess.run([sys.executable, "-m", "clusterkit", "plan", "-i", inv, "--model", "small",
                          "--gpu-mem", "80GiB", "--json"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert (data["nodes"], data["gpus_per_node"]) == (2, 8)
    assert data["recommended"]["name"] == "DDP"


def test_plan_nothing_fits_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "medium", "--nodes", "1", "--gpus-per-node", "1",
                 "--gpu-mem", "10MiB", "--cpu-mem", "1GiB"]) == 2
    assert "nothing fits" in capsys.readouterr().out


def test_plan_bad_size_fails_at_parse_time(capsys: pytest.CaptureFixture[str]) -> None:
    # Checked by argparse (exit 2, before the advisor imports DeepSpeed), naming the flag.
    assert main(["plan", "--nodes", "1", "--gpus-per-node", "1", "--gpu-mem", "lots"]) == 2
    (err,) = capsys.readouterr().err.splitlines()  # one line, no usage text (issue 25)
    assert "--gpu-mem" in err and "'lots' is not a size" in err and "Traceback" not in err


def test_plan_sizes_follow_the_one_rule(capsys: pytest.CaptureFixture[str]) -> None:
    # 40G is 40GiB here exactly as in doctor --ckpt-size (docs/units.md); 40GB is 40*10^9.
    args = ["plan", "--model", "small", "--nodes", "1", "--gpus-per-node", "1", "--json"]
    assert main([*args, "--gpu-mem", "40G"]) == 0
    as_g = json.loads(capsys.readouterr().out)
    assert main([*args, "--gpu-mem", "40GiB"]) == 0
    assert json.loads(capsys.readouterr().out) == as_g
    assert main([*args, "--gpu-mem", "40GB"]) == 0
    assert json.loads(capsys.readouterr().out) != as_g
