"""A node-local `clusterkit sbatch` job with `--replicas 1` survives a node lost for good
(issue 31 items 1, 2 and 7), on a real Slurm of its own (tests/slurmbed, 5 nodes with
node-private scratch): 4 x 1 ranks (4 x 2 with the extended reshard), the bundled
workload, ZeRO-2. Once node index 2's
part of a save is replicated on its ring successor, node3 is destroyed (its processes
killed, slurmd with them, its scratch removed) and set DOWN; Slurm requeues the job,
which runs on the other 4 nodes: the parts are moved before the ranks start (node
index 2's from its replica), and the resumed run is the uninterrupted one: no reference
job (issue 37 item 6: it was ~45 s of 8 ranks on 2 cores, a third of the test), the
first run itself is the reference. node3 is lost only while the first run has logged
at least two steps past every save node3 had begun (checked with node3's ranks stopped, so the
check and the loss are one moment); the resumed run's losses for those steps (at least
two: the second one already needs the restored optimizer and LR state) must equal the
first run's, float for float (DeepSpeed's CSV monitor in the shared run dir: one header
per run, then ``global_samples,loss`` rows at full precision).

Everything runs as the test bed's unprivileged user (tests/testbed/users.py): the
`clusterkit sbatch` and `status` commands (``tb.user_argv``), so the batch script, its
replica steps and the ranks too (Slurm runs a job as its submitter); the checkpoints are
in the user's node-local directory. Root submits in tests/bed/slurm/test_sbatch_slurm.py.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterkit.node.contract import REPLICA_MANIFEST
from tests.helpers import snapshot_tag
from tests.paths import REPO
from tests.polling import wait_for
from tests.slurmbed import SlurmBed
from tests.slurmbed.fixtures import user_slurm_bed
from tests.testbed import Testbed
from tests.testbed.users import assert_owned_by_user

pytestmark = [pytest.mark.slurm, pytest.mark.testbed, pytest.mark.slow]

USER = "ckslurm"
LOCAL = f"{USER}/ckpt"  # the user's checkpoint.local_dir, under the node-local dir
WORKLOAD = ("--precision", "fp32", "--model", "tiny", "--zero-stage", "2")
IN_PROGRESS = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING")
EXTENDED = os.environ.get("CLUSTERKIT_EXTENDED") == "1"  # + the 3-node reshard (~2 min)
# Ranks per node. The replica rules move a node's part whatever its rank count; 2 ranks
# per node on Slurm are the 2 x 2 USR1 test's (tests/bed/slurm/test_sbatch_slurm.py). The extended
# reshard keeps the 8 -> 6 ranks it was measured with. At 1 the default run starts 8
# ranks fewer over its two runs (~2.5 s of CPU each; issue 37 item 6).
SLOTS = 2 if EXTENDED else 1
# node3 is lost once step 4 is replicated, when the output shows two steps past node3's
# newest begun save (a window of two steps in every four), and the resumed run trains
# the rest. A step of 4 ranks costs half one of 8 (~1.4 s of CPU), so 4 x 1 runs 24
# steps (six windows; it had 12 at 4 x 2, 16 until issue 37 item 6).
STEPS, SAVE_EVERY = 12 * (3 - SLOTS), 4
LOST = "node3"


def _clusterkit(bed: SlurmBed, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``clusterkit ARGS`` run as the bed's user, from its home, with its own registry."""
    return bed.user_client([sys.executable, "-m", "clusterkit", *args], check=False,
                           timeout=timeout)


