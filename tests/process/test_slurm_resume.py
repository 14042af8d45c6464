"""A requeued ``clusterkit sbatch`` run of a user's program readied as a launch's restart
is (issue 38, the batch script's half), without Slurm: the batch host's ``plan`` step
(node/slurm/replica.plan) over three "nodes" (a node-local checkpoint dir each, on this
machine) and every node's ``ready`` step, with the rule rendered into the batch script
(spec/resume.resume_rule) for the profile clusterkit detects; and the rendered script
itself, read by ``bash -n``.

HF Trainer's node-local layout: ``checkpoint-N/`` on every node (``--save_on_each_node``,
``use_node_local_storage``), DeepSpeed's ``checkpoint-N/latest`` on global rank 0's only.

On another number of nodes (3 -> 2), HF's and accelerate's real 3-rank ZeRO-2 saves go
through the whole chain, the batch script's steps called in its order: ``plan``,
``gather``, the conversion step (jobs/slurm_reshard.py: inside the tag dir), ``spread``,
``ready``; then a requeue before the next save (the conversion step's ``again``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clusterkit.checkpoints.listing import parse_listing
from clusterkit.errors import LaunchError
from clusterkit.jobs import slurm_reshard
from clusterkit.jobs.reshard import converted_inside
from clusterkit.node.ckpt.listing import listing
from clusterkit.node.contract import ASIDE_SUFFIX, ENV_CKPT_DIR, ENV_DS_CONFIG, UNIVERSAL_MARKER
from clusterkit.node.slurm import replica, restore
from clusterkit.plan.build import plan_job
from clusterkit.render.artifacts import render_all
from clusterkit.slurm.submit import other_count
from clusterkit.spec.job import JobOptions
from clusterkit.spec.programs import (
    ACCELERATE_CONFIG_ENV,
    DERIVED_DS_CONFIG,
    OWN_CONFIG_FIX,
    OWN_CONFIG_WHY,
    detect,
)
from clusterkit.spec.resume import resume_rule
from clusterkit.spec.zero import ZeroSpec, build_ds_config
from tests.helpers import REPO, free_port, torchrun_exit_abort, workload_env
from tests.render_cases import FACTS, inventory
from tests.synthetic_ckpt import write_hf_save, write_replica

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


def _rule(src: str, args: tuple[str, ...] = (), *, derived: bool = False) -> dict[str, object]:
    choice = detect(workload=False, args=args, script_text=src)
    return resume_rule(choice, job_id="j", ckpt_dir="/ck/j", node_local=True, workload=False,
                       derived=derived)


def _plan(tmp_path: Path, roots: dict[str, Path], rule: dict[str, object],
          hosts: list[str] | None = None, old: list[str] | None = None, *, rpn: int = 2,
          run_name: str = "run", again: Path | None = None) -> tuple[int, Path]:
    """The batch host's ``plan`` step over the nodes' listings; (its status, the run dir).
    ``again``: the derived config, the script's ``slurm_reshard again`` step first."""
    hosts, old = hosts or HOSTS, old or HOSTS
    run = tmp_path / run_name
    (run / "list").mkdir(parents=True, exist_ok=True)
    (run / "hosts").write_text("\n".join(hosts) + "\n")
    (run / "old_hosts").write_text("\n".join(old) + "\n")
    for h in hosts:
        (run / "list" / f"{h}.json").write_text(json.dumps(listing(str(roots[h]), None)))
    if again is not None:
        for line in slurm_reshard.again(str(run), str(again), rpn):
            print(f"clusterkit: {line}")
    conf = {"job_id": "j", "job_dir": str(tmp_path / "jobdir"), "ckpt_dir": "/ck/j",
            "rpn": rpn, "markers": False, "replicas": 0, "program": rule}
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


