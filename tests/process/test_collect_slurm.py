"""collect-ckpt for `clusterkit sbatch` jobs, without a cluster: the registry record,
the srun command lines, and a whole collect through a stand-in ``srun`` that runs
the node program here (each "node" its own directory) while ``ssh`` fails loudly.

The real thing, on the Slurm test bed: tests/bed/slurm/test_collect_sbatch_slurm.py.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clusterkit.checkpoints.sources.session import BackChannel
from clusterkit.errors import LaunchError
from clusterkit.launch.registry import JobRecord, Registry
from clusterkit.node.ckpt.stream import SOCKET_GREETING, connect_back, socket_proof
from clusterkit.slurm.client import SlurmClient
from clusterkit.slurm.steps import SlurmPlace, job_places, site_args, srun_hint
from tests import synthetic_ckpt as synthetic

TAG = "global_step1"
SCRIPT = """#!/bin/bash
# a comment line
#SBATCH --job-name=ck-j
#SBATCH --partition=debug
#SBATCH -A acct
#SBATCH --qos normal
#SBATCH --reservation=r1
#SBATCH --partition=gpu
set -euo pipefail
#SBATCH --account=not-read-after-a-command
"""


def test_site_args_read_like_sbatch() -> None:
    assert site_args(SCRIPT) == ("--partition=gpu", "--account=acct", "--qos=normal",
                                 "--reservation=r1")
    assert site_args("#!/bin/bash\n#SBATCH --nodes=2\n") == ()


def test_place_argv_step_or_allocation() -> None:
    program = ["python3", "-c", "x y", "arg"]
    step = SlurmPlace("node2", job_id="77").argv(program)
    assert step[:3] == ["srun", "--jobid=77", "--overlap"] and "--nodelist=node2" in step
    assert step[-4:] == program and not any(a.startswith("--immediate") for a in step)
    alloc = SlurmPlace("node2", site=("--partition=debug",), wait_s=12, job_name="ck-x").argv(program)
    assert "--immediate=12" in alloc and "--partition=debug" in alloc and "--job-name=ck-x" in alloc
    assert not any(a.startswith("--jobid") for a in alloc) and alloc[-4:] == program
    env = SlurmPlace("n").env({"SLURM_JOB_ID": "5", "SLURM_CONF": "/c", "SRUN_CPUS_PER_TASK": "4",
                               "PATH": "/bin"})
    assert env == {"SLURM_CONF": "/c", "PATH": "/bin"}


def test_srun_hints() -> None:
    hint = srun_hint("srun: Required node not available (down, drained or reserved)")
    assert hint is not None and "sinfo" in hint
    hint = srun_hint("srun: error: Unable to allocate resources: Invalid partition name specified")
    assert hint is not None and "sinfo -s" in hint and "JOBDIR/sbatch.sh" in hint
    assert srun_hint("something else") is None


def _scripted_slurm_client(answers: dict[str, tuple[str, str, int]]) -> SlurmClient:
    def runner(argv: object, timeout: float, env: object, cwd: object
               ) -> subprocess.CompletedProcess[str]:
        words = list(argv)  # type: ignore[call-overload]
        out, err, rc = answers[words[0] if words[0] == "sinfo" else words[-1]]
        return subprocess.CompletedProcess(list(argv), rc, out, err)  # type: ignore[call-overload]

    return SlurmClient(runner=runner)


def _show(job: str, state: str, nodes: str) -> tuple[str, str, int]:
    return (f"JobId={job} JobName=ck-j JobState={state} Reason=None ExitCode=0:0 "
            f"NodeList={nodes} StdOut=/o StdErr=/e Restarts=0\n", "", 0)


def test_job_places_running_finished_forgotten() -> None:
    client = _scripted_slurm_client({"7": _show("7", "RUNNING", "node[1-2]"),
                           "8": _show("8", "COMPLETED", "node[3-4]"),
                           "9": ("", "slurm_load_jobs error: Invalid job id specified", 1),
                           "sinfo": ("node3|idle|none\nnode4|mixed|none\nnode5|idle|none\n"
                                     "node6|down*|Not responding\n", "", 0)})
    running = job_places(client, "7", "node[1-2]", ())
    assert [(p.node, p.job_id) for p in running.places] == [("node1", "7"), ("node2", "7")]
    done = job_places(client, "8", None, ("--partition=debug",))
    assert [(p.node, p.job_id) for p in done.places] == [("node3", None), ("node4", None)]
    assert done.places[0].site == ("--partition=debug",)
    forgotten = job_places(client, "9", "node[3-5]", ())
    assert forgotten.state == "UNKNOWN" and [p.node for p in forgotten.places] == [
        "node3", "node4", "node5"]
    # A node Slurm has down: said at once, by name (srun would wait, then say "busy").
    with pytest.raises(LaunchError, match=r"node6 down\* \(reason: Not responding\)") as err:
        job_places(client, "9", "node[5-6]", ())
    assert "State=RESUME" in err.value.one_line()
    with pytest.raises(LaunchError, match="are not known"):
        job_places(client, "9", None, ())


def _write_only_job_dir(tmp: Path, job: str = "nl-job", storage: str = "node-local") -> Path:
    """What `clusterkit sbatch --write-only` leaves: plan.json and sbatch.sh (2 nodes x 2)."""
    d = tmp / "work" / ".clusterkit" / "jobs" / job
    d.mkdir(parents=True)
    root = str(tmp / "ckpt" / job)
    plan = {"job_id": job, "backend": "torchrun", "storage": storage, "job_dir": str(d),
            "nodes": [{"host": f"n{i}", "slots": [0, 1], "python": sys.executable,
                       "ckpt_dir": root} for i in (1, 2)]}
    (d / "plan.json").write_text(json.dumps(plan))
    (d / "sbatch.sh").write_text(SCRIPT)
    return d


def test_registry_finds_a_batch_job_by_either_id(tmp_path: Path) -> None:
    d = _write_only_job_dir(tmp_path)
    reg = Registry(tmp_path / "home")
    reg.record_sbatch(d, "101")
    reg.record_sbatch(d, "102")  # the same clusterkit job submitted again
    for key in ("nl-job", "101", "102"):
        r = reg.resolve(key)
        assert (r.job_id, r.transport, r.slurm_job_ids) == ("nl-job", "slurm", ["101", "102"])
    assert r.job_dir == str(d) and str(r.ckpt.dir).endswith("ckpt/nl-job")
    assert r.ckpt.slots == [2, 2] and r.slurm_site[0] == "--partition=gpu"
    assert r.state == "submitted" and not r.launcher_alive and r.nodes == []
    with pytest.raises(LaunchError, match="nor the Slurm id"):
        reg.resolve("999")
    # An old record (no transport field) still loads, as an SSH job.
    old = json.loads(reg.path("nl-job").read_text())
    for k in ("transport", "slurm_job_ids", "job_dir"):
        del old[k]
    assert JobRecord.from_dict(old).transport == "ssh"


FAKE_SRUN = """
import os, sys
# Stand-in srun: runs the program here; "node" N's checkpoint root is ROOT/N/...
with open(os.environ["FAKE_LOG"], "a") as fh:
    fh.write("srun " + " ".join(sys.argv[1:]) + "\\n")