def _submitted(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert m, r.stdout
    return m.group(1)


def _submit_replica_job(bed: SlurmBed, inv: Path, job: str, *extra: str) -> str:
    return _submitted(_clusterkit(bed, "sbatch", "-i", str(inv), "--nodes", "4",
                                  "--storage", "node-local", "--steps", str(STEPS),
                                  "--save-every", str(SAVE_EVERY), "--job-id", job, *WORKLOAD,
                                  "--partition", "debug", *extra, "--submit",
                                  "--", "--log-every", "1"))


def _user_job_dir(tb: Testbed, job: str) -> Path:
    assert tb.user is not None
    return tb.user.workdir / ".clusterkit" / "jobs" / job


def _wait_end(bed: SlurmBed, slurm_id: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    while (state := bed.job_state(slurm_id)) in IN_PROGRESS or state.startswith("REQUEUE"):
        assert time.monotonic() < end, f"job {slurm_id} still {state}"
        time.sleep(1)
    return state


def _out(bed: SlurmBed, job: str, slurm_id: str, kind: str = "out") -> str:
    path = _user_job_dir(bed.tb, job) / "logs" / f"slurm-{slurm_id}.{kind}"
    return path.read_text(errors="replace") if path.exists() else ""


def _summary_file(bed: SlurmBed, job: str) -> dict[str, object]:
    """The workload's run/summary.json (the last run's; srun --label may cut the line)."""
    return dict(json.loads((_user_job_dir(bed.tb, job) / "run" / "summary.json").read_text()))


def _completed(bed: SlurmBed, job: str, slurm_id: str) -> str:
    """Wait for the job's end, assert it COMPLETED (its log's tails and the clusterkit/Error
    lines of its stderr printed if not); its output."""
    state = _wait_end(bed, slurm_id, 900)
    out = _out(bed, job, slurm_id)
    if state != "COMPLETED":
        err = _out(bed, job, slurm_id, "err")
        print(out[-3000:], "\n".join(ln for ln in err.splitlines() if "clusterkit" in ln
                                      or "Error" in ln)[-3000:])
    assert state == "COMPLETED", state
    return out


def _steps_logged(text: str) -> list[dict[int, str]]:
    """Per run of the job's output (its "===== clusterkit: ... run N" lines), step -> the
    loss rank 0 logged for it (4 decimals)."""
    runs: list[dict[int, str]] = []
    for line in text.splitlines():
        if re.match(r"===== clusterkit: job \S+ slurm=\d+ run \d+ ", line):
            runs.append({})
        elif runs and (m := re.search(rf"\] step (\d+)/{STEPS} \| loss (\S+) ", line)):
            runs[-1][int(m.group(1))] = m.group(2)
    return runs


def _csv_losses(bed: SlurmBed, job: str) -> list[list[tuple[int, float]]]:
    """Per run, DeepSpeed's CSV monitor rows (global_samples, loss): rank 0 writes a header
    when a run starts, then a row per logged step; ``repr`` of the float, so exact."""
    files = list((_user_job_dir(bed.tb, job) / "run" / "monitor").rglob("Train_Samples_train_loss.csv"))
    assert len(files) == 1, files
    runs: list[list[tuple[int, float]]] = []
    with files[0].open(newline="") as fh:
        for row in csv.reader(fh):
            if row[0] == "step":
                runs.append([])
            else:
                runs[-1].append((int(row[0]), float(row[1])))
    return runs


def _saves_begun(tb: Testbed, node: str, job: str) -> int:
    """The newest step whose save ``node`` has begun (its tag dir exists), 0 if none."""
    steps = [int(m.group(1)) for d in tb.node_local_path(node, f"{LOCAL}/{job}").glob("global_step*")
             if (m := re.fullmatch(r"global_step(\d+)", d.name))]
    return max(steps, default=0)


def _ranks(bed: SlurmBed, node: str) -> list[int]:
    """The pids of the workload's ranks in ``node`` (not torchrun's agent); none while
    torchrun is still starting them."""
    return [pid for pid, cmd in bed.job_processes(node)
            if "clusterkit.workload" in cmd and "torch.distributed.run" not in cmd]


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _lose_node3_past_its_saves(bed: SlurmBed, job: str, slurm_id: str, manifest: Path) -> int:
    """Once ``manifest`` (a replica of node3's part) exists, node3 is lost for good (every
    process of it killed, slurmd too, its scratch removed, the node set DOWN) at a moment
    when the job's output holds at least two steps past the newest save node3 had begun:
    whatever save the requeued run resumes from, the first run logged its next two steps.
    Checked with node3's ranks stopped (SIGSTOP: no save can begin there, the ranks
    elsewhere wait for them in the next collective, and the output catches up), let go
    (SIGCONT) for about a step if it does not hold yet. The output is never read while
    the job runs on: under load srun's output came more than the two steps of the window
    late, and a 4 x 1 job ran its 24 steps out before it showed one (CI-like run, load ~7).
    Returns the step the first run's output had reached."""
    end = time.monotonic() + 600
    while True:
        state = bed.job_state(slurm_id)
        assert time.monotonic() < end and state in IN_PROGRESS, \
            (state, _out(bed, job, slurm_id)[-3000:], _out(bed, job, slurm_id, "err")[-3000:])
        ranks = _ranks(bed, LOST)
        if ranks:
            _signal(ranks, signal.SIGSTOP)
            runs = _settled_steps(bed, job, slurm_id)
            logged = max(runs[0], default=0) if runs else 0
            if logged > SAVE_EVERY:
                # Every rank finished the first save before the next step: its copy to
                # node4 comes while the job is held (a 4 x 1 step takes ~0.3 s, the copy
                # a few seconds: the run could end first).
                timeout = min(120.0, end - time.monotonic())
                wait_for(manifest.exists, timeout, f"{manifest} did not appear in {timeout:.0f} s",
                         interval=0.3)
            if manifest.exists() and logged >= _saves_begun(bed.tb, LOST, job) + 2:
                break
            _signal(ranks, signal.SIGCONT)
        time.sleep(0.3)
    bed.tb.destroy(LOST)
    bed.client(["scontrol", "update", f"NodeName={LOST}", "State=DOWN", "Reason=lost-for-good"])
    return logged


def _settled_steps(bed: SlurmBed, job: str, slurm_id: str, quiet_s: float = 1.5,
                   limit_s: float = 20.0) -> list[dict[int, str]]:
    """The job's step lines once no new one has come for ``quiet_s`` (at most ``limit_s``):
    with node3's ranks stopped the others block in the next collective, and the step
    lines printed before reach the file late under load (a CI-like run at load ~4 read
    the output one fixed second after the stop, never caught up with the saves and let
    the job run out: COMPLETED with its output at step 9 of 24). Other lines (warnings,
    replica lines) do not count: they may go on."""
    end = time.monotonic() + limit_s
    runs, since = _steps_logged(_out(bed, job, slurm_id)), time.monotonic()
    while time.monotonic() < end and time.monotonic() - since < quiet_s:
        time.sleep(0.5)
        now = _steps_logged(_out(bed, job, slurm_id))
        if now != runs:
            runs, since = now, time.monotonic()
    return runs


def _lose_node3_once(bed: SlurmBed, job: str, slurm_id: str, manifest: Path) -> None:
    """Once ``manifest`` (a replica of node3's part) exists, node3 is lost for good: every
    process of it killed (slurmd too), its scratch removed, the node set DOWN."""
    end = time.monotonic() + 600
    while not manifest.exists():
        assert time.monotonic() < end and bed.job_state(slurm_id) in IN_PROGRESS, \
            _out(bed, job, slurm_id)[-3000:]
        time.sleep(0.3)
    bed.tb.destroy(LOST)
    bed.client(["scontrol", "update", f"NodeName={LOST}", "State=DOWN", "Reason=lost-for-good"])


def _reshard_on_3_nodes(bed: SlurmBed, inv: Path, tmp_path: Path) -> None:
    """The same job resubmitted on 3 nodes, no spare: its newest checkpoint (4 nodes) is
    gathered in the job dir, converted to DeepSpeed's universal checkpoint, copied to the
    3 nodes, and the workload resumes from it on 3 x SLOTS ranks and finishes; the fp32 weights
    right after the load equal, tensor by tensor, the consolidated weights of the
    checkpoint it loaded (its files copied from the 4 nodes before the job)."""
    import torch

    from clusterkit.checkpoints.convert.consolidate import consolidate, load_state_dict_dir

    tb, tag = bed.tb, f"global_step{STEPS}"
    assert tb.user is not None
    # The requeued run's nodes, node index order: index 2's part was restored onto node4.
    before = snapshot_tag(tb, ["node1", "node2", "node4", "node5"], "lost", tag,
                          tmp_path / "before", local=LOCAL)
    loaded = tb.user.shared_dir / "loaded-weights.pt"  # rank 0 writes it, as the user
    r = _clusterkit(bed, "sbatch", "-i", str(inv), "--nodes", "3", "--storage", "node-local",
                    "--steps", str(STEPS + 4), "--save-every", str(SAVE_EVERY), "--job-id", "lost",
                    *WORKLOAD, "--partition", "debug", "--replicas", "1", "--submit",
                    "--", "--log-every", "1", "--dump-loaded-weights", str(loaded))
    assert "submitting on any 3 free nodes" in r.stderr, r.stdout + r.stderr
    out = _completed(bed, "lost", _submitted(r))
    assert f"resharding global_step{STEPS}" in out and "converted to " in out, out[-4000:]
    got = _summary_file(bed, "lost")
    assert got["resumed_from"] == f"{tag}_universal" and got["world_size"] == 3 * SLOTS, got
    consolidate(str(before), tag, "fp32")
    want = load_state_dict_dir(str(before / f"{tag}-fp32"))
    weights = torch.load(loaded, map_location="cpu")
    assert weights and set(weights) <= set(want), (sorted(weights)[:5], sorted(want)[:5])
    for name, tensor in weights.items():
        assert torch.equal(tensor.float(), want[name].float()), name
    assert_owned_by_user(tb.user, [loaded])
    print("\n".join(ln for ln in out.splitlines() if ln.startswith("clusterkit: "))[:3000])


def test_a_lost_node_costs_a_restore_not_the_run(testbed_required: None, tmp_path: Path) -> None:
    t0 = time.monotonic()
    with user_slurm_bed(USER, slots=SLOTS) as (bed, inv):
        tb = bed.tb
        slurm_id = _submit_replica_job(bed, inv, "lost", "--replicas", "1")
        # node index 2 (node3)'s first save, replicated on node4 (its ring successor).
        reached = _lose_node3_past_its_saves(bed, "lost", slurm_id, tb.node_local_path(
            "node4", f"{LOCAL}/lost.replicas/node2/global_step{SAVE_EVERY}/{REPLICA_MANIFEST}"))
        t_lost = time.monotonic() - t0
        out = _completed(bed, "lost", slurm_id)
        got = _summary_file(bed, "lost")
        csv_runs = _csv_losses(bed, "lost")
        # What the job wrote is the user's: checkpoints, the restored part, copies, logs.
        assert_owned_by_user(tb.user,
                             [*(p for n in ("node1", "node2", "node4", "node5")
                              for p in tb.node_local_path(n, LOCAL).rglob("*")),
                            _user_job_dir(tb, "lost") / "logs" / f"slurm-{slurm_id}.out"])
        # sbatch status: the checkpoints' replica health, listed through Slurm.
        status = _clusterkit(bed, "sbatch", "status", slurm_id, timeout=180)
        assert f"global_step{STEPS}: 4/4 nodes, replicated 4/4" in status.stdout, \
            status.stdout + status.stderr
        status = _clusterkit(bed, "status", "lost", timeout=180)
        assert f"global_step{STEPS}: 4/4 nodes, replicated 4/4" in status.stdout, \
            status.stdout + status.stderr
        if EXTENDED:
            _reshard_on_3_nodes(bed, inv, tmp_path)
    runs = re.findall(r"^===== clusterkit: job lost slurm=\d+ run \d+ on (\S+)", out, re.M)
    assert runs[0] == "node[1-4]" and runs[-1] == "node[1-2,4-5]", runs
    assert "node index 2 (was node3) -> node4: from its replica on node4" in out, out[-4000:]
    assert re.search(r"restored global_step\d+'s node index 2 part onto node4", out), out[-4000:]
    m = re.fullmatch(r"global_step(\d+)", str(got["resumed_from"]))
    assert m, got
    assert got["world_size"] == 4 * SLOTS and got["finished"] is True, got
    # The resumed run is the uninterrupted one: the first run (node3 whole) is the
    # reference for every step both ran, at least the two after the resumed save.
    resumed = int(m.group(1))
    logged = _steps_logged(out)
    assert len(logged) == 2 and len(csv_runs) == 2, (len(logged), len(csv_runs))
    first, second = logged
    overlap = sorted(set(first) & set(second))
    assert overlap[:2] == [resumed + 1, resumed + 2] and max(second) == STEPS, (resumed, first, second)
    assert all(first[n] == second[n] for n in overlap), [(n, first[n], second[n]) for n in overlap]
    per_step = csv_runs[0][0][0]  # samples per step: the first run's first row is step 1
    exact = [dict((samples // per_step, loss) for samples, loss in run) for run in csv_runs]
    assert sorted(exact[0]) == sorted(first) and sorted(exact[1]) == sorted(second), exact
    assert all(exact[0][n] == exact[1][n] for n in overlap), \
        [(n, exact[0][n], exact[1][n]) for n in overlap]
    assert all(f"{exact[i][n]:.4f}" == run[n] for i, run in enumerate(logged) for n in run), \
        (exact, logged)
    print(f"node3 lost at step {reached} after {t_lost:.0f} s; COMPLETED {time.monotonic() - t0:.0f} s "
          f"(load {os.getloadavg()[0]:.1f}); resumed from {got['resumed_from']}, steps "
          f"{overlap} equal in both runs; {got['cpu_s_per_step']:.2f} CPU s per step")
    print("\n".join(ln for ln in out.splitlines() if ln.startswith("clusterkit: ")
                    and "step" not in ln[:20])[:3000])


TRAIN = REPO / "docs" / "examples" / "train.py"


@pytest.mark.extended
def test_a_user_script_survives_a_lost_node_and_goes_on_on_fewer(testbed_required: None,
                                                                  tmp_path: Path) -> None:
    """The same with a user's own script (docs/examples/train.py, no markers), 4 x 1:
    node3 lost after its step4 part is replicated; Slurm's requeue restores it onto node4
    (its replica's holder) and the job finishes; submitted again on 3 nodes, its newest
    checkpoint is resharded and the script loads $CLUSTERKIT_RESUME_TAG with load_universal
    on, and finishes."""

    def submit(bed: SlurmBed, inv: Path, nodes: int, steps: int, *extra: str) -> str:
        return _submitted(_clusterkit(bed, "sbatch", "-i", str(inv), "--nodes", str(nodes),
                                      "--storage", "node-local", "--zero-stage", "2",
                                      "--job-id", "user", "--partition", "debug", "--replicas", "1",
                                      *extra, "--submit", str(TRAIN), "--steps", str(steps),
                                      "--save-every", "4"))

    with user_slurm_bed(USER, slots=1) as (bed, inv):
        slurm_id = submit(bed, inv, 4, 16)
        _lose_node3_once(bed, "user", slurm_id, bed.tb.node_local_path(
            "node4", f"{LOCAL}/user.replicas/node2/step4/{REPLICA_MANIFEST}"))
        out = _completed(bed, "user", slurm_id)
        assert "node index 2 (was node3) -> node4: from its replica on node4" in out, out[-3000:]
        out = _completed(bed, "user", submit(bed, inv, 3, 20))
        # train.py saves every 4 steps but not at its last (16): step12 is the newest.
        assert "resumed from step12_universal at step 12 on 3 ranks" in out, out[-3000:]
        assert "world size 4 -> 3" in out, out[-3000:]
        print("\n".join(ln for ln in out.splitlines() if ln.startswith("clusterkit: "))[:3000])
