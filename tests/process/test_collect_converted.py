"""collect-ckpt and status of a program's tag dir after a reshard (issue 38 item 4;
checkpoints/collect/inside.py): HF's checkpoint-N, the old world's global_stepN beside
global_stepN_universal; accelerate's step_N, the conversion in the place of pytorch_model
(where its load_state's load_checkpoint(dir, tag="pytorch_model") reads it) and the old
world's tag kept as pytorch_model.set-aside. One real 2-rank ZeRO-2 save
(docs/examples/train.py, made once for the module) put in each layout, converted with the
repo's own converter and jobs/reshard's move into the tag dir; --consolidate fp32 of what
collect takes equals zero_to_fp32 of the original save exactly, and status says what
collect does."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clusterkit.checkpoints.collect.tags import answers
from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.collectplan import CheckpointIncomplete, WithoutMarkers
from clusterkit.checkpoints.replicas.health import list_all
from clusterkit.node.contract import (
    ACCELERATE_DS_SUBDIR,
    ASIDE_SUFFIX,
    ENV_CKPT_DIR,
    ENV_DS_CONFIG,
    LATEST_UNIVERSAL_FILE,
    UNIVERSAL_MARKER,
)
from clusterkit.remote.dispatch import DispatchTransport
from clusterkit.spec.zero import ZeroSpec, build_ds_config
from tests.collectnodes import local_collect_nodes
from tests.helpers import REPO, free_port, workload_env

TRAIN = REPO / "docs" / "examples" / "train.py"
TAG, DS = "checkpoint-3", "global_step3"
HF_FILES = ("trainer_state.json", "training_args.bin", "rng_state_0.pth", "rng_state_1.pth")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's one real save (two tests read it, neither changes it)."""
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    return _two_rank_save(tmp_path_factory.mktemp("save"))


def _two_rank_save(tmp: Path) -> Path:
    """2 CPU ranks, ZeRO-2, one save (step3) under tmp/ck."""
    ds = build_ds_config(ZeroSpec(stage=2, precision="fp32", micro_batch=2, grad_accum=1,
                                  world_size=2, warmup_steps=2, total_steps=4, torch_adam=True))
    (tmp / "ds.json").write_text(json.dumps(ds))
    argv = [sys.executable, "-m", "torch.distributed.run", f"--log-dir={tmp}/te", "--nnodes",
            "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
            str(free_port()), str(TRAIN), "--steps", "4", "--save-every", "3"]
    env = {**workload_env(), ENV_DS_CONFIG: str(tmp / "ds.json"), ENV_CKPT_DIR: str(tmp / "ck")}
    proc = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return tmp / "ck" / "step3"


def _hf_layout(saved: Path, root: Path) -> None:
    """HF's checkpoint-N: its own files, `latest`, DeepSpeed's tag inside."""
    tag = root / TAG
    shutil.copytree(saved, tag / DS)
    (tag / "latest").write_text(DS)
    for name in HF_FILES:
        (tag / name).write_text(name)


def _converted_node(tmp: Path, name: str, gathered: Path, ranks: tuple[int, ...], universal: bool) -> None:
    """One node of the old world after the reshard: HF's files, its own ranks' shards of
    the old tag and (on the new mapping) the conversion."""
    tag = tmp / name / "ckpt" / TAG
    src = gathered / TAG
    for p in src.rglob("*"):
        rel = p.relative_to(src).as_posix()
        if p.is_dir() or (rel.startswith(DS + "/") and "optim_states" in rel
                          and not any(f"zero_pp_rank_{r}_" in rel for r in ranks)):
            continue
        if not universal and (rel.startswith(DS + "_universal/") or rel == "latest_universal"):
            continue
        (tag / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, tag / rel)


