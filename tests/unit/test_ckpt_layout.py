"""checkpoints.layout: DeepSpeed shard names and the completion-marker schema."""

from __future__ import annotations

import json

import pytest

from clusterkit.checkpoints import layout
from clusterkit.errors import CheckpointError
from clusterkit.node.contract import marker_name, parse_marker_name


@pytest.mark.parametrize(("name", "expected"), [
    ("mp_rank_00_model_states.pt", layout.ShardName("model_states", None, 0)),
    ("zero_pp_rank_13_mp_rank_00_model_states.pt",
     layout.ShardName("zero3_model_states", 13, 0)),
    ("zero_pp_rank_3_mp_rank_01_optim_states.pt", layout.ShardName("optim_states", 3, 1)),
    ("bf16_zero_pp_rank_7_mp_rank_00_optim_states.pt",
     layout.ShardName("optim_states", 7, 0, bf16=True)),
    ("latest", None), ("zero_to_fp32.py", None), ("clusterkit-complete.node0.json", None),
    ("zero_pp_rank_x_mp_rank_00_optim_states.pt", None),
])
def test_parse_shard_name(name: str, expected: layout.ShardName | None) -> None:
    assert layout.parse_shard_name(name) == expected


def test_names_round_trip_through_the_parser() -> None:
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            for rank in (0, 5):
                for f in layout.rank_files(stage, rank, precision):
                    parsed = layout.parse_shard_name(f)
                    assert parsed is not None
                    assert parsed.dp_rank in (None, rank)


def test_rank_files_per_stage() -> None:
    assert layout.rank_files(0, 1, "fp32") == ("mp_rank_00_model_states.pt",)
    assert layout.rank_files(2, 1, "fp32") == ("mp_rank_00_model_states.pt",
                                               "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert layout.rank_files(3, 2, "bf16") == ("zero_pp_rank_2_mp_rank_00_model_states.pt",
                                               "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    # Measured: stage 0 writes no optimizer shards, also with bf16.
    assert layout.rank_files(0, 0, "bf16") == ("mp_rank_00_model_states.pt",)


def test_marker_and_tag_names() -> None:
    assert marker_name(3) == "clusterkit-complete.node3.json"
    assert parse_marker_name("clusterkit-complete.node12.json") == 12
    assert parse_marker_name("clusterkit-complete.node.json") is None
    assert layout.parse_step_tag(layout.step_tag(40)) == 40
    assert layout.parse_step_tag("best") is None


def _completion_marker(node: int, ranks: tuple[int, ...], num_nodes: int = 2) -> layout.CompletionMarker:
    return layout.CompletionMarker(
        tag="global_step4", step=4, engine="deepspeed", ds_subdir="", zero_stage=3,
        precision="fp32", storage="node-local", world_size=4, num_nodes=num_nodes,
        node_index=node, host=f"n{node}",
        ranks=tuple(layout.RankEntry(r, r % 2, f"n{node}", layout.rank_files(3, r, "fp32"))
                    for r in ranks),
        node_files={"zero_pp_rank_0_mp_rank_00_model_states.pt": 10}, created_unix=1.5,
        global_samples=32)


def test_marker_json_round_trip() -> None:
    marker = _completion_marker(0, (0, 1))
    text = json.dumps(marker.to_json_dict())
    back = layout.marker_from_json_dict(json.loads(text))
    assert back == marker
    assert json.loads(text)["schema"] == layout.MARKER_SCHEMA


def test_marker_validation_names_the_key() -> None:
    data = _completion_marker(0, (0, 1)).to_json_dict()
    del data["world_size"]
    with pytest.raises(CheckpointError) as info:
        layout.marker_from_json_dict(data, path="/c/x.json")
    assert info.value.key == "world_size" and info.value.path == "/c/x.json"
    data = _completion_marker(0, (0, 1)).to_json_dict()
    data["schema_version"] = 99
    with pytest.raises(CheckpointError, match="unsupported marker schema"):
        layout.marker_from_json_dict(data)
    data = _completion_marker(0, (0, 1)).to_json_dict()
    data["step"] = "4"
    with pytest.raises(CheckpointError):
        layout.marker_from_json_dict(data)
