"""collect-ckpt and status of HF's checkpoint-N after a reshard (issue 38 item 4): the old
world's global_stepN beside global_stepN_universal (checkpoints/collect/inside.py). A real
2-rank ZeRO-2 save (docs/examples/train.py) put in HF's layout, converted with the repo's
own converter and jobs/reshard's move into the tag dir; --consolidate fp32 of what collect
takes equals zero_to_fp32 of the original save exactly, and status says what collect does."""

from __future__ import annotations

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
from clusterkit.node.contract import ENV_CKPT_DIR, ENV_DS_CONFIG
from clusterkit.remote.dispatch import DispatchTransport
from clusterkit.spec.zero import ZeroSpec, build_ds_config
from tests.collectnodes import local_collect_nodes
from tests.helpers import REPO, free_port, workload_env

TRAIN = REPO / "docs" / "examples" / "train.py"
TAG, DS = "checkpoint-3", "global_step3"
HF_FILES = ("trainer_state.json", "training_args.bin", "rng_state_0.pth", "rng_state_1.pth")


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
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    from clusterkit.checkpoints.convert import universal
    from clusterkit.checkpoints.convert.consolidate import consolidate, load_state_dict_dir
    from clusterkit.jobs.reshard import _into_tag_dir

    saved = _two_rank_save(tmp_path)
    capfd.readouterr()
    want = load_state_dict_dir(consolidate(str(saved.parent), "step3",
                                           out_dir=str(tmp_path / "want")).out_dir)
    assert "\r" not in "".join(capfd.readouterr()), "tqdm bar updates in consolidate's output"

    gathered = tmp_path / "gathered"
    _hf_layout(saved, gathered)
    u = universal.convert_to_universal(str(gathered), TAG, without_markers=WithoutMarkers(2))
    _into_tag_dir(str(gathered), TAG, u)
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
