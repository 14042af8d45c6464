"""Workload pieces that need no process group: CLI, rank env, presets, data, model, advisor."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterkit.errors import ClusterkitError, LaunchError
from clusterkit.workload.args import parse_args
from clusterkit.workload.distenv import resolve_dist_env
from clusterkit.workload.presets import PRESETS, get_preset, peak_tflops_for


@pytest.mark.parametrize("argv", [["--local_rank=3"], ["--local-rank", "3"], ["--local_rank", "3"]])
def test_both_local_rank_spellings(argv: list[str]) -> None:
    assert parse_args(argv).local_rank == 3


def test_cli_defaults_and_validation() -> None:
    args = parse_args([])
    assert (args.engine, args.model, args.zero_stage, args.resume, args.storage) == (
        "deepspeed", "tiny", 2, "auto", "shared")
    assert args.save_final is True
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--save-16bit", "--zero-stage", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--zero-stage", "4"])


def test_dist_env_torchrun_style() -> None:
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "n1",
           "MASTER_PORT": "29555", "GROUP_RANK": "1"}
    d = resolve_dist_env(env)
    assert (d.rank, d.local_rank, d.world_size, d.node_index, d.source) == (3, 1, 4, 1, "torch")
    assert d.exports()["MASTER_PORT"] == "29555"


def test_dist_env_deepspeed_launcher_uses_cross_rank_and_cli_local_rank() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "1",
           "CROSS_RANK": "1"}
    d = resolve_dist_env(env, cli_local_rank=0)
    assert (d.local_rank, d.node_index) == (0, 1)


def test_dist_env_plain_srun_fallback() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "14",
           "SLURM_NODEID": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "23456"}
    d = resolve_dist_env(env)
    assert (d.rank, d.local_rank, d.world_size, d.node_index, d.source) == (5, 1, 14, 2, "slurm")
    assert d.exports() == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "14",
                           "MASTER_ADDR": "node1", "MASTER_PORT": "23456"}


def test_dist_env_errors_are_one_line() -> None:
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        resolve_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(LaunchError, match="outside"):
        resolve_dist_env({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    single = resolve_dist_env({})
    assert (single.rank, single.world_size, single.source) == (0, 1, "single")


def test_presets_sizes_and_flops() -> None:
    assert 100_000 < PRESETS["tiny"].n_params < 1_000_000
    assert 110e6 < PRESETS["small"].n_params < 140e6
    assert 330e6 < PRESETS["medium"].n_params < 380e6
    tiny = PRESETS["tiny"]
    assert tiny.train_flops_per_token() == 6 * tiny.n_params + 12 * 2 * 96 * 64
    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_for("Some CPU") is None
    with pytest.raises(ClusterkitError, match="tiny"):
        get_preset("huge")


def test_model_param_count_matches_preset_and_embeddings_are_tied() -> None:
    import torch

    from clusterkit.workload.model import GPT

    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    assert sum(p.numel() for p in model.parameters()) == PRESETS["tiny"].n_params
    assert model.lm_head.weight is model.wte.weight
    idx = torch.randint(0, 256, (2, 16))
    loss = model(idx, idx)
    assert loss.shape == () and 4.0 < float(loss.detach()) < 7.0  # near ln(256) at init


def test_data_is_deterministic_disjoint_and_step_addressed() -> None:
    from clusterkit.workload.data import TokenStream, load_corpus_bytes

    data = load_corpus_bytes()
    assert len(data) > 100_000
    s0 = TokenStream(data, seq_len=64, world_size=2, rank=0, seed=7)
    s1 = TokenStream(data, seq_len=64, world_size=2, rank=1, seed=7)
    again = TokenStream(data, seq_len=64, world_size=2, rank=0, seed=7)
    b = s0.train_batch(5, 1, 4)
    assert b.inputs.shape == (4, 64)
    assert (b.inputs[:, 1:] == b.targets[:, :-1]).all()
    assert (again.train_batch(5, 1, 4).inputs == b.inputs).all()  # reproducible from the seed
    assert not (s0.train_batch(6, 1, 4).inputs == b.inputs).all()
    # Shards are disjoint ranges of the stream.
    assert s0.train.data_ptr() != s1.train.data_ptr()
    assert len(s0.train) == len(s1.train)
    # Tiny corpora are repeated so even 64 ranks x 1024-token windows have data.
    big = TokenStream(data, seq_len=1024, world_size=64, rank=63, seed=0)
    assert big.train_batch(0, 0, 2).inputs.shape == (2, 1024)


def test_advisor_recommends_fastest_fitting_strategy() -> None:
    from clusterkit.workload.advisor import advise, format_table, parse_bytes

    roomy = advise("medium", nodes=7, gpus_per_node=2, gpu_mem_bytes=parse_bytes("80GiB"))
    assert [e.name for e in roomy.estimates] == [
        "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-2+offload", "ZeRO-3", "ZeRO-3+offload"]
    assert roomy.recommended is not None and roomy.recommended.name == "DDP"
    tight = advise("medium", nodes=1, gpus_per_node=1, gpu_mem_bytes=parse_bytes("4GiB"),
                   cpu_mem_bytes_per_node=parse_bytes("64GiB"))
    assert tight.recommended is not None and tight.recommended.name == "ZeRO-2+offload"
    none = advise("medium", nodes=1, gpus_per_node=1, gpu_mem_bytes=parse_bytes("1MiB"),
                  cpu_mem_bytes_per_node=parse_bytes("1GiB"))
    assert none.recommended is None
    table = format_table(tight)
    assert "<- recommended" in table and "ZeRO-3+offload" in table
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(ClusterkitError):
        parse_bytes("lots")


def test_resume_skips_a_checkpoint_missing_a_nodes_marker() -> None:
    """A save killed midway can leave markers on some nodes only: never resume from it."""
    from clusterkit.workload.ckpt import ScanEntry, _decide

    # node-local, 2 nodes: rank scans of node 0's dir and of node 1's dir
    node0 = ([ScanEntry("global_step20", 20, (0,), 2, 4), ScanEntry("global_step40", 40, (0,), 2, 4)],
             [])
    node1 = ([ScanEntry("global_step20", 20, (1,), 2, 4)], ["global_step40"])
    tag, warning, refusal = _decide("auto", [node0, node0, node1, node1], 4)
    assert tag == "global_step20" and refusal is None
    assert warning is not None and "global_step40: no completion marker from node(s) 1" in warning
    # shared storage: both markers in one dir
    shared = ([ScanEntry("global_step40", 40, (0, 1), 2, 2)], [])
    assert _decide("auto", [shared, shared], 2)[0] == "global_step40"
    assert _decide("auto", [([], []), ([], [])], 2) == (None, None, None)


def test_heartbeat_writes_first_beat_at_once_then_at_most_once_per_interval(
        tmp_path: Path) -> None:
    from clusterkit.workload.hangs import Heartbeat

    path = tmp_path / "rank0.heartbeat"
    hb = Heartbeat(0, {"CLUSTERKIT_HEARTBEAT": str(path)}, min_interval_s=3600)
    hb.beat(1)
    assert path.read_text() == "1\n"  # the first step ends the watchdog's start-up allowance
    hb.beat(2)
    assert path.read_text() == "1\n"  # throttled: no file write per step
    hb.min_interval_s = 0.0
    hb.beat(3)
    assert path.read_text() == "3\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.heartbeat"]  # no temp file left


def test_stop_signal_agreements_keep_about_half_a_second_apart() -> None:
    """Short steps agree every K steps (K * step ~ AGREE_EVERY_S); long ones every step."""
    from types import SimpleNamespace

    from clusterkit.workload.main import AGREE_EVERY_S, MAX_AGREE_STEPS, _Loop

    def proposal(step_s: float | None) -> int:
        return _Loop._agree_proposal(SimpleNamespace(_agreed_step_s=step_s))  # type: ignore[arg-type]

    assert proposal(None) == 1  # nothing measured yet: the next step agrees
    assert proposal(0.03) == int(AGREE_EVERY_S / 0.03) == 16
    assert proposal(2.0) == 1
    assert proposal(1e-6) == MAX_AGREE_STEPS
