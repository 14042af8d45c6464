"""A requeued ``clusterkit sbatch`` run of a user's program readied as a launch's restart
is (issue 38, the batch script's half), without Slurm: the batch host's ``plan`` step
(node/slurm/replica.plan) over three "nodes" (a node-local checkpoint dir each, on this
machine) and every node's ``ready`` step, with the rule rendered into the batch script
(spec/resume.resume_rule) for the profile clusterkit detects; and the rendered script
itself, read by ``bash -n``.

HF Trainer's node-local layout: ``checkpoint-N/`` on every node (``--save_on_each_node``,
``use_node_local_storage``), DeepSpeed's ``checkpoint-N/latest`` on global rank 0's only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from clusterkit.errors import LaunchError
from clusterkit.node.ckpt.listing import listing
from clusterkit.node.contract import ASIDE_SUFFIX
from clusterkit.node.slurm import replica, restore
from clusterkit.plan.build import plan_job
from clusterkit.render.artifacts import render_all
from clusterkit.slurm.submit import other_count
from clusterkit.spec.job import JobOptions
from clusterkit.spec.programs import detect
from clusterkit.spec.resume import resume_rule
from tests.render_cases import FACTS, inventory
from tests.synthetic_ckpt import write_hf_save

HOSTS = ["n1", "n2", "n3"]
HF_SRC = "from transformers import Trainer, TrainingArguments\n"
ACC_SRC = "from accelerate import Accelerator\nacc.save_state(d)\n"
SNAP_SRC = "import torch\nif rank == 0:\n    torch.save(snapshot, path)\n"
UNKNOWN_SRC = "import deepspeed\nprint('training')\n"


def _hf_saves(roots: dict[str, Path], step: int, *, cut: str | None = None) -> None:
    """HF's node-local checkpoint-``step`` on every node (tests/synthetic_ckpt.py: 2 ranks a
    node), DeepSpeed's ``checkpoint-N/latest`` on global rank 0's node only; ``cut``: the
    node killed before DeepSpeed wrote its files."""
    tag = write_hf_save([str(roots[h]) for h in HOSTS], step)
    for h in HOSTS[1:]:
        (roots[h] / tag / "latest").unlink()
    if cut is not None:
        shutil.rmtree(roots[cut] / tag / f"global_step{step}")


def _acc_part(root: Path, index: int, step: int, *, whole: bool = True) -> None:
    """Node ``index``'s part of an accelerate ``save_state(dir/step_N)`` (2 ranks a node)."""
    tag = root / f"step_{step}"
    inner = tag / "pytorch_model"
    inner.mkdir(parents=True)
    if whole:
        (inner / "mp_rank_00_model_states.pt").write_bytes(b"model" * 50)
        for r in (2 * index, 2 * index + 1):
            (inner / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(os.urandom(300))
    (tag / f"random_states_{index}.pkl").write_bytes(b"rng")


def _rule(src: str, args: tuple[str, ...] = ()) -> dict[str, object]:
    choice = detect(workload=False, args=args, script_text=src)
    return resume_rule(choice, job_id="j", ckpt_dir="/ck/j", node_local=True, workload=False)


def _plan(tmp_path: Path, roots: dict[str, Path], rule: dict[str, object],
          hosts: list[str] | None = None, old: list[str] | None = None
          ) -> tuple[int, Path]:
    """The batch host's ``plan`` step over the nodes' listings; (its status, the run dir)."""
    hosts, old = hosts or HOSTS, old or HOSTS
    run = tmp_path / "run"
    (run / "list").mkdir(parents=True, exist_ok=True)
    (run / "hosts").write_text("\n".join(hosts) + "\n")
    (run / "old_hosts").write_text("\n".join(old) + "\n")
    for h in hosts:
        (run / "list" / f"{h}.json").write_text(json.dumps(listing(str(roots[h]), None)))
    conf = {"job_id": "j", "job_dir": str(tmp_path / "jobdir"), "ckpt_dir": "/ck/j",
            "rpn": 2, "markers": False, "replicas": 0, "program": rule}
    return replica.plan(conf, str(run)), run


def _ready(run: Path, roots: dict[str, Path]) -> None:
    """Every node's ``ready`` step, its prep.json pointed at the node's own dir."""
    prep = json.loads((run / replica.PREP_FILE).read_text())
    for h, root in roots.items():
        mine = run / f"prep-{h}"
        mine.mkdir()
        (mine / replica.PREP_FILE).write_text(json.dumps({**prep, "ckpt_dir": str(root)}))
        assert replica.ready_node(str(root), str(mine), h) == 0


def test_hf_requeued_on_its_nodes_resumes_from_the_newest_complete_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roots = {h: tmp_path / h for h in HOSTS}
    _hf_saves(roots, 10)
    _hf_saves(roots, 20, cut="n3")  # node3 was killed mid-save
    status, run = _plan(tmp_path, roots, _rule(HF_SRC))
    said = capsys.readouterr().out
    assert status == 0, said
    words = (run / replica.RESUME_FILE).read_text().split("\0")
    assert words == ["--resume_from_checkpoint", "/ck/j/checkpoint-10", ""]
    assert ("clusterkit: hf-trainer: resuming from checkpoint-10, the newest checkpoint "
            "complete on every node (--resume_from_checkpoint /ck/j/checkpoint-10)") in said
    assert "every node of this run" in said and "holds its part of checkpoint-10" in said
    _ready(run, roots)
    said = capsys.readouterr().out
    for h in HOSTS:  # DeepSpeed's latest inside the tag dir, on every node
        assert (roots[h] / "checkpoint-10" / "latest").read_text() == "global_step10"
    assert "clusterkit: n2: checkpoint-10/latest -> global_step10" in said
    # HF is told which one to load: nothing is moved aside for it
    assert (roots["n1"] / "checkpoint-20").is_dir()


def test_accelerate_requeued_has_the_newer_unassemblable_save_moved_aside(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roots = {h: tmp_path / h for h in HOSTS}
    for i, h in enumerate(HOSTS):
        _acc_part(roots[h], i, 40)
        _acc_part(roots[h], i, 50, whole=h != "n2")
    status, run = _plan(tmp_path, roots, _rule(ACC_SRC))
    said = capsys.readouterr().out
    assert status == 0, said
    assert not (run / replica.RESUME_FILE).exists()  # it loads the newest it finds
    assert "moving step_50 aside on every node (step_50 cannot be assembled" in said
    _ready(run, roots)
    for h in HOSTS:
        assert not (roots[h] / "step_50").exists()
        assert (roots[h] / f"step_50{ASIDE_SUFFIX}").is_dir()  # kept, renamed
        assert (roots[h] / "step_40").is_dir()
    # the next run's rules do not take the set-aside save for a tag
    listings = {h: listing(str(roots[h]), None) for h in HOSTS}
    assert restore.candidate_tags(listings, False) == ["step_40"]


def test_a_snapshot_saved_on_one_node_is_on_every_node_before_the_ranks_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pytorch's DDP tutorial: rank 0 saves snapshot.pt on its own node; every rank loads it
    if it exists (:func:`_snapshots`: n2 holds none, n3 an older one)."""
    roots = _snapshots(tmp_path)
    status, run = _plan(tmp_path, roots, _rule(SNAP_SRC))
    said = capsys.readouterr().out
    assert status == 0, said
    assert ("clusterkit: snapshot.pt: written by n1 only; copied to n2,n3 (sha256 verified) "
            "before the ranks start") in said, said
    prep = json.loads((run / replica.PREP_FILE).read_text())
    _ready_everywhere(roots, run)
    said = capsys.readouterr().out
    for h in ("n2", "n3"):
        assert (roots[h] / "snapshot.pt").read_bytes() == b"epoch 40" * 100, h
        assert (roots[h] / "snapshot.pt").stat().st_mtime == prep["spread"]["snapshot.pt"]["mtime"]
        assert f"clusterkit: {h}: snapshot.pt: copied from n1 (sha256 verified)" in said
    # the next run finds every copy the same: nothing to copy
    status, run = _plan(tmp_path / "again", roots, _rule(SNAP_SRC))
    assert json.loads((run / replica.PREP_FILE).read_text())["spread"] == {}


def _ready_everywhere(roots: dict[str, Path], run: Path) -> None:
    """Every node's ready step at once (node -> its checkpoint dir), as the batch script's
    srun runs them: a copy waits in the run dir for the node it is for."""
    threads = [threading.Thread(target=replica.ready_node, args=(str(root), str(run), h))
               for h, root in roots.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def _snapshots(tmp_path: Path) -> dict[str, Path]:
    """A snapshot job's three node-local dirs: n1 (rank 0's) holds the newest snapshot, n2
    none (its disk was replaced), n3 an older copy (an earlier run's spread)."""
    roots = {h: tmp_path / h for h in HOSTS}
    for root in roots.values():
        root.mkdir()
    (roots["n1"] / "snapshot.pt").write_bytes(b"epoch 40" * 100)
    (roots["n3"] / "snapshot.pt").write_bytes(b"epoch 10" * 100)
    os.utime(roots["n3"] / "snapshot.pt", (1000, 1000))
    return roots


def test_a_snapshot_saved_on_3_nodes_goes_on_on_2_as_it_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Submitted again (or requeued) on n1,n2: the snapshot loads on any world size, so
    the plan step converts nothing and puts the newest copy on the node that lacks it."""
    roots = _snapshots(tmp_path)
    now = {h: roots[h] for h in ("n1", "n2")}
    status, run = _plan(tmp_path, now, _rule(SNAP_SRC), hosts=["n1", "n2"])
    said = capsys.readouterr().out
    assert status == 0, said
    assert ("clusterkit: job j: this run got 2 nodes, n1,n2; the checkpoint was saved on 3, "
            "n1,n2,n3: it loads on any world size as it is: its newest copy is put on every "
            "node, nothing converted") in said, said
    assert ("clusterkit: snapshot.pt: written by n1 only; copied to n2 (sha256 verified) "
            "before the ranks start") in said, said
    for word in ("reshard", "plan.json", replica.RESUME_FILE):
        assert not (run / word).exists(), word
    _ready_everywhere(now, run)
    assert (roots["n2"] / "snapshot.pt").read_bytes() == b"epoch 40" * 100
    assert "clusterkit: n2: snapshot.pt: copied from n1 (sha256 verified)" in capsys.readouterr().out


def test_a_snapshot_run_without_its_writer_node_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On n2,n3 the newest snapshot (n1's) cannot be read: n3's older copy would be a
    silent step back, so the run stops naming n1 and the fix."""
    roots = _snapshots(tmp_path)
    status, run = _plan(tmp_path, {h: roots[h] for h in ("n2", "n3")}, _rule(SNAP_SRC),
                        hosts=["n2", "n3"])
    said = capsys.readouterr().err
    assert status == restore.CANNOT_ASSEMBLE
    assert ("clusterkit: job j: its newest snapshot is on n1 (rank 0's node of n1,n2,n3), "
            "which this run (n2,n3) did not get: not starting. Submit it on nodes including "
            "n1") in said, said
    assert "clusterkit collect-ckpt j" in said and len(said.strip().splitlines()) == 1
    assert not (run / replica.PREP_FILE).exists()


def test_submitting_on_another_number_of_nodes_by_the_profile(
        capsys: pytest.CaptureFixture[str]) -> None:
    """submit's check (slurm/submit.other_count), the plan step's rule said at submit: a
    snapshot goes with its writer's node; HF is refused; the workload is resharded."""
    assert other_count(_rule(SNAP_SRC), "j", "n[1-3]", HOSTS, 2) == ["--nodelist=n1"]
    assert "submitting on 2 nodes including n1" in capsys.readouterr().err
    with pytest.raises(LaunchError, match="converts no hf-trainer checkpoint for 2"):
        other_count(_rule(HF_SRC), "j", "n[1-3]", HOSTS, 2)
    assert other_count({}, "j", "n[1-3]", HOSTS, 2) == []
    assert "reshards the checkpoint" in capsys.readouterr().err


def test_an_unknown_program_is_not_requeued_into_step_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roots = {h: tmp_path / h for h in HOSTS}
    _hf_saves(roots, 10)
    status, run = _plan(tmp_path, roots, _rule(UNKNOWN_SRC))
    said = capsys.readouterr().err
    assert status == restore.CANNOT_ASSEMBLE
    assert ("job j would restart at step 0: checkpoint checkpoint-10 in /ck/j is complete on "
            "every node") in said, said
    assert "--resume-arg 'FLAG {dir}'" in said
    assert not (run / replica.PREP_FILE).exists()


def test_hf_on_another_number_of_nodes_is_refused_under_sbatch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roots = {h: tmp_path / h for h in HOSTS}
    _hf_saves(roots, 10)
    roots["n4"] = tmp_path / "n4"
    status, _ = _plan(tmp_path, roots, _rule(HF_SRC), hosts=[*HOSTS, "n4"])
    said = capsys.readouterr().err
    assert status == restore.CANNOT_ASSEMBLE
    assert ("its checkpoint checkpoint-10 was saved on 3 nodes (n1,n2,n3), this run got 4 "
            "(n1,n2,n3,n4): clusterkit sbatch converts no hf-trainer checkpoint") in said, said


def test_nothing_saved_yet_starts_fresh(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    roots = {h: tmp_path / h for h in HOSTS}
    status, run = _plan(tmp_path, roots, _rule(HF_SRC))
    assert status == 0
    assert "no checkpoint on its nodes" in capsys.readouterr().out
    assert not (run / replica.RESUME_FILE).exists()


def _hf_script(tmp_path: Path, args: tuple[str, ...]) -> str:
    o = JobOptions(job_id="j", backend="torchrun", script="train.py", script_args=args,
                   storage="node-local", ckpt_dir="/scratch/ckpt", gpus_per_node=1, nodes=3)
    facts = dataclasses.replace(FACTS, script_text=HF_SRC)
    script = render_all(plan_job(inventory("a800-7x2"), o, facts)).artifacts["sbatch.sh"]
    path = tmp_path / "sbatch.sh"
    path.write_text(script)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return script


def test_the_batch_script_passes_the_resume_words_to_the_program(tmp_path: Path) -> None:
    script = _hf_script(tmp_path, ("--output_dir", "/scratch/ckpt/j"))
    assert "resume_args=()\nif [ -n \"$first_nodes\" ]; then" in script  # same nodes too
    assert "node_program ready ||" in script
    assert script.count('${resume_args[@]+"${resume_args[@]}"} &') == 1
    line = next(ln for ln in script.splitlines() if ln.startswith("replica_conf="))
    conf = json.loads(shlex.split(line.split("=", 1)[1])[0])
    assert conf["program"]["resume"] == ["--resume_from_checkpoint", "{dir}"]
    assert conf["program"]["nested_latest"] is True


def test_the_program_s_own_resume_flag_gives_way(tmp_path: Path) -> None:
    script = _hf_script(tmp_path, ("--output_dir", "/scratch/ckpt/j",
                                   "--resume_from_checkpoint", "/scratch/ckpt/j/checkpoint-5"))
    both = script.split("# The program's own resume flag gives way", 1)[1].splitlines()
    resumed, fresh = both[2], both[4]
    assert "checkpoint-5" not in resumed
    assert resumed.endswith(' --save_on_each_node ${resume_args[@]+"${resume_args[@]}"} &')
    assert fresh.endswith(" --resume_from_checkpoint /scratch/ckpt/j/checkpoint-5 "
                          "--save_on_each_node &")
