"""One completeness rule for a user's own checkpoint (issue 32 item 4).

A user's DeepSpeed script writes no completion markers. The replicas decide when its
save is complete on a node by node/replicas/rules.part_problem (every file DeepSpeed owes
the node's ranks, none cut short); ``status``, ``collect-ckpt`` and the restore onto a
spare ask the same function (checkpoints/replicas/assemble.py). A job clusterkit launched records
whether its program writes markers, so ``status`` counts each node's own part and
``collect-ckpt JOB`` needs no ``--without-markers``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from clusterkit.checkpoints.replicas.assemble import assemble, ranks_of_map, ranks_of_slots
from clusterkit.checkpoints.replicas.health import health, list_all
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.launch.registry import JobRecord, NodeRecord, Registry
from clusterkit.node import contract
from clusterkit.node.contract import MARKER_GLOB
from clusterkit.node.replicas.rules import part_problem
from clusterkit.remote.dispatch import DispatchTransport
from clusterkit.spec.jobrecord import JobCheckpoints
from tests import synthetic_ckpt as synthetic
from tests.cli import clusterkit_cli, home_env
from tests.collectnodes import local_collect_nodes

TAG = "step60"  # a user's own tag name


def test_part_problem_is_the_watchers_rule() -> None:
    z2 = ["mp_rank_00_model_states.pt", "zero_pp_rank_2_mp_rank_00_optim_states.pt",
          "zero_pp_rank_3_mp_rank_00_optim_states.pt"]
    assert part_problem(z2, [2, 3]) is None
    assert part_problem(z2, [2, 3, 4]) == "missing zero_pp_rank_4_mp_rank_00_optim_states.pt"
    assert part_problem(z2, [2, 3], ["zero_pp_rank_3_mp_rank_00_optim_states.pt"]) == (
        "not a whole zip: zero_pp_rank_3_mp_rank_00_optim_states.pt")
    assert part_problem([], [0]) == "missing mp_rank_00_model_states.pt"


def test_rank_maps() -> None:
    assert ranks_of_map([["node1", 0, 2], ["node8", 2, 2]]) == {0: range(0, 2), 1: range(2, 4)}
    assert ranks_of_slots([2, 3]) == {0: range(0, 2), 1: range(2, 5)}


def _user_job(tmp: Path, n: int = 4) -> list[CollectNode]:
    """A finished user-script job: 2 ranks a node, no markers, a replica of each part on
    the next node (what the replicas copy once part_problem says complete)."""
    nodes = local_collect_nodes(tmp, n)
    roots = [c.root for c in nodes]
    synthetic.write_node_local(roots, zero_stage=2, shard_bytes=2048, model_bytes=512, tag=TAG)
    for index, root in enumerate(roots):
        os.unlink(os.path.join(root, TAG, contract.marker_name(index)))
    synthetic.write_ring_replicas(roots, TAG)
    return nodes


RANKS = {i: range(2 * i, 2 * i + 2) for i in range(4)}


def test_status_counts_a_users_own_parts(tmp_path: Path) -> None:
    nodes = _user_job(tmp_path)
    with DispatchTransport() as transport:
        listings = list_all(transport, nodes)
    # Judged as the bundled workload's (markers), the line: 0/4 nodes
    assert [h.line() for h in health(listings)] == [
        f"{TAG}: 0/4 nodes, replicated 4/4; complete from replicas"]
    assert [h.line() for h in health(listings, markers=False, ranks=RANKS)] == [
        f"{TAG}: 4/4 nodes, replicated 4/4"]
    # node3 lost its rank-5 shard: its own part is not complete, its replica stands in
    os.unlink(synthetic.shard_paths(nodes[2].root, tag=TAG)[1])
    with DispatchTransport() as transport:
        listings = list_all(transport, nodes)
    a = assemble(listings, TAG, require_markers=False, ranks=RANKS)
    assert a.own == {0, 1, 3} and a.sources[2].replica and a.complete
    assert [h.line() for h in health(listings, markers=False, ranks=RANKS)] == [
        f"{TAG}: 3/4 nodes, replicated 4/4; complete from replicas"]


def _registered_home(tmp: Path, nodes: list[CollectNode], extra: dict[str, object]) -> str:
    home = tmp / "home"
    record = JobRecord(job_id="ck-user-1", backend="torchrun", created=0.0, launcher_pid=0,
                       state="succeeded",
                       nodes=[NodeRecord(n.name, sys.executable, str(tmp / "jobdir"), n.target)
                              for n in nodes])
    record.ckpt = JobCheckpoints.from_dict({
        "dirs": {n.name: n.root for n in nodes}, "storage": "node-local",
        "slots": [2] * len(nodes),
        "rank_map": [[n.name, 2 * i, 2] for i, n in enumerate(nodes)], **extra})
    Registry(home).save(record)
    return str(home)


def test_status_of_a_launched_user_script_job(tmp_path: Path) -> None:
    nodes = _user_job(tmp_path)
    home = _registered_home(tmp_path, nodes, {"markers": False})
    out = clusterkit_cli("status", "ck-user-1", env=home_env(home), timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"    {TAG}: 4/4 nodes, replicated 4/4\n" in out.stdout, out.stdout


@pytest.mark.parametrize("markers", [False, None])
def test_collect_a_launched_user_script_job_needs_no_flag(tmp_path: Path,
                                                         markers: bool | None) -> None:
    """markers False: launched since the record says so; None: a record from before
    (or a directory clusterkit did not launch) still asks for --without-markers."""
    nodes = _user_job(tmp_path)
    home = _registered_home(tmp_path, nodes, {} if markers is None else {"markers": markers})
    dest = tmp_path / "dest"
    res = clusterkit_cli("collect-ckpt", "ck-user-1", "--to", str(dest), "--tag", TAG, "--json",
                         env=home_env(home), timeout=120)
    if markers is None:
        assert res.returncode == 2 and "pass --without-markers" in res.stderr, res.stderr
        return
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["collect"]["world_size"] == 8 and report["copied_bytes"] > 0
    assert "note: no completion markers" in res.stderr
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 8
    assert not list((dest / TAG).glob(MARKER_GLOB))


@pytest.mark.parametrize(("program", "markers"), [
    (["-m", "clusterkit.workload", "--steps", "4"], True), (["train.py", "--lr", "1"], False)])
def test_an_sbatch_record_says_whether_its_program_writes_markers(
        tmp_path: Path, program: list[str], markers: bool) -> None:
    (tmp_path / "plan.json").write_text(json.dumps({
        "job_id": "j", "backend": "torchrun", "storage": "node-local", "program": program,
        "nodes": [{"ckpt_dir": "/scratch/ck/j", "slots": [0, 1], "python": "python3"}]}))
    (tmp_path / "sbatch.sh").write_text("#!/bin/bash\n")
    assert JobRecord.for_sbatch(tmp_path, "1").ckpt.markers is markers
