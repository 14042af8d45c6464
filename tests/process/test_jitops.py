"""DeepSpeed's JIT ops: which ops a config builds, and stale build locks (doctor's check)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clusterkit.node.provision import jitops
from tests.paths import TESTS


def test_ops_for_the_bundled_workloads_configs() -> None:
    cpu = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert jitops.ops_for_config(cpu, "cpu") == ["ShareMemCommBuilder"]
    gpu = {"optimizer": {"type": "AdamW", "params": {}}}
    assert jitops.ops_for_config(gpu, "cuda") == ["FusedAdamBuilder"]
    off = {"optimizer": {"type": "Adam"},
           "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert jitops.ops_for_config(off, "cuda") == ["CPUAdamBuilder"]
    nvme = {"optimizer": {"type": "Adam"},
            "zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
    assert jitops.ops_for_config(nvme, "cuda") == ["CPUAdamBuilder", "AsyncIOBuilder"]
    assert jitops.ops_for_config({}, "cuda") == []


def _lock(root: Path, op: str = "fused_adam") -> Path:
    d = root / "py311_cpu" / op
    d.mkdir(parents=True)
    return _killed_build_lock(d / "lock")


def _killed_build_lock(lock: Path) -> Path:
    """A lock a killed build left an hour ago (a younger one may be another node's load:
    jitops.settled waits for it to go)."""
    lock.write_bytes(b"")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    return lock


def test_a_lock_nobody_holds_is_stale_one_held_open_is_not(tmp_path: Path) -> None:
    lock = _lock(tmp_path)
    found = jitops.locks([str(tmp_path)])
    assert [f["path"] for f in jitops.stale(found)] == [str(lock)]
    # FileBaton keeps the O_EXCL fd open for the whole build: a live builder holds it.
    holder = subprocess.Popen([sys.executable, "-c",
                               f"import os,time; fd=os.open({str(lock)!r}, os.O_RDONLY); "
                               "print('ready', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        found = jitops.locks([str(tmp_path)])
        assert found[0]["holders"] == [holder.pid] and jitops.stale(found) == []
    finally:
        holder.kill()
        holder.wait()


def test_extension_roots_follow_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/x/ext")
    assert jitops.extension_roots()[0] == "/x/ext"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert jitops.extension_roots() == [os.path.expanduser("~/.cache/torch_extensions")]


FIXTURES = TESTS / "fixtures" / "stacks"


def test_a_young_lock_that_goes_away_is_another_nodes_load_not_a_stale_lock(
        tmp_path: Path) -> None:
    """A rank on a node sharing the directory holds the lock where no /proc here shows
    it, for the second ninja takes: settled() waits for it; an old one it does not."""
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    gone = threading.Timer(1.0, lock.unlink)
    gone.start()
    t0 = time.monotonic()
    assert jitops.settled([str(tmp_path)]) == []
    assert 0.9 < time.monotonic() - t0 < jitops.SETTLE_S
    old = _killed_build_lock(lock)
    t0 = time.monotonic()
    assert [lk["path"] for lk in jitops.stale(jitops.settled([str(tmp_path)]))] == [str(old)]
    assert time.monotonic() - t0 < 1.0


def test_lock_notes_name_the_lock_a_rank_waits_for_and_whose_it_is(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "deepspeed_shm_comm")
    # A process whose environment points torch at tmp_path/py311_cpu (as a rank's would).
    rank = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(lock.parent.parent)})
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "up\n"  # exec'd
        notes = jitops.lock_notes(rank.pid)
    finally:
        rank.kill()
        rank.wait()
    assert notes == [f"{jitops.BUILD_LOCK_NOTE}{lock}: {jitops.STALE}"]


@pytest.mark.parametrize("fixture", ["filebaton_wait_pyspy.txt",
                                     "filebaton_wait_faulthandler.txt"])
def test_the_hang_summary_says_ranks_wait_on_a_build_lock_and_whose(fixture: str) -> None:
    from clusterkit.launch.stacks import read_stack, summarize

    text = (FIXTURES / fixture).read_text()
    assert jitops.waits_on_baton(text)
    stale = text + f"{jitops.BUILD_LOCK_NOTE}/c/py311_cpu/deepspeed_shm_comm/lock: {jitops.STALE}\n"
    held = text + f"{jitops.BUILD_LOCK_NOTE}/c/py311_cpu/deepspeed_shm_comm/lock: held by pid 77\n"
    stacks = {0: read_stack(0, "node1", stale), 1: read_stack(1, "node1", stale),
              2: read_stack(2, "node2", held)}
    summary = summarize(stacks, 3)
    lines = "\n".join(summary.lines())
    assert ("ranks 0-1 (node1): in FileBaton.wait" in lines or "ranks 0-1 (node1): in wait" in lines)
    assert ("waiting for build lock /c/py311_cpu/deepspeed_shm_comm/lock: no live process "
            "holds it (stale)") in lines
    assert "rank 2 (node2)" in lines and "held by pid 77" in lines
    assert "fix: /c/py311_cpu/deepspeed_shm_comm/lock is a stale JIT build lock" in lines
    assert "`rm /c/py311_cpu/deepspeed_shm_comm/lock`" in lines


def test_an_ordinary_stack_names_no_lock() -> None:
    from clusterkit.launch.stacks import build_locks

    assert build_locks('  File "/x/main.py", line 3 in _step\n# build lock: /x held by pid 1\n') \
        == []


def test_build_ops_refuses_a_node_with_a_stale_lock_before_building(tmp_path: Path) -> None:
    lock = _lock(tmp_path / "ext", "fused_adam")
    inv = tmp_path / "inv.yaml"
    inv.write_text("schema_version: 1\ncluster: {name: t}\ndefaults: {transport: local, env: "
                   f"{{TORCH_EXTENSIONS_DIR: {tmp_path / 'ext' / 'py311_cpu'}}}}}\n"
                   "hosts: {a: {}}\n")
    res = subprocess.run([sys.executable, "-m", "clusterkit", "nodes", "build-ops", "-i",
                          str(inv)], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2, res.stderr
    assert f"a: build-ops: stale build lock {lock} (no live process holds it)" in res.stderr
    assert f"rm {lock} (or --remove-stale-locks)" in res.stderr
    assert lock.exists()


# ----------------------------------------------------------------------------- at launch

TORCH_DIR = jitops.package_dir("torch")
SHM = "deepspeed_shm_comm"


def _built(ext: Path, name: str = SHM, torch_dir: str | None = TORCH_DIR) -> Path:
    """What torch leaves after building ``name``: its .so and the build.ninja naming the
    torch it compiled against (-isystem <torch>/include)."""
    d = ext / name
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.so").write_bytes(b"\x7fELF")
    (d / "build.ninja").write_text(f"cflags = -isystem {torch_dir}/include -isystem x\n")
    return d


def test_check_says_which_ops_a_nodes_ranks_would_build(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ext = tmp_path / "ext"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    ops = [jitops.SHM_COMM, "CPUAdamBuilder", "SomeOtherBuilder"]
    out = jitops.check(ops)
    assert out["deepspeed"] and out["root"] == str(ext) and out["stale"] == []
    assert jitops.job_roots() == [str(ext)]  # build's stale-lock scope too
    assert out["ops"] == dict.fromkeys(ops, "missing")
    _built(ext)
    _built(ext, "cpu_adam", torch_dir="/another/env/torch")  # ninja would rebuild it
    assert jitops.check(ops)["ops"] == {jitops.SHM_COMM: "built", "CPUAdamBuilder": "missing",
                                        "SomeOtherBuilder": "missing"}
    lock = _killed_build_lock(ext / SHM / "lock")  # a build killed half-way
    out = jitops.check(ops)
    assert out["ops"][jitops.SHM_COMM] == "building"
    assert [lk["path"] for lk in out["stale"]] == [str(lock)]


def test_build_root_is_torchs_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert TORCH_DIR is not None
    want = os.path.dirname(cpp_extension._get_build_directory("probe", False))
    assert jitops.build_root(TORCH_DIR) == want  # .../torch_extensions/py311_cpu here


def test_which_nodes_build_and_the_console_line() -> None:
    from clusterkit.provision.jitbuild import OpsReport, missing

    assert missing({"deepspeed": False, "ops": {}}) == []  # the gate names a missing package
    assert missing({"deepspeed": True, "ops": {"A": "built", "B": "missing", "C": "building"}}) \
        == ["B", "C"]
    nodes = [f"node{i}" for i in range(1, 8)]
    report = OpsReport(nodes, needed={n: [jitops.SHM_COMM] for n in nodes[:4]},
                       seconds={"node1": 31.0, "node2": 37.6, "node3": 35.0, "node4": 36.0})
    assert report.line() == ("DeepSpeed's JIT ops: deepspeed_shm_comm built on node[1-4] "
                             "(38 s); already built on node[5-7]")
    assert report.line(dry_run=True) == ("DeepSpeed's JIT ops: deepspeed_shm_comm would be "
                                         "built on node[1-4]; already built on node[5-7]")
    report.needed["node6"] = [jitops.SHM_COMM, "CPUAdamBuilder"]
    report.refused["node7"] = "stale build lock ..."
    report.seconds["node6"] = 80.2
    assert report.line() == ("DeepSpeed's JIT ops: deepspeed_shm_comm built on node[1-4] "
                             "(38 s); deepspeed_shm_comm, cpu_adam built on node6 (80 s); "
                             "already built on node5")


@pytest.mark.slow  # ~15-35 s
def test_launch_dry_run_says_what_it_would_build_and_refuses_a_stale_lock(
        tmp_path: Path) -> None:
    """Local transport (two virtual nodes on this machine), each with its own
    TORCH_EXTENSIONS_DIR: a empty, b holding a build of this torch."""
    _built(tmp_path / "b")
    inv = tmp_path / "inv.yaml"
    hosts = "".join(f"  {h}: {{env: {{TORCH_EXTENSIONS_DIR: {tmp_path / h}}}, checkpoint: "
                    f"{{local_dir: {tmp_path / 'ck' / h}}}}}\n" for h in "ab")
    inv.write_text("schema_version: 1\ncluster: {name: t}\ndefaults: {transport: local, "
                   "gpus: 0}\nhosts:\n" + hosts)
    env = dict(os.environ, CLUSTERKIT_HOME=str(tmp_path / "home"))

    def dry(*more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "clusterkit", "launch", "-i", str(inv),
                               "--dry-run", "--job-id", "j", *more, "--steps", "1"],
                              capture_output=True, text=True, timeout=120, check=False,
                              env=env, cwd=tmp_path)

    res = dry()
    assert res.returncode == 0, res.stderr[-2000:]
    assert ("DeepSpeed's JIT ops: deepspeed_shm_comm would be built on a; already built on b"
            in res.stdout.splitlines())
    assert not (tmp_path / "a" / SHM).exists()  # a dry run builds nothing
    lock = _killed_build_lock(tmp_path / "b" / SHM / "lock")
    res = dry()
    assert res.returncode == 2
    assert (f"JIT ops not ready on 1 node(s): b: build-ops: stale build lock {lock} (no live "
            "process holds it): every DeepSpeed start there would wait on it — check that no "
            f"build runs, then rm {lock} (or `clusterkit nodes build-ops "
            "--remove-stale-locks`)") in res.stderr.strip().splitlines()[-1]
    res = dry("--no-build-ops")
    assert res.returncode == 0 and "JIT ops" not in res.stdout, res.stderr[-2000:]