args, node = sys.argv[1:], ""
while args and args[0].startswith("--"):
    if args[0].startswith("--nodelist="):
        node = args[0].split("=", 1)[1]
    args.pop(0)
if os.environ.get("FAKE_SRUN_FAIL"):
    sys.exit(os.environ["FAKE_SRUN_FAIL"])
if os.environ.get("SLURM_JOB_ID"):
    sys.exit("srun: inherited SLURM_JOB_ID")
root = os.environ["FAKE_ROOT"]
if args[-1].startswith(root):
    args[-1] = os.path.join(root, node, os.path.relpath(args[-1], root))
# What real srun puts in a task's environment: where srun listens for its I/O.
os.environ["SLURM_SRUN_COMM_HOST"] = os.environ.get("FAKE_SRUN_COMM_HOST", "127.0.0.1")
os.execvp(args[0], args)
"""


def _bin(tmp: Path) -> Path:
    b = tmp / "bin"
    b.mkdir()
    scripts = {
        "srun": f"#!{sys.executable}\n{FAKE_SRUN}",
        "scontrol": ("#!/bin/sh\n"
                     "echo \"scontrol $*\" >> \"$FAKE_LOG\"\n"
                     "echo \"JobId=$4 JobName=ck JobState=COMPLETED Reason=None ExitCode=0:0 "
                     "NodeList=node[1-2] StdOut=/o StdErr=/e Restarts=0\"\n"),
        "sinfo": "#!/bin/sh\nprintf 'node1|idle|none\\nnode2|idle|none\\n'\n",
        "ssh": "#!/bin/sh\necho \"ssh $*\" >> \"$FAKE_LOG\"\nexit 255\n",
    }
    for name, text in scripts.items():
        (b / name).write_text(text)
        (b / name).chmod(stat.S_IRWXU)
    return b


def _env(tmp: Path, **more: str) -> dict[str, str]:
    env = dict(os.environ, PATH=f"{_bin(tmp)}:{os.environ['PATH']}",
               CLUSTERKIT_HOME=str(tmp / "home"), FAKE_LOG=str(tmp / "calls.log"),
               FAKE_ROOT=str(tmp / "ckpt"), SLURM_JOB_ID="4242")  # as if inside salloc
    env.update(more)
    return env


def _collect(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterkit", "collect-ckpt", *args],
                          capture_output=True, text=True, timeout=120, env=env, check=False)


def test_collect_a_batch_job_through_srun_not_ssh(tmp_path: Path) -> None:
    d = _write_only_job_dir(tmp_path)
    (d / "slurm_nodes").write_text("node[1-2]\n")
    # "node" i's checkpoint root: <tmp>/ckpt/node<i>/nl-job (the fake srun maps it).
    synthetic.write_node_local([str(tmp_path / "ckpt" / f"node{i}" / "nl-job") for i in (1, 2)],
                               shard_bytes=4096, model_bytes=512)
    env = _env(tmp_path)
    Registry(tmp_path / "home").record_sbatch(d, "555")
    res = _collect(env, "555")
    assert res.returncode == 0, res.stdout + res.stderr
    dest = d / "checkpoints"  # default DEST: the job dir's
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 4
    assert "job nl-job (Slurm job 555, COMPLETED): collecting" in res.stdout
    assert "node[1-2] through Slurm, a one-task allocation on each node" in res.stdout
    assert "via slurm (a socket per node)" in res.stdout  # not srun's stdout
    calls = (tmp_path / "calls.log").read_text()
    assert "ssh " not in calls and "scontrol show job -o 555" in calls
    sruns = [ln for ln in calls.splitlines() if ln.startswith("srun ")]
    assert len(sruns) == 2 and all("--partition=gpu" in ln and "--immediate=30" in ln
                                   for ln in sruns)
    # By the job dir too (no registry needed), as JOB or as --dir; a re-run copies nothing.
    for args in ([str(d)], ["--dir", str(d)]):
        res = _collect(env, *args)
        assert res.returncode == 0 and "0 file(s) copied" in res.stdout, res.stderr
    # The script edited since the submit (a partition that is gone): the edit counts.
    (d / "sbatch.sh").write_text(SCRIPT.replace("--partition=gpu", "--partition=other"))
    res = _collect(env, "nl-job")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "calls.log").read_text().count("--partition=other") == 2  # one per node


def test_a_node_that_cannot_connect_back_sends_through_srun_and_says_so(tmp_path: Path) -> None:
    """The socket is the fast path, srun's stdout the fallback: same files, same checks."""
    d = _write_only_job_dir(tmp_path)
    (d / "slurm_nodes").write_text("node[1-2]\n")
    synthetic.write_node_local([str(tmp_path / "ckpt" / f"node{i}" / "nl-job") for i in (1, 2)],
                               shard_bytes=4096, model_bytes=512)
    env = _env(tmp_path, FAKE_SRUN_COMM_HOST="collector.invalid")  # resolves nowhere
    Registry(tmp_path / "home").record_sbatch(d, "555")
    res = _collect(env, "555")
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(list((d / "checkpoints" / TAG).glob("*_optim_states.pt"))) == 4
    assert "every file sha256-checked" in res.stdout
    assert "via slurm (node[1-2]: srun's stdout, slower: gaierror: " in res.stdout, res.stdout


