"""Issue 37 item 3: the batch script builds DeepSpeed's JIT ops once per node before the
ranks start. The written sbatch.sh runs under bash with Slurm's commands stubbed (srun
runs its command here, as the one node ``n1``): the real ``provision.jitops batch`` node program
reads the job file ``jitops.bundle`` and answers for this machine's torch/deepspeed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterkit.cli.main import main
from clusterkit.node.provision import jitops

STUBS = """
scontrol() { printf '%s\\n' n1; }
scancel() { :; }
getent() { printf '10.0.0.1 STREAM n1\\n'; }
srun() {  # the options away; the launch step is launch_step, the others run here
    case " $* " in *" --kill-on-bad-exit=1 "*) launch_step; return ;; esac
    while [ "${1#--}" != "$1" ]; do shift; done
    SLURMD_NODENAME=n1 "$@"
}
launch_step() { echo "LAUNCHED"; }
"""


def _script(tmp_path: Path, capsys: pytest.CaptureFixture[str], ext: Path) -> str:
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "schema_version: 1\ncluster: {name: unit}\n"
        f"defaults: {{transport: ssh, gpus: 0, slots: 2, python: {sys.executable}, "
        f"workdir: {tmp_path}/work, checkpoint: {{shared_dir: {tmp_path}/ckpt}}, "
        f"env: {{TORCH_EXTENSIONS_DIR: {ext}}}}}\n"
        "hosts:\n  n1: {address: 10.0.0.1}\n")
    assert main(["sbatch", "-i", str(inv), "--job-id", "ops1", "--storage", "shared",
                 "--write-only"]) == 0
    capsys.readouterr()
    job_dir = tmp_path / "work/.clusterkit/jobs/ops1"
    assert (job_dir / "jitops.bundle").is_file()
    return (job_dir / "sbatch.sh").read_text()


def _run_bash_with_stubs(script: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "SLURM_JOB_ID": "77",
           "SLURM_JOB_NODELIST": "n1", "SLURM_CPUS_PER_TASK": "2", "HOME": os.environ["HOME"]}
    proc = subprocess.Popen(["bash", "-s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(STUBS + script, timeout=60)
    finally:  # a build the script started must not outlive the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.wait(), out, err)


def test_the_ops_step_stops_the_job_at_a_stale_lock_and_starts_it_when_built(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ext = tmp_path / "ext"
    script = _script(tmp_path, capsys, ext)
    assert "ShareMemCommBuilder" in script  # the CPU workload's op (render/jobops.py)
    lock = ext / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # a killed build's, no record
    r = _run_bash_with_stubs(script)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"clusterkit: DeepSpeed's JIT ops on n1: stale build lock {lock} (no live process "
            "there holds it and no builder recorded it)") in r.stdout
    assert "JIT ops are not ready on every node" in r.stderr and "LAUNCHED" not in r.stdout
    assert lock.exists()
    # Built (as torch leaves it) and unlocked: one line, no deepspeed import, the ranks start.
    lock.unlink()
    (lock.parent / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    (lock.parent / "build.ninja").write_text(
        f"cflags = -isystem {jitops.package_dir('torch')}/include -isystem x\n")
    t0 = time.monotonic()
    r = _run_bash_with_stubs(script)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "clusterkit: DeepSpeed's JIT ops on n1: cpu: deepspeed_shm_comm already built" \
        in r.stdout.splitlines()
    assert r.stdout.index("already built") < r.stdout.index("LAUNCHED")
    assert time.monotonic() - t0 < 30


def test_a_script_without_its_bundle_says_so_and_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, capsys, tmp_path / "ext")
    (tmp_path / "work/.clusterkit/jobs/ops1/jitops.bundle").unlink()
    r = _run_bash_with_stubs(script)
    assert r.returncode == 0 and "LAUNCHED" in r.stdout
    assert "jitops.bundle is missing (clusterkit sbatch writes it)" in r.stderr
