"""One answer per checkpoint (issue 38 item 4): ``status``'s line for a tag and what
collect-ckpt does with it come from one rule (checkpoints/collect/tags.py), and
collect-ckpt without --tag takes the newest tag that rule calls collectable.

Listings come from real node programs over the local transport (as in
tests/process/test_collect_replicas.py); the checkpoints are synthetic (tests/synthetic_ckpt.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from clusterkit.checkpoints.collect.choose import why_kept
from clusterkit.checkpoints.collect.tags import answers, newest_collectable
from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.collectplan import WithoutMarkers
from clusterkit.checkpoints.replicas.health import list_all
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.remote.dispatch import DispatchTransport
from tests import synthetic_ckpt as synthetic
from tests.collectnodes import local_collect_nodes


def _hf_save(nodes: list[CollectNode], step: int, *, model_everywhere: bool = True) -> str:
    return synthetic.write_hf_save([n.root for n in nodes], step,
                                   model_everywhere=model_everywhere)


WM = WithoutMarkers(world_size=6, slots=(2, 2, 2))


def test_a_wiped_node_is_collected_from_its_replica_without_a_tag(
        tmp_path: Path, transport: DispatchTransport) -> None:
    """The issue's case: node2's /scratch wiped; status said 'complete from replicas' while
    collect-ckpt JOB exited 2 ('checkpoint ? cannot be collected ... node2: checkpoint
    directory ... does not exist') and only --tag checkpoint-50 worked."""
    nodes = local_collect_nodes(tmp_path, 3)
    for step in (30, 50):
        tag = _hf_save(nodes, step)
        synthetic.write_ring_replicas([n.root for n in nodes], tag)
    shutil.rmtree(nodes[1].root)
    listings = list_all(transport, nodes)
    lines = [a.line() for a in answers(listings, without_markers=WM)]
    assert lines == ["checkpoint-50: 2/3 nodes, replicated 3/3; complete from replicas",
                     "checkpoint-30: 2/3 nodes, replicated 3/3; complete from replicas"]
    found = newest_collectable(listings, without_markers=WM)
    assert found is not None and found.tag == "checkpoint-50"
    report = collect(transport, nodes, CollectOptions(dest=str(tmp_path / "dest"),
                                                      dry_run=True, without_markers=WM))
    assert report.plan.tag == "checkpoint-50" and report.plan.step == 50  # not 'step None'
    assert report.replicas is not None and report.replicas.used(False) == [
        "node index 1 (node2): from its replica on node3 (checkpoint-50, hashed)"]
    # the per-node HF file: its own reason, not the model states'
    note = next(n for n in report.notes if n.startswith("checkpoint-50/trainer_state.json"))
    assert "each node's program wrote its own copy" in note and "model states" not in note


def test_status_and_collect_agree_on_a_save_complete_only_as_a_whole(
        tmp_path: Path, transport: DispatchTransport) -> None:
    """A plain DeepSpeed config (no use_node_local_storage): the model states on global
    rank 0's node only. collect-ckpt gathers it; status said 'cannot be assembled'. Now
    both say collectable, and status says why a restart on the nodes cannot resume it."""
    nodes = local_collect_nodes(tmp_path, 3)
    _hf_save(nodes, 50, model_everywhere=False)
    listings = list_all(transport, nodes)
    (answer,) = answers(listings, without_markers=WM)
    assert answer.collectable and not answer.complete
    assert answer.line().startswith(
        "checkpoint-50: 1/3 nodes, replicated 0/3; collectable (collect-ckpt gathers it), "
        "but not complete on each node, so a restart there cannot resume it: node index 1 "
        "(node2): checkpoint-50: missing mp_rank_00_model_states.pt")
    report = collect(transport, nodes, CollectOptions(dest=str(tmp_path / "dest"),
                                                      dry_run=True, without_markers=WM))
    assert report.plan.tag == "checkpoint-50"


def test_a_tag_nothing_can_complete_is_not_collectable_and_says_why(
        tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = local_collect_nodes(tmp_path, 3)
    _hf_save(nodes, 50)
    os.unlink(synthetic.shard_paths(os.path.join(nodes[2].root, "checkpoint-50"),
                                    "global_step50")[0])
    listings = list_all(transport, nodes)
    (answer,) = answers(listings, without_markers=WM)
    assert not answer.collectable
    assert "; cannot be assembled: node index 2 (node3): checkpoint-50: missing " \
        "zero_pp_rank_4_mp_rank_00_optim_states.pt" in answer.line()
    assert newest_collectable(listings, without_markers=WM) is None


def test_why_a_differing_copy_of_each_file_was_kept() -> None:
    assert why_kept("global_step3/mp_rank_00_model_states.pt") == \
        "global rank 0 writes the complete model states"
    for rel in ("checkpoint-30/trainer_state.json", "checkpoint-30/training_args.bin"):
        assert "model states" not in why_kept(rel)