def test_the_back_channel_takes_only_a_node_that_proves_the_secret() -> None:
    back = BackChannel(20.0)
    try:
        stranger = socket.create_connection(("127.0.0.1", back.port), timeout=5)
        stranger.sendall(SOCKET_GREETING + b" " + socket_proof("not the secret", b"node",
                                                               back.port) + b"\n")
        assert stranger.recv(200) == b""  # closed, no proof given away
        node = socket.create_connection(("127.0.0.1", back.port), timeout=5)
        node.sendall(SOCKET_GREETING + b" " + socket_proof(back.secret, b"node", back.port) + b"\n")
        assert node.recv(200).strip() == socket_proof(back.secret, b"collector", back.port)
        assert back.done.wait(5) and back.sock is not None
        with pytest.raises(OSError):  # one node per channel: the listener is closed
            socket.create_connection(("127.0.0.1", back.port), timeout=2)
        stranger.close()
        node.close()
    finally:
        back.close()


def test_the_node_sends_nothing_to_a_collector_without_the_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = socket.create_server(("127.0.0.1", 0))
    port = fake.getsockname()[1]

    def impostor() -> None:
        conn, _ = fake.accept()
        conn.recv(200)
        conn.sendall(socket_proof("a guess", b"collector", port) + b"\n")
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    monkeypatch.setenv("SLURM_SRUN_COMM_HOST", "127.0.0.1")
    with pytest.raises(ValueError, match="did not prove the run's secret"):
        connect_back({"port": port, "secret": "s" * 64})
    fake.close()
    monkeypatch.delenv("SLURM_SRUN_COMM_HOST")
    with pytest.raises(ValueError, match="SLURM_SRUN_COMM_HOST is not set"):
        connect_back({"port": port, "secret": "s" * 64})