@pytest.mark.slow
def test_a_converted_checkpoint_collects_and_consolidates_like_the_original(
        saved: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from clusterkit.checkpoints.convert import universal
    from clusterkit.checkpoints.convert.consolidate import consolidate, load_state_dict_dir
    from clusterkit.checkpoints.convert.tagdir import into_tag_dir

    capfd.readouterr()
    want = load_state_dict_dir(consolidate(str(saved.parent), "step3",
                                           out_dir=str(tmp_path / "want")).out_dir)
    assert "\r" not in "".join(capfd.readouterr()), "tqdm bar updates in consolidate's output"

    gathered = tmp_path / "gathered"
    _hf_layout(saved, gathered)
    u = universal.convert_to_universal(str(gathered), TAG, without_markers=WithoutMarkers(2))
    into_tag_dir(str(gathered), TAG, u)
    # The new mapping is node1 alone (node2 lost, no replica): the old tag lacks rank 1.
    _converted_node(tmp_path, "node1", gathered, (0,), universal=True)
    nodes = local_collect_nodes(tmp_path, 1)
    wm = WithoutMarkers(world_size=1, slots=(1,))  # what the job's record says now
    with DispatchTransport() as transport:
        status = answers(list_all(transport, nodes), without_markers=wm)
        report = collect(transport, nodes, CollectOptions(dest=str(tmp_path / "dest"),
                                                          without_markers=wm))
    plan = report.plan
    assert (plan.tag, plan.ds_subdir, plan.universal, plan.world_size) == \
        (TAG, DS + "_universal", True, 2)
    assert any("collected global_step3_universal" in n and "rank 1" in n for n in report.notes), \
        report.notes
    # status says what collect did: the same tag, collectable from the conversion
    assert [(a.tag, a.collectable, a.converted) for a in status] == \
        [(TAG, True, f"{TAG}/{DS}_universal")], [a.line() for a in status]
    dest = tmp_path / "dest" / TAG
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [*HF_FILES, DS + "_universal", "clusterkit-collect.json", "latest_universal"])

    capfd.readouterr()
    got = load_state_dict_dir(consolidate(str(tmp_path / "dest"), TAG, ds_subdir=plan.ds_subdir,
                                          universal=True).out_dir)
    assert "\r" not in "".join(capfd.readouterr())
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    diff = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
    assert diff == 0.0 and all(got[k].dtype == want[k].dtype for k in want)

    # Both old nodes listed (node2 back, as the old world): the old tag itself is whole
    # for its 2 ranks, so it is taken and the conversion is left out.
    _converted_node(tmp_path, "node2", gathered, (1,), universal=False)
    both = local_collect_nodes(tmp_path, 2)
    with DispatchTransport() as transport:
        report = collect(transport, both, CollectOptions(
            dest=str(tmp_path / "dest2"), without_markers=WithoutMarkers(2, (1, 1))))
    assert (report.plan.ds_subdir, report.plan.universal) == (DS, False)
    assert any("is left out" in n for n in report.notes), report.notes

    # Neither: the conversion cut on node1 and the old tag without rank 1 -> refused,
    # both reasons said.
    fp32 = next((tmp_path / "node1" / "ckpt" / TAG / (DS + "_universal") / "zero").rglob("fp32.pt"))
    fp32.write_bytes(fp32.read_bytes()[:10])
    with DispatchTransport() as transport, pytest.raises(CheckpointIncomplete) as err:
        collect(transport, nodes, CollectOptions(dest=str(tmp_path / "dest3"), without_markers=wm))
    text: Any = err.value.message
    assert "rank 1" in text and "cannot stand in" in text, text


ACC_TAG = "step_3"
ACC_FILES = ("random_states_0.pkl", "random_states_1.pkl")


def _hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _accelerate_layout(saved: Path, root: Path, ranks: tuple[int, ...]) -> Path:
    """accelerate's step_N as the ranks ``ranks`` left it on one node (all: gathered):
    DeepSpeed's tag pytorch_model/ (their optimizer shards), `latest`, their RNG states."""
    tag = root / ACC_TAG
    shutil.copytree(saved, tag / ACCELERATE_DS_SUBDIR, ignore=lambda _d, names: [
        n for n in names if "optim_states" in n and not any(f"rank_{r}_" in n for r in ranks)])
    (tag / "latest").write_text(ACCELERATE_DS_SUBDIR)
    for r in ranks:
        (tag / ACC_FILES[r]).write_text(ACC_FILES[r])
    return tag