def test_nothing_saved_yet_starts_fresh(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    roots = {h: tmp_path / h for h in HOSTS}
    status, run = _plan(tmp_path, roots, _rule(HF_SRC))
    assert status == 0
    assert "no checkpoint on its nodes" in capsys.readouterr().out
    assert not (run / replica.RESUME_FILE).exists()


def _hf_script(tmp_path: Path, args: tuple[str, ...], files: dict[str, str] | None = None
               ) -> str:
    o = JobOptions(job_id="j", backend="torchrun", script="train.py", script_args=args,
                   storage="node-local", ckpt_dir="/scratch/ckpt", gpus_per_node=1, nodes=3)
    facts = dataclasses.replace(FACTS, script_text=HF_SRC, program_files=files or {})
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


def test_the_batch_script_converts_hf_inside_its_tag_dir_with_the_derived_config(
        tmp_path: Path) -> None:
    """HF with a DeepSpeed config of the user's (no use_node_local_storage): on another
    number of nodes the conversion step converts for hf-trainer and turns load_universal
    on in the derived copy; a later run checks for a tag converted so (the again step)."""
    script = _hf_script(tmp_path, ("--output_dir", "/scratch/ckpt/j", "--deepspeed", "ds.json"),
                        {"ds.json": json.dumps({"zero_optimization": {"stage": 2}})})
    line = next(ln for ln in script.splitlines() if ln.startswith("replica_conf="))
    assert json.loads(shlex.split(line.split("=", 1)[1])[0])["program"]["other_world"] == "convert"
    assert re.search(rf"^ds_cfg=\S+/j/{re.escape(DERIVED_DS_CONFIG)}$", script, re.M), script
    assert 'clusterkit.jobs.slurm_reshard "$rdir" "$ds_cfg" 3 0 hf-trainer' in script
    assert 'grep -qs latest_universal "$rdir"/list/*.json' in script
    assert 'clusterkit.jobs.slurm_reshard again "$rdir" "$ds_cfg" 1' in script


def test_the_program_s_own_resume_flag_gives_way(tmp_path: Path) -> None:
    script = _hf_script(tmp_path, ("--output_dir", "/scratch/ckpt/j",
                                   "--resume_from_checkpoint", "/scratch/ckpt/j/checkpoint-5"))
    both = script.split("# The program's own resume flag gives way", 1)[1].splitlines()
    resumed, fresh = both[2], both[4]
    assert "checkpoint-5" not in resumed
    assert resumed.endswith(' --save_on_each_node ${resume_args[@]+"${resume_args[@]}"} &')
    assert fresh.endswith(" --resume_from_checkpoint /scratch/ckpt/j/checkpoint-5 "
                          "--save_on_each_node &")


# -- HF Trainer on another number of nodes: its checkpoint-N converted inside itself, as
# a launch's reshard does (checkpoints/convert/tagdir.py), by the batch script's steps.

TRAIN = REPO / "docs" / "examples" / "train.py"
HF_TAG, HF_DS = "checkpoint-3", "global_step3"


@pytest.fixture(scope="module")
def three_rank_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real ZeRO-2 save of 3 CPU ranks (docs/examples/train.py, step3): DeepSpeed's
    tag dir, what HF's checkpoint-3/global_step3 holds on the 3 nodes together."""
    pytest.importorskip("deepspeed")
    tmp = tmp_path_factory.mktemp("save3")
    ds = build_ds_config(ZeroSpec(stage=2, precision="fp32", micro_batch=1, grad_accum=1,
                                  world_size=3, warmup_steps=1, total_steps=4, torch_adam=True))
    (tmp / "ds.json").write_text(json.dumps(ds))
    argv = [sys.executable, "-m", "torch.distributed.run", f"--log-dir={tmp}/te", "--nnodes",
            "1", "--nproc_per_node", "3", "--master_addr", "127.0.0.1", "--master_port",
            str(free_port()), str(TRAIN), "--steps", "4", "--save-every", "3", "--hidden", "8"]
    env = {**workload_env(), ENV_DS_CONFIG: str(tmp / "ds.json"), ENV_CKPT_DIR: str(tmp / "ck")}
    proc = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and not (torchrun_exit_abort(proc.stdout + proc.stderr)
                                     and (tmp / "ck" / "step3").is_dir()):
        raise AssertionError((proc.stdout + proc.stderr)[-3000:])
    return tmp / "ck" / "step3"


def _hf_nodes(tmp_path: Path, saved: Path) -> dict[str, Path]:
    """HF's node-local checkpoint-3 on n1..n3 (1 rank a node): every node DeepSpeed's model
    states (use_node_local_storage) and its rank's optimizer shard, its own rng state and
    trainer_state.json, ``latest`` on global rank 0's node only; n3's part replicated on
    n1 (--replicas 1: the ring's copy, node/replicas/rules.ring)."""
    roots = {h: tmp_path / h for h in HOSTS}
    for rank, h in enumerate(HOSTS):
        inner = roots[h] / HF_TAG / HF_DS
        inner.mkdir(parents=True)
        for f in saved.iterdir():
            if f.name.startswith("mp_rank_") or f.name.startswith(f"zero_pp_rank_{rank}_"):
                shutil.copy2(f, inner / f.name)
        (roots[h] / HF_TAG / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
        (roots[h] / HF_TAG / f"rng_state_{rank}.pth").write_bytes(os.urandom(64))
    (roots["n1"] / HF_TAG / "latest").write_text(HF_DS)
    write_replica(str(roots["n3"]), str(roots["n1"]), 2, HF_TAG, job_id="j",
                  source_host="n3", holder="n1")
    return roots


def test_hf_saved_on_3_nodes_is_converted_inside_its_checkpoint_for_2(
        tmp_path: Path, three_rank_save: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Submitted again with --nodes 2 (n1, n2; n3's part a replica on n1): the plan step
    reshards checkpoint-3, ``gather`` puts its 3 parts in the run dir, the conversion step
    converts global_step3 beside itself (global_step3_universal, latest_universal) and
    turns load_universal on in the derived config for this run (the plain file kept),
    ``spread`` merges the tag dir into each node's copy (HF's files and every rank's rng
    state, the old world's tag neither pushed nor removed), and ``ready`` and the resume
    words point HF at checkpoint-3."""
    roots = _hf_nodes(tmp_path, three_rank_save)
    now = {h: roots[h] for h in ("n1", "n2")}
    rule = _rule(HF_SRC, derived=True)
    status, run = _plan(tmp_path, now, rule, hosts=["n1", "n2"], rpn=1)
    said = capsys.readouterr().out
    assert status == 0, said
    assert ("this run got 2 nodes, n1,n2; the checkpoint was saved on 3, n1,n2,n3: resharding "
            f"{HF_TAG}") in said, said
    assert "node index 2 (was n3): from its replica on n1" in said, said
    words = (run / replica.RESUME_FILE).read_text().split("\0")
    assert words == ["--resume_from_checkpoint", f"/ck/j/{HF_TAG}", ""]
    the_plan = json.loads((run / "plan.json").read_text())
    assert the_plan["world"] == 3
    for h, root in now.items():
        assert restore.gather(the_plan, h, str(root), str(run / replica.GATHER_DIR)) == 0

    derived = tmp_path / "jobdir" / DERIVED_DS_CONFIG
    derived.parent.mkdir(parents=True, exist_ok=True)
    plain = json.dumps({"train_micro_batch_size_per_gpu": "auto",
                        "checkpoint": {"use_node_local_storage": True}})
    derived.write_text(plain)
    lines = slurm_reshard.reshard(str(run), str(derived), 2, False, "hf-trainer")
    assert lines[0].startswith(f"converted to {HF_TAG}_universal in "), lines
    assert lines[1].startswith(f"world size 3 -> 2: DeepSpeed loads {HF_TAG}/{HF_DS}_universal "
                               "(latest_universal) with checkpoint.load_universal on in "
                               f"{DERIVED_DS_CONFIG}, this run only"), lines
    assert json.loads(derived.read_text())["checkpoint"] == {"use_node_local_storage": True,
                                                             "load_universal": True}
    assert (tmp_path / "jobdir" / f"{DERIVED_DS_CONFIG}.plain").read_text() == plain
    assert (run / replica.UNIVERSAL_FILE).read_text() == f"{HF_TAG}/{HF_DS}_universal\n"

    own = {h: sorted(p.name for p in (root / HF_TAG / HF_DS).iterdir()) for h, root in now.items()}
    for h, root in now.items():
        assert replica.spread(str(root), str(run), h) == 0
    said = capsys.readouterr().out
    pushed = json.loads((run / replica.SPREAD_FILE).read_text())["files"]
    assert not [rel for rel in pushed if rel.startswith(f"{HF_TAG}/{HF_DS}/")]
    assert f"clusterkit: n2: {len(pushed)} files of the converted {HF_TAG} in place" in said, said
    for h, root in now.items():
        tag = root / HF_TAG
        assert (tag / "latest_universal").read_text() == f"{HF_DS}_universal\n"
        assert (tag / f"{HF_DS}_universal" / UNIVERSAL_MARKER).is_file()
        assert (tag / "latest").read_text() == HF_DS, h  # global rank 0's, on every node
        assert sorted(p.name for p in tag.glob("rng_state_*.pth")) == \
            [f"rng_state_{r}.pth" for r in range(3)], h
        # the old world's tag: this node's own files, none added, none removed
        assert sorted(p.name for p in (tag / HF_DS).iterdir()) == own[h], h
        assert not list(tag.rglob("*.clusterkit-partial"))

    _ready(run, now)
    assert "latest ->" not in capsys.readouterr().out  # every node has checkpoint-3/latest
    # collect-ckpt's and a launch's rule (jobs/reshard.converted_inside): the conversion
    # is complete on both nodes of the new mapping
    listings = [parse_listing(h, i, str(root), json.dumps(listing(str(root), None)))
                for i, (h, root) in enumerate(now.items())]
    assert converted_inside(listings, [HF_TAG]) == HF_TAG

    # The run ends (the script puts the plain config back); Slurm requeues the job on the
    # same nodes before the next save: it resumes from the converted tag again, with
    # load_universal on for that run (launch's rule, jobs/reshard.converted_again). Without
    # the again step the plan finds each node's own part of the old 3-rank global_step3
    # "complete" for the 2 ranks and HF would load it with the plain config.
    os.replace(f"{derived}.plain", derived)
    status, run = _plan(tmp_path, now, rule, hosts=["n1", "n2"], old=["n1", "n2"], rpn=1,
                        run_name="run2", again=derived)
    said = capsys.readouterr().out
    assert status == 0, said
    assert (f"clusterkit: {HF_TAG}: resuming from its DeepSpeed tag converted by the reshard "
            "(latest_universal), checkpoint.load_universal on for this run") in said, said
    assert (run / replica.RESUME_FILE).read_text().split("\0")[:2] == \
        ["--resume_from_checkpoint", f"/ck/j/{HF_TAG}"]
    assert json.loads(derived.read_text())["checkpoint"]["load_universal"] is True
    # a complete save since (checkpoint-6 by the 2 ranks): the plain config, that save
    os.replace(f"{derived}.plain", derived)
    for rank, root in enumerate(now.values()):
        later = root / "checkpoint-6" / "global_step6"
        later.mkdir(parents=True)
        for f in (root / HF_TAG / HF_DS).iterdir():
            if f.name.startswith("mp_rank_"):
                shutil.copy2(f, later / f.name)
        (later / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"o" * 64)
    status, run = _plan(tmp_path, now, rule, hosts=["n1", "n2"], old=["n1", "n2"], rpn=1,
                        run_name="run3", again=derived)
    said = capsys.readouterr().out
    assert status == 0 and "resuming from checkpoint-6" in said, said
    assert "load_universal" not in derived.read_text()


def test_hf_with_its_own_node_local_config_is_refused_on_another_count(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No derived config (the user's names use_node_local_storage itself): clusterkit edits
    none of the user's files, so the plan step refuses with launch's reason and fixes, and
    submit's check says it first."""
    roots = {h: tmp_path / h for h in HOSTS}
    _hf_saves(roots, 10)
    roots["n4"] = tmp_path / "n4"
    status, _ = _plan(tmp_path, roots, _rule(HF_SRC), hosts=[*HOSTS, "n4"])
    said = capsys.readouterr().err
    assert status == restore.CANNOT_ASSEMBLE
    assert ("clusterkit sbatch converts no hf-trainer checkpoint (checkpoint-N/ "
            "(trainer_state.json, DeepSpeed's global_stepN/ and latest inside)) "
            f"for another number of nodes: {OWN_CONFIG_WHY}: not starting. Submit it on 3 "
            f"nodes, or {OWN_CONFIG_FIX}, or take its weights") in said, said
    with pytest.raises(LaunchError, match="edits no file of yours") as err:
        other_count(_rule(HF_SRC), "j", "n[1-3]", HOSTS, 2)
    assert OWN_CONFIG_FIX in (err.value.hint or "")
    assert other_count(_rule(HF_SRC, derived=True), "j", "n[1-3]", HOSTS, 2) == []


def test_accelerate_saved_on_3_nodes_is_converted_in_place_for_2(
        tmp_path: Path, three_rank_save: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """accelerate's step_3/pytorch_model (3 ranks, n3's part a replica on n1) on n1, n2:
    converted in its place, each node's own pytorch_model (its rank's optimizer shard)
    renamed pytorch_model.set-aside first and kept, the conversion merged in, marker
    last; load_universal in the derived config for this run."""
    roots = {h: tmp_path / h for h in HOSTS}
    for rank, h in enumerate(HOSTS):
        inner = roots[h] / "step_3" / "pytorch_model"
        inner.mkdir(parents=True)
        for f in three_rank_save.iterdir():
            if f.name.startswith("mp_rank_") or f.name.startswith(f"zero_pp_rank_{rank}_"):
                shutil.copy2(f, inner / f.name)
        (roots[h] / "step_3" / f"random_states_{rank}.pkl").write_bytes(os.urandom(32))
    write_replica(str(roots["n3"]), str(roots["n1"]), 2, "step_3", job_id="j",
                  source_host="n3", holder="n1")
    now = {h: roots[h] for h in ("n1", "n2")}
    status, run = _plan(tmp_path, now, _rule(ACC_SRC, derived=True), hosts=["n1", "n2"], rpn=1)
    assert status == 0, capsys.readouterr()
    the_plan = json.loads((run / "plan.json").read_text())
    for h, root in now.items():
        assert restore.gather(the_plan, h, str(root), str(run / replica.GATHER_DIR)) == 0
    derived = tmp_path / "jobdir" / DERIVED_DS_CONFIG
    derived.parent.mkdir(parents=True, exist_ok=True)
    derived.write_text("{}")
    lines = slurm_reshard.reshard(str(run), str(derived), 2, False, "accelerate")
    assert ("accelerate's load_state loads step_3/pytorch_model, now DeepSpeed's universal "
            "checkpoint (the old world's tag kept as step_3/pytorch_model.set-aside) with "
            "checkpoint.load_universal on in ds_config.program.json "
            f"(${ACCELERATE_CONFIG_ENV}), this run only") in lines[1], lines
    assert json.loads(derived.read_text()) == {"checkpoint": {"load_universal": True}}
    own = {h: sorted(p.name for p in (root / "step_3" / "pytorch_model").iterdir())
           for h, root in now.items()}
    for h, root in now.items():
        assert replica.spread(str(root), str(run), h) == 0
    said = capsys.readouterr().out
    for h, root in now.items():
        tag = root / "step_3"
        assert f"clusterkit: {h}: moved step_3/pytorch_model aside to " \
               "step_3/pytorch_model.set-aside (kept)" in said, said
        assert sorted(p.name for p in (tag / f"pytorch_model{ASIDE_SUFFIX}").iterdir()) == own[h]
        assert (tag / "pytorch_model" / UNIVERSAL_MARKER).is_file()
        assert not list((tag / "pytorch_model").glob("*optim_states.pt"))
        assert (tag / "latest_universal").read_text() == "pytorch_model\n"
        assert sorted(p.name for p in tag.glob("random_states_*.pkl")) == \
            [f"random_states_{r}.pkl" for r in range(3)]
    # spread again (a step retried): the place holds the conversion, nothing moved twice
    assert replica.spread(str(now["n2"]), str(run), "n2") == 0
    assert "moved" not in capsys.readouterr().out
    assert not (now["n2"] / "step_3" / f"pytorch_model{ASIDE_SUFFIX}2").exists()
