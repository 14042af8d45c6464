"""clusterkit plan: the memory advisor behind a CLI verb."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusterkit.cli.main import main

REPO = Path(__file__).resolve().parent.parent


def test_plan_recommends_fastest_fitting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "medium", "--nodes", "7", "--gpus-per-node", "2",
                 "--gpu-mem", "2GiB", "--cpu-mem", "16GiB"]) == 0
    out = capsys.readouterr().out
    recommended = [line for line in out.splitlines() if "recommended" in line]
    assert len(recommended) == 1 and recommended[0].startswith("ZeRO-2 ")


def test_plan_shape_from_inventory_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    inv = str(REPO / "hostfiles" / "h100-2x8-ib.yaml")
    assert main(["plan", "-i", inv, "--model", "small", "--gpu-mem", "80GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["nodes"], data["gpus_per_node"]) == (2, 8)
    assert data["recommended"]["name"] == "DDP"


def test_plan_nothing_fits_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "medium", "--nodes", "1", "--gpus-per-node", "1",
                 "--gpu-mem", "10MiB", "--cpu-mem", "1GiB"]) == 2
    assert "nothing fits" in capsys.readouterr().out


def test_plan_bad_size_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--nodes", "1", "--gpus-per-node", "1", "--gpu-mem", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clusterkit: error:") and err.count("\n") == 1