def test_slurm_refusal_is_one_clear_line(tmp_path: Path) -> None:
    d = _write_only_job_dir(tmp_path)
    (d / "slurm_nodes").write_text("node[1-2]\n")
    env = _env(tmp_path, FAKE_SRUN_FAIL="srun: Required node not available (down, drained or "
                                        "reserved)")
    res = _collect(env, str(d))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "node[1-2]: cannot list (slurm): exit 1: srun: Required node not available" in res.stderr
    assert "State=RESUME" in res.stderr and "Traceback" not in res.stderr
    assert "ssh " not in (tmp_path / "calls.log").read_text()
    # Shared storage: nothing to gather, said at once.
    shared = _write_only_job_dir(tmp_path, "sh-job", storage="shared")
    res = _collect(env, str(shared))
    assert res.returncode == 2 and "shared storage" in res.stderr, res.stderr


def test_via_slurm_on_inventory_hosts(tmp_path: Path) -> None:
    """`--via slurm -i INV`: an allocation on each selected host (inventory name = Slurm node)."""
    synthetic.write_node_local([str(tmp_path / "ckpt" / f"node{i}" / "run") for i in (1, 2)],
                               shard_bytes=4096, model_bytes=512)
    inv = tmp_path / "inv.yaml"
    inv.write_text("schema_version: 1\ncluster: {name: unit}\n"
                   f"defaults: {{transport: ssh, slots: 2, python: {sys.executable}}}\n"
                   "hosts:\n  node1: {address: 10.0.0.1}\n  node2: {address: 10.0.0.2}\n")
    env = _env(tmp_path)
    res = _collect(env, "-i", str(inv), "--dir", str(tmp_path / "ckpt" / "run"), "--via", "slurm",
                   "--slurm-wait", "7", "--to", str(tmp_path / "dest"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(list((tmp_path / "dest" / TAG).glob("*_optim_states.pt"))) == 4
    calls = (tmp_path / "calls.log").read_text()
    assert calls.count("--immediate=7") == 2 and "ssh " not in calls
    res = _collect(env, "-i", str(inv), "--dir", str(tmp_path / "ckpt" / "run"), "--via", "slurm",
                   "--to", str(tmp_path / "dest"), "--scatter")
    assert res.returncode == 2 and "--scatter does not run through Slurm" in res.stderr


@pytest.mark.parametrize(("trap", "code"), [("echo term >> \"$FAKE_LOG\"; exit 0", 0),
                                            ("", -9)])
def test_a_slurm_session_is_terminated_before_killed(tmp_path: Path, trap: str, code: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """srun killed with SIGKILL cannot give its allocation back: TERM first, KILL later."""
    from clusterkit.checkpoints.sources import session
    from clusterkit.remote.base import SSHTarget

    b = tmp_path / "bin"
    b.mkdir()
    (b / "srun").write_text(f"#!/bin/sh\ntrap '{trap}' TERM\n: > \"$FAKE_LOG.ready\"\n"
                            "sleep 30 & wait\nsleep 30\n")
    (b / "srun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log"))
    monkeypatch.setattr(session, "SRUN_TERM_GRACE_S", 0.5)
    s = session.NodeSession("node1", SSHTarget("node1", "node1"), sys.executable, "/x",
                            via=SlurmPlace("node1"))
    assert s.argv[0] == "srun" and s.carrier == "slurm" and s.startup_s == 30
    deadline = time.monotonic() + 10
    while not (tmp_path / "log.ready").exists():  # its trap is set
        assert time.monotonic() < deadline
        time.sleep(0.02)
    s.kill("test")
    assert s.reap(10.0) == code
    assert (tmp_path / "log").exists() is (code == 0)
    s.close()


def test_status_and_stop_of_a_batch_job_point_at_slurm(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`clusterkit status/stop JOB` of an sbatch record: its nodes are Slurm's, so status
    names the Slurm job and the command that shows it, and stop refuses in one line with
    `clusterkit sbatch cancel ID` (was: '0 nodes ... submitted', and a stop that claimed
    nothing was left on 0 nodes)."""
    from clusterkit.cli.main import main

    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    Registry(tmp_path / "home").record_sbatch(_write_only_job_dir(tmp_path), "101")
    assert main(["status", "nl-job"]) == 0
    out = capsys.readouterr().out
    assert "nl-job: Slurm job 101" in out and "clusterkit sbatch status 101" in out
    assert main(["status"]) == 0
    assert "slurm   101" in capsys.readouterr().out
    assert main(["stop", "nl-job"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "clusterkit sbatch cancel 101" in err[0], err