@pytest.mark.slow
def test_accelerate_converted_in_place_keeps_the_original_and_collects_alike(
        saved: Path, tmp_path: Path) -> None:
    """The reshard of accelerate's step_N (OtherWorld.UNIVERSAL_INSIDE with the profile's
    ds_tag): the universal checkpoint at step_N/pytorch_model, the layout DeepSpeed's
    load_checkpoint(step_N, tag="pytorch_model") reads with load_universal on (the
    mp_rank_*_model_states.pt it globs, zero/ for the optimizer); the gathered original
    byte for byte as pytorch_model.set-aside, named by the marker; the node's own copy
    moved aside there before the push (again: nothing moves). On the new mapping (node1
    alone) status and collect-ckpt give one answer, the conversion, and its fp32 weights
    equal zero_to_fp32 of the original."""
    from clusterkit.checkpoints.convert import universal
    from clusterkit.checkpoints.convert.consolidate import consolidate, load_state_dict_dir
    from clusterkit.checkpoints.convert.tagdir import into_tag_dir
    from clusterkit.jobs.reshard import _move_aside
    from clusterkit.jobs.restore import push_files
    from clusterkit.spec.programs import ACCELERATE, PROFILES

    assert PROFILES[ACCELERATE].ds_tag == ACCELERATE_DS_SUBDIR
    want = load_state_dict_dir(consolidate(str(saved.parent), "step3",
                                           out_dir=str(tmp_path / "want")).out_dir)
    gathered = _accelerate_layout(saved, tmp_path / "gathered", (0, 1))
    before = _hashes(gathered / ACCELERATE_DS_SUBDIR)
    u = universal.convert_to_universal(str(tmp_path / "gathered"), ACC_TAG,
                                       without_markers=WithoutMarkers(2))
    u, files = into_tag_dir(str(tmp_path / "gathered"), ACC_TAG, u, in_place=True)
    conv, aside = gathered / ACCELERATE_DS_SUBDIR, gathered / (ACCELERATE_DS_SUBDIR + ASIDE_SUFFIX)
    assert u.tag == f"{ACC_TAG}/{ACCELERATE_DS_SUBDIR}" and (conv / "zero").is_dir()
    assert [p.name for p in conv.glob("mp_rank_*_model_states.pt")] == ["mp_rank_00_model_states.pt"]
    assert (conv / "zero" / "optimizer_state.pt").is_file() and any((conv / "zero").rglob("fp32.pt"))
    assert (gathered / LATEST_UNIVERSAL_FILE).read_text().strip() == ACCELERATE_DS_SUBDIR
    assert _hashes(aside) == before and (gathered / "latest").read_text() == ACCELERATE_DS_SUBDIR
    marker = json.loads((conv / UNIVERSAL_MARKER).read_text())
    assert (marker["source_tag"], marker["world_size"]) == (f"{ACC_TAG}/{aside.name}", 2)
    assert not any(rel.startswith(f"{ACC_TAG}/{aside.name}/") for rel in files)
    assert {f"{ACC_TAG}/{n}" for n in (*ACC_FILES, "latest")} <= set(files)

    # node1, the new mapping's only node, held old rank 0: its own copy moves aside first
    node1 = local_collect_nodes(tmp_path, 1)
    own = _accelerate_layout(saved, tmp_path / "node1" / "ckpt", (0,))
    mine = _hashes(own / ACCELERATE_DS_SUBDIR)
    with DispatchTransport() as transport:
        for _ in range(2):  # a second try (an earlier push cut short) moves nothing again
            _move_aside(transport, node1[0], u.tag, marker["source_tag"])
            push_files(transport, node1[0], str(tmp_path / "gathered"), files)
        assert _hashes(own / aside.name) == mine
        assert _hashes(own / ACCELERATE_DS_SUBDIR) == _hashes(conv)
        wm = WithoutMarkers(world_size=1, slots=(1,))
        status = answers(list_all(transport, node1), without_markers=wm)
        report = collect(transport, node1, CollectOptions(dest=str(tmp_path / "dest"),
                                                          without_markers=wm))
    plan = report.plan
    assert (plan.tag, plan.ds_subdir, plan.universal, plan.world_size) == \
        (ACC_TAG, ACCELERATE_DS_SUBDIR, True, 2), report.notes
    assert [(a.tag, a.collectable, a.converted) for a in status] == \
        [(ACC_TAG, True, f"{ACC_TAG}/{ACCELERATE_DS_SUBDIR}")], [a.line() for a in status]
    got = load_state_dict_dir(consolidate(str(tmp_path / "dest"), ACC_TAG,
                                          ds_subdir=plan.ds_subdir, universal=True).out_dir)
    assert set(got) == set(want)
    assert max(float((got[k].float() - want[k].float()).abs().max()) for k in want) == 0.0
