"""`inventory import-hostfile`: slots are GPUs, hosts fold into ranges, placeholders for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterkit.cli.main import main
from clusterkit.hostfile import inventory_yaml_from_hostfile, parse_hostfile
from clusterkit.inventory import load_inventory, parse_inventory

A800 = "".join(f"node{i} slots=2\n" for i in range(1, 8))


def _fill(text: str) -> str:
    """What the user adds after importing: addresses, python, workdir, a checkpoint dir."""
    return (text.replace("  # python: ", "  python: ").replace("  # workdir: ", "  workdir: ")
            .replace("  # checkpoint:", "  checkpoint:")
            .replace("  #   local_dir: ", "    local_dir: ")
            .replace("    # address: 10.0.0.[11-17]   (default: the host name)",
                     "    address: 10.0.0.[11-17]"))


def test_reference_hostfile_becomes_one_gpu_range_with_placeholders() -> None:
    text = inventory_yaml_from_hostfile(parse_hostfile(A800), "hostfile")
    assert "  node[1-7]:\n" in text and "    gpus: 2   # from slots=2\n" in text
    assert "means N GPUs" in text and "--cpu" in text
    for placeholder in ("# python:", "# workdir:", "# checkpoint:", "# address:"):
        assert placeholder in text
    inv = parse_inventory(text, "<t>")
    assert [(h.name, h.gpus, h.slots, h.address) for h in inv.hosts][-1] == ("node7", 2, 2, "node7")


def test_cpu_slots_and_runs_that_cannot_fold() -> None:
    pool = parse_hostfile("a slots=4\nnode01 slots=2\nnode02 slots=2\nnode3 slots=1\nnode9 slots=2\n")
    text = inventory_yaml_from_hostfile(pool, cpu=True)
    assert "gpus:" not in text.split("hosts:")[1]
    inv = parse_inventory(text, "<t>")
    assert [(h.name, h.slots, h.gpus) for h in inv.hosts] == [
        ("a", 4, 0), ("node01", 2, 0), ("node02", 2, 0), ("node3", 1, 0), ("node9", 2, 0)]
    assert "  node[01-02]:\n" in text


def test_import_then_fill_gives_a_bf16_gpu_plan_and_an_sbatch_asking_2_gpus(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text(A800)
    out = tmp_path / "clusterkit.yaml"
    assert main(["inventory", "import-hostfile", str(hf), "-o", str(out)]) == 0
    out.write_text(_fill(out.read_text()))
    inv = load_inventory(out)
    assert [h.address for h in inv.hosts] == [f"10.0.0.{i}" for i in range(11, 18)]
    capsys.readouterr()
    assert main(["sbatch", "-i", str(out), "--dry-run", "--job-id", "imp"]) == 0
    printed = capsys.readouterr()
    assert "#SBATCH --gpus-per-node=2" in printed.out
    assert ", bf16," in printed.out + printed.err  # the plan's summary line


def test_slots_zero_is_refused_naming_its_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25: `slots=0` became a 1-slot CPU node; DeepSpeed itself gives it two meanings
    (a host with no rank, or none at all once --include/--exclude is given): refused."""
    hf = tmp_path / "hostfile"
    hf.write_text("node1 slots=2\nnode2 slots=0\n")
    out = tmp_path / "inv.yaml"
    assert main(["inventory", "import-hostfile", str(hf), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert f"{hf}:2: host 'node2' has slots=0" in err and "delete the line" in err
    assert not out.exists()
    for argv in (["inventory", "import-hostfile", str(hf), "--cpu"],
                 ["launch", "--dry-run", "--hostfile", str(hf)]):
        assert main(argv) == 2
        assert f"{hf}:2: host 'node2' has slots=0" in capsys.readouterr().err
