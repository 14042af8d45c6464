"""node/slurm/restore.py without Slurm: a node-local job's parts moved onto another node set.

Four "nodes" (a checkpoint dir each, on this machine) hold global_step4 of a 4 x 2 job,
each part replicated on its ring successor over the real replica wire (node/replicas/wire.py).
node C (node index 2) is lost; the next run gets A, B, D, E. The plan keeps A and B,
makes D (its own part was node index 3's) take node index 2 from its replica and keep its
own part as a replica of index 3, and E receive node index 3 from its replica on A; then
every node holds exactly its part of the new order.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterkit.node.ckpt.listing import listing
from clusterkit.node.contract import REPLICA_MANIFEST, marker_name, replica_dir
from clusterkit.node.replicas.rules import ring
from clusterkit.node.replicas.wire import ReplicaServer, push
from clusterkit.node.slurm import restore
from tests.replicahelpers import fresh_job_id

TAG = "global_step4"
JOB = "restore-test"  # each test gets its own (_own_job_id)
SECRET = "s" * 64
RPN = 2


@pytest.fixture(autouse=True)
def _fresh_restore_job_id() -> Iterator[None]:
    """A job id, hence replica ports, per test: the servers of this file's other test on
    another xdist worker (or their sockets in TIME_WAIT) never answer for this one (a
    whole-suite run got "global_step4 of node index 0 is being received already")."""
    global JOB
    JOB = fresh_job_id("restore-test")
    yield


def _save(root: Path, index: int) -> None:
    d = root / TAG
    d.mkdir(parents=True)
    for r in range(index * RPN, (index + 1) * RPN):
        (d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(os.urandom(1000) + bytes([r]))
    (d / "mp_rank_00_model_states.pt").write_bytes(b"model" * 100)
    _mark(d, index, 4)
    if index == 0:
        (root / "latest").write_text(TAG)


def _mark(d: Path, index: int, nodes: int) -> None:
    """The completion marker as the bundled workload writes it last (the keys the copy
    rule reads: node/replicas/rules.read_marker): every file of the tag dir and its size."""
    files = {p.name: p.stat().st_size for p in d.iterdir()}
    (d / marker_name(index)).write_text(json.dumps(
        {"tag": d.name, "node_index": index, "num_nodes": nodes, "node_files": files}))


def _push_ring_replicas(roots: dict[str, Path], hosts: list[str]) -> None:
    for i, h in enumerate(hosts):
        j = ring(i, [(h,) for h in hosts], 1)[0]
        server = ReplicaServer(JOB, j, hosts[j], str(roots[hosts[j]]), SECRET, address="127.0.0.1")
        server.start()
        try:
            push(str(roots[h]), TAG, {"node": hosts[j], "index": j, "address": "127.0.0.1"},
                 job_id=JOB, source=i, source_host=h, secret=SECRET, tags=[TAG])
        finally:
            server.stop()


def test_a_lost_node_s_part_is_moved_from_its_replica(tmp_path: Path) -> None:
    old = ["A", "B", "C", "D"]
    roots = {h: tmp_path / h / "ckpt" for h in [*old, "E"]}
    for i, h in enumerate(old):
        _save(roots[h], i)
    _push_ring_replicas(roots, old)
    want = {i: sorted(p.name for p in (roots[old[i]] / TAG).iterdir()) for i in range(4)}
    digest = {i: (roots[old[i]] / TAG / f"zero_pp_rank_{2 * i}_mp_rank_00_optim_states.pt").read_bytes()
              for i in range(4)}
    # node C lost for good: its disk with it.
    new = ["A", "B", "D", "E"]
    listings = {h: listing(str(roots[h]), None) for h in new}
    plan = restore.decide(listings, new, old, True, RPN)
    assert plan["tag"] == TAG, plan
    assert plan["lines"][:2] == ["node index 2 (was C) -> D: from its replica on D",
                                 "node index 3 (was D) -> E: from its replica on A"], plan["lines"]
    results: dict[str, int] = {}

    def run(h: str) -> None:
        results[h] = restore.restore(plan, h, str(roots[h]), JOB, SECRET,
                                          dict.fromkeys(new, "127.0.0.1"))
    threads = [threading.Thread(target=run, args=(h,)) for h in new]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == dict.fromkeys(new, 0), results
    for i, h in enumerate(new):
        assert sorted(p.name for p in (roots[h] / TAG).iterdir()) == want[i], h
        assert (roots[h] / TAG / f"zero_pp_rank_{2 * i}_mp_rank_00_optim_states.pt").read_bytes() == digest[i]
    assert (roots["A"] / "latest").read_text() == TAG
    # D's own part (node index 3's) is kept as a verified replica of it.
    assert (Path(replica_dir(str(roots["D"]), 3, TAG)) / REPLICA_MANIFEST).is_file()
    # A second decision on the same nodes: every part in place.
    again = {h: listing(str(roots[h]), None) for h in new}
    assert restore.decide(again, new, new, True, RPN)["lines"] == []


def test_a_part_on_no_node_of_the_run_is_named(tmp_path: Path) -> None:
    old = ["A", "B", "C", "D"]
    roots = {h: tmp_path / h / "ckpt" for h in [*old, "E"]}
    for i, h in enumerate(old):
        _save(roots[h], i)  # no replicas
    new = ["A", "B", "D", "E"]
    plan = restore.decide({h: listing(str(roots[h]), None) for h in new},
                               new, old, True, RPN)
    assert plan["missing"] == (f"checkpoint {TAG} cannot be assembled from this run's nodes: "
                               "node index 2 (was C): no copy on any node of this run and no "
                               "replica of it there"), plan


def test_fewer_nodes_gather_every_part_for_the_universal_conversion(tmp_path: Path) -> None:
    old = ["A", "B", "C", "D"]
    roots = {h: tmp_path / h / "ckpt" for h in old}
    for i, h in enumerate(old):
        _save(roots[h], i)
    _push_ring_replicas(roots, old)
    new = ["A", "B", "D"]  # C lost, no spare: 3 nodes
    plan = restore.decide({h: listing(str(roots[h]), None) for h in new},
                               new, old, True, RPN)
    assert plan["reshard"] and plan["tag"] == TAG
    assert plan["lines"] == ["node index 0 (was A): from its own copy on A",
                             "node index 1 (was B): from its own copy on B",
                             "node index 2 (was C): from its replica on D",
                             "node index 3 (was D): from its own copy on D"], plan["lines"]
    dest = tmp_path / "gather"
    assert all(restore.gather(plan, h, str(roots[h]), str(dest)) == 0 for h in new)
    names = sorted(p.name for p in (dest / TAG).iterdir())
    assert names == sorted({*(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(8)),
                            "mp_rank_00_model_states.pt", *(marker_name(i) for i in range(4))})
    assert (dest / "latest").read_text() == TAG
    # The script converts dest/TAG; spread copies the result into each node's dir, whole.
    (dest / f"{TAG}_universal").mkdir()
    (dest / f"{TAG}_universal" / "marker.json").write_text("{}")
    assert restore.spread(str(dest / f"{TAG}_universal"), str(roots["D"])) == 0
    assert (roots["D"] / f"{TAG}_universal" / "marker.json").read_text() == "{}"
    # A user's script (no markers): the same gather, its parts judged by DeepSpeed's files;
    # the world size that saved it (for the converter) from its highest rank file.
    bare = restore.decide({h: listing(str(roots[h]), None) for h in new},
                               new, old, False, RPN)
    assert bare["reshard"] and bare["world"] == 8 and bare["lines"] == plan["lines"], bare
