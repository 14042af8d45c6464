"""The rule for a universal conversion inside a program's tag dir (HF's checkpoint-N after
a reshard): checkpoints/collect/inside.py, pure listings in, an answer out."""

from __future__ import annotations

import json

from clusterkit.checkpoints.collect.inside import converted
from clusterkit.checkpoints.listing import FileInfo, NodeListing
from clusterkit.checkpoints.universal_marker import UniversalMarker

TAG, UNI = "checkpoint-10", "global_step10_universal"
# What jobs/reshard.py writes into the conversion (the one marker format).
MARKER = json.dumps(UniversalMarker(
    source_tag=f"{TAG}/global_step10", step=10, global_samples=80, world_size=3, zero_stage=2,
    micro_batch=4, grad_accum=1, global_batch=12, engine="deepspeed", precision="fp32",
    deepspeed_version="0.19.8",
    files={"mp_rank_00_model_states.pt": 5, "zero/w/fp32.pt": 7}).to_json_dict())


def _listed_node(name: str, *, fp32: int = 7, marker: str | None = MARKER, whole: bool = True
          ) -> NodeListing:
    files = {"trainer_state.json": FileInfo(1, 0.0), "latest": FileInfo(13, 0.0),
             "latest_universal": FileInfo(23, 0.0),
             f"{UNI}/mp_rank_00_model_states.pt": FileInfo(5, 0.0, True),
             f"{UNI}/zero/w/fp32.pt": FileInfo(fp32, 0.0, whole)}
    texts = {"latest": "global_step10", "latest_universal": UNI + "\n"}
    if marker is not None:
        files[f"{UNI}/clusterkit-universal.json"] = FileInfo(len(marker), 0.0)
        texts[f"{UNI}/clusterkit-universal.json"] = marker
    return NodeListing(name, 0, "/c", exists=True, tags={TAG: files}, texts={TAG: texts})


def test_a_complete_conversion_names_its_source_and_world() -> None:
    c = converted([_listed_node("n1"), _listed_node("n2")], TAG)
    assert c is not None and c.usable and c.everywhere
    assert (c.name, c.source, c.latest, c.world_size, c.complete_on) == \
        (UNI, "global_step10", "global_step10", 3, ("n1", "n2"))
    assert c.holds(f"{UNI}/zero/w/fp32.pt") and c.holds("latest_universal")
    assert not c.holds("global_step10/x.pt") and not c.holds("latest")


def test_one_good_copy_collects_a_restart_needs_all() -> None:
    c = converted([_listed_node("n1"), _listed_node("n2", fp32=3)], TAG)
    assert c is not None and c.usable and not c.everywhere
    assert c.complete_on == ("n1",) and "has 3 bytes, its marker recorded 7" in c.problems[0]
    cut = converted([_listed_node("n1", whole=False)], TAG)
    assert cut is not None and not cut.usable and "cut short" in cut.problems[0]


def test_without_a_marker_it_never_stands_in() -> None:
    c = converted([_listed_node("n1", marker=None)], TAG)
    assert c is not None and not c.usable and c.world_size is None
    assert any("world size" in p for p in c.problems)
    assert converted([_listed_node("n1", marker="{not json")], TAG).usable is False  # type: ignore[union-attr]


def test_no_latest_universal_no_conversion() -> None:
    plain = NodeListing("n1", 0, "/c", exists=True,
                        tags={TAG: {"global_step10/mp_rank_00_model_states.pt": FileInfo(5, 0.0)}})
    assert converted([plain], TAG) is None
