"""checkpoints/replicas/assemble.py: which copy of each node's part of a checkpoint is used, from
listings of synthetic node-local checkpoints with replica areas (issue 22)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from clusterkit.checkpoints.listing import NodeListing, parse_listing
from clusterkit.checkpoints.replicas.assemble import assemble, to_json
from clusterkit.node import contract
from clusterkit.node.ckpt.listing import listing
from tests import synthetic_ckpt as synthetic

TAG = "global_step20"


def _roots(tmp: Path, n: int = 4) -> list[str]:
    return [str(tmp / f"node{i + 1}" / "ckpt") for i in range(n)]


def _write_replicated_roots(tmp: Path, n: int = 4, tags: tuple[str, ...] = (TAG,),
                            replicas: int = 1) -> list[str]:
    roots = _roots(tmp, n)
    for tag in tags:
        synthetic.write_node_local(roots, zero_stage=2, shard_bytes=2048, model_bytes=512,
                                   tag=tag)
        synthetic.write_ring_replicas(roots, tag, replicas=replicas)
    return roots


def _list(roots: list[str], down: tuple[int, ...] = (), tag: str | None = None
          ) -> list[NodeListing]:
    return [NodeListing(f"node{i + 1}", i, r, error="cannot list (refused)") if i in down
            else parse_listing(f"node{i + 1}", i, r, json.dumps(listing(r, tag)))
            for i, r in enumerate(roots)]


def _replica_file(roots: list[str], source: int, holder: int, name: str) -> str:
    d = contract.replica_dir(roots[holder], source, TAG)
    return next(os.path.join(dp, f) for dp, _, fs in os.walk(d) for f in fs if name in f)


def test_all_nodes_up_every_part_from_its_own_node(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path)
    a = assemble(_list(roots))
    assert a.complete and a.tag == TAG
    assert a.own == frozenset(range(4)) and set(a.replicated) == set(range(4))
    assert all(not s.replica and s.host == f"node{i + 1}" for i, s in a.sources.items())
    # the own copy carries its replica manifest's digests, to compare when read
    assert a.sources[2].sha256 and set(a.sources[2].sha256) == set(a.sources[2].files)
    assert a.replicated[1] == ("node3",)
    assert "4/4 node parts on their own nodes" in a.describe()


def test_node_down_its_part_comes_from_its_replica(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path)
    a = assemble(_list(roots, down=(2,)))
    assert a.complete, a.describe()
    part = a.sources[2]
    assert (part.replica, part.host, part.node) == (True, "node4", "node3")
    assert part.root == contract.replica_dir(roots[3], 2, TAG)
    assert any(rel.endswith("_optim_states.pt") for rel in part.sha256)
    assert "node index 2 (node3) from its replica on node4 (global_step20)" in a.describe()
    assert to_json(a)["parts"]["2"] == {"node": "node3", "from": "node4", "replica": True,
                                        "root": part.root}


def test_node0_replica_holds_latest_and_the_scripts(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path)
    part = assemble(_list(roots, down=(0,))).sources[0]
    assert part.replica and {"latest", "zero_to_fp32.py"} <= set(part.files)


def test_replica_without_manifest_does_not_count(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path)
    os.unlink(os.path.join(contract.replica_dir(roots[3], 2, TAG), contract.REPLICA_MANIFEST))
    a = assemble(_list(roots, down=(2,)), TAG)
    assert not a.complete and set(a.missing) == {2}
    assert a.missing[2] == ("unreachable; no complete replica of global_step20 on any reachable "
                            "node (node4's copy has no clusterkit-replica.json (the copy did "
                            "not finish))")
    assert a.describe().startswith("checkpoint global_step20 cannot be assembled from the "
                                   "reachable nodes and replicas: node index 2 (node3): "
                                   "unreachable;")


def test_partial_copies_are_only_counted(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path)
    os.makedirs(os.path.join(contract.replica_source_dir(roots[3], 2), ".partial-x-1", "a"))
    ls = _list(roots)
    assert ls[3].replicas[2].partial == 1 and set(ls[3].replicas[2].copies) == {TAG}


def test_replica_with_a_wrong_size_is_incomplete(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path)
    path = _replica_file(roots, 2, 3, "optim_states")
    with open(path, "ab") as fh:
        fh.write(b"x")
    a = assemble(_list(roots, down=(2,)), TAG)
    assert not a.complete
    assert "node4's copy is incomplete: global_step20/" in a.missing[2]
    assert "has 2049 bytes, its manifest recorded 2048" in a.missing[2]


def test_two_replicas_one_bad_the_other_is_used(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path, replicas=2)
    with open(_replica_file(roots, 2, 3, "optim_states"), "ab") as fh:
        fh.write(b"x")
    a = assemble(_list(roots, down=(2,)))
    assert a.complete
    assert a.sources[2].host == "node1" and a.replicated[2] == ("node1",)
    # both good: ring order, node4 then node1
    roots2 = _write_replicated_roots(tmp_path / "b", replicas=2)
    a2 = assemble(_list(roots2, down=(2,)))
    assert [c.host for c in a2.candidates[2]] == ["node4", "node1"]


def test_nothing_recoverable_names_what_is_missing(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path)
    a = assemble(_list(roots, down=(2, 3)), TAG)
    assert not a.complete and set(a.missing) == {2}  # node4's part is on node1
    assert a.missing[2] == ("unreachable; no complete replica of global_step20 on any "
                            "reachable node (unreachable: node4)")
    assert a.sources[3].host == "node1"


def test_own_copy_missing_a_file_falls_back_to_the_replica(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path)
    os.unlink(synthetic.shard_paths(roots[1], TAG)[0])
    a = assemble(_list(roots))
    assert a.complete and a.sources[1].replica and a.sources[1].host == "node3"
    assert a.own == frozenset({0, 2, 3})


def test_newest_tag_that_can_be_assembled(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path, tags=("global_step10", TAG))
    # the newest save's replica of node3 never finished: step 10 is the newest complete one
    os.unlink(os.path.join(contract.replica_dir(roots[3], 2, TAG), contract.REPLICA_MANIFEST))
    listings = _list(roots, down=(2,))
    assert assemble(listings).tag == "global_step10"
    assert assemble(listings, TAG).missing
    assert assemble(_list(roots)).tag == TAG


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    a = assemble(_list(_roots(tmp_path)))
    assert a.tag is None and not a.complete and "no tag" in a.describe()


def test_node0s_own_latest_counts_only_while_it_names_the_tag(tmp_path: Path) -> None:
    roots = _write_replicated_roots(tmp_path, tags=("global_step10", TAG))  # latest names global_step20
    listings = _list(roots)
    assert "latest" in assemble(listings, TAG).sources[0].files
    assert "latest" not in assemble(listings, "global_step10").sources[0].files
    assert "zero_to_fp32.py" in assemble(listings, "global_step10").sources[0].files


def test_tags_order_by_their_step_number_then_by_age() -> None:
    """A user's tags (step8, step16) are newest by number, not by name; tags that name no
    step follow the newest file mtime."""
    from clusterkit.checkpoints.listing import FileInfo
    from clusterkit.checkpoints.replicas.assemble import candidate_tags

    def listing(tags: dict[str, float]) -> NodeListing:
        return NodeListing(node="n1", index=0, root="/ck", exists=True,
                           tags={t: {"a.pt": FileInfo(1, mt)} for t, mt in tags.items()},
                           markers={t: {contract.marker_name(0): "{}"} for t in tags})

    assert candidate_tags([listing({"step8": 1.0, "step16": 2.0, "step9": 3.0})]) == \
        ["step16", "step9", "step8"]
    assert candidate_tags([listing({"best": 5.0, "final": 9.0})]) == ["final", "best"]
