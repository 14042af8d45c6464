"""`clusterkit sync` and `clusterkit nodes install` on local virtual nodes (no test bed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterkit.cli.main import main
from clusterkit.sync.source import Ignore, manifest
from tests.synchelpers import sync_verb


def _write_local_inventory(tmp_path: Path, **defaults: str) -> Path:
    lines = ["schema_version: 1", "defaults:", "  transport: local"]
    lines += [f"  {k}: {v}" for k, v in defaults.items()]
    lines += ["hosts:", "  v0: {}"]
    path = tmp_path / "inv.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sync_moves_only_changed_files_honours_ignore_and_delete(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "proj" / "code"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("print('train')\n")
    (src / "pkg" / "model.py").write_text("W = 1\n")
    (src / "data").mkdir()
    (src / "data" / "big.bin").write_bytes(b"x" * 1000)
    (src / "run.log").write_text("log\n")
    (src / ".clusterkitignore").write_text("data/\n*.log\n!keep.log\n")
    (src / "keep.log").write_text("kept\n")
    work = tmp_path / "node-work"
    inv = _write_local_inventory(tmp_path, workdir=str(work))
    out = sync_verb(src.parent, src.name, inv, capsys)[0]
    dest = work / "code"  # same path relative to the launcher's cwd, under the workdir
    assert "v0: 4 file(s) sent" in out
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        ".clusterkit-sync/manifest.json", ".clusterkitignore", "keep.log", "pkg/model.py",
        "train.py"]
    assert os.stat(dest / "train.py").st_mtime == os.stat(src / "train.py").st_mtime
    # Nothing changed: nothing moves.
    assert "v0: 0 file(s) sent (0 bytes, verified), 4 unchanged" in sync_verb(src.parent, src.name, inv,
                                                                              capsys)[0]
    # One file changed: only it moves.
    (src / "pkg" / "model.py").write_text("W = 2\n")
    assert "v0: 1 file(s) sent (6 bytes, verified), 3 unchanged" in sync_verb(src.parent, src.name, inv,
                                                                              capsys)[0]
    assert (dest / "pkg" / "model.py").read_text() == "W = 2\n"
    # Same content, new mtime: the sha256 says equal, nothing travels, the mtime follows.
    os.utime(src / "train.py", (time.time() + 5, time.time() + 5))
    assert "v0: 0 file(s) sent (0 bytes, verified), 4 unchanged" in sync_verb(src.parent, src.name, inv,
                                                                              capsys)[0]
    assert os.stat(dest / "train.py").st_mtime_ns == os.stat(src / "train.py").st_mtime_ns
    # A file only on the node stays unless --delete.
    (dest / "stale.py").write_text("old\n")
    assert "1 extra file(s) kept" in sync_verb(src.parent, src.name, inv, capsys)[0]
    assert "1 deleted" in sync_verb(src.parent, src.name, inv, capsys, "--delete")[0]
    assert not (dest / "stale.py").exists()


def test_ignore_rules_follow_gitignore() -> None:
    ig = Ignore.parse("*.pyc\n/build/\ndocs/**/*.tmp\n!important.pyc\n")
    assert ig.ignored("a/b.pyc", False) and not ig.ignored("important.pyc", False)
    assert ig.ignored("build", True) and not ig.ignored("src/build", True)
    assert ig.ignored("docs/x/y.tmp", False) and ig.ignored("docs/y.tmp", False)


def test_sync_of_a_missing_dir_is_one_line(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sync", str(tmp_path / "nope"), "-i", str(_write_local_inventory(tmp_path))]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_manifest_skips_git_and_pycache(tmp_path: Path) -> None:
    for rel in (".git/HEAD", "__pycache__/a.pyc", "a.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert list(manifest(str(tmp_path), Ignore.parse(".git/\n__pycache__/\n"))) == ["a.py"]


@pytest.mark.slow  # a venv with pip (~5 s) and a wheel build (~3 s)
def test_nodes_install_is_offline_verified_and_idempotent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    inv = _write_local_inventory(tmp_path, python=str(python))
    assert main(["nodes", "install", "-i", str(inv)]) == 0  # builds the wheel itself
    assert "v0: installed (clusterkit" in capsys.readouterr().out
    # Idempotence for one wheel (the shared tree may change between two builds here).
    from clusterkit.provision.install import build_wheel

    wheel = str(build_wheel(str(tmp_path / "wheel")))
    main(["nodes", "install", "-i", str(inv), "--wheel", wheel])
    capsys.readouterr()
    assert main(["nodes", "install", "-i", str(inv), "--wheel", wheel]) == 0
    assert "v0: already installed" in capsys.readouterr().out
    res = subprocess.run([str(python), "-c", "import clusterkit; print(clusterkit.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, check=True)
    assert res.stdout.startswith(str(venv))  # the node's own copy, not the source tree


def test_launch_sync_copies_the_code_before_the_ranks_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    proj = tmp_path / "proj"
    (proj / "code").mkdir(parents=True)
    (proj / "code" / "train.py").write_text(
        "import os\nprint('rank', os.environ['RANK'], 'ran synced code', flush=True)\n")
    work = tmp_path / "node-work"
    inv = tmp_path / "inv.yaml"
    # One workdir per virtual node: on a shared one, whichever node syncs second finds
    # the file already there ("unchanged"), and the two summaries would not fold.
    inv.write_text("schema_version: 1\ndefaults:\n  transport: local\n  slots: 1\n"
                   f"  checkpoint:\n    shared_dir: {tmp_path / 'ckpt'}\n"
                   f"hosts:\n  v0: {{workdir: {work}0}}\n  v1: {{workdir: {work}1}}\n")
    monkeypatch.chdir(proj)
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    assert main(["launch", "-i", str(inv), "--sync", "code", "--nodes", "2", "--gpus-per-node",
                 "1", "--job-id", "sync-launch", "code/train.py"]) == 0
    out = capsys.readouterr().out
    assert "v[0-1]: 1 file(s) sent" in out
    assert "rank 0 ran synced code" in out and "rank 1 ran synced code" in out
    assert all((Path(f"{work}{i}") / "code" / "train.py").is_file() for i in (0, 1))


def test_delete_never_touches_job_dirs_or_checkpoints_under_the_destination(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "proj"
    src.mkdir()
    (src / "train.py").write_text("print(1)\n")
    work = tmp_path / "node-work"
    for rel in (".clusterkit/jobs/j1/nodes/v0/rank0.log", "ckpt/global_step5/shard.pt", "old.py"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text("keep?\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text("schema_version: 1\ndefaults:\n  transport: local\n"
                   f"  workdir: {work}\n  checkpoint:\n    local_dir: {work}/ckpt\n"
                   "hosts:\n  v0: {}\n")
    (src / ".clusterkitignore").write_text("!ckpt/\n")  # cannot re-include the checkpoints
    cwd = os.getcwd()
    os.chdir(src)
    try:
        # --delete only where a sync put its manifest: not in a directory sync never filled.
        assert main(["sync", ".", "-i", str(inv), "--delete"]) == 2
        assert "holds no clusterkit sync manifest" in capsys.readouterr().out
        assert (work / "old.py").exists()
        assert main(["sync", ".", "-i", str(inv)]) == 0
        assert main(["sync", ".", "-i", str(inv), "--delete"]) == 0
    finally:
        os.chdir(cwd)
    assert "1 deleted" in capsys.readouterr().out
    assert not (work / "old.py").exists()
    assert (work / ".clusterkit/jobs/j1/nodes/v0/rank0.log").exists()
    assert (work / "ckpt/global_step5/shard.pt").exists()
