"""Issue 22: --replace OLD=NEW (hostfile.apply_replace), the continue rule for a replaced
node (launch/continuation.check_continue) and the restore of a lost node's part (jobs/recover.py,
jobs/restore.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import yaml

from clusterkit.checkpoints.convert.universal import verify_source
from clusterkit.errors import CheckpointError, InventoryError, LaunchError, SelectionError
from clusterkit.hostfile import apply_replace, parse_replace, select, select_hosts
from clusterkit.inventory import parse_inventory
from clusterkit.jobs.recover import prepare_continue, restore_replacements
from clusterkit.launch.continuation import (
    Replacement,
    check_continue,
    continue_swaps,
    is_reshard,
    replacements,
)
from clusterkit.launch.fromplan import job_from_plan
from clusterkit.launch.registry import JobRecord
from clusterkit.launch.run import _record
from clusterkit.node.contract import (
    REPLICA_MANIFEST,
    REPLICA_SCHEMA,
    REPLICA_SCHEMA_VERSION,
    marker_name,
    replica_dir,
)
from clusterkit.plan.build import plan_job
from clusterkit.remote.dispatch import DispatchTransport
from clusterkit.render.artifacts import render_all
from clusterkit.spec.job import JobOptions, JobPlan, LaunchFacts
from clusterkit.spec.jobrecord import JobState, rank_spans
from tests import synthetic_ckpt as synthetic
from tests.helpers import recorded_failed_job
from tests.render_cases import plan_for

POOL = OrderedDict((f"node{i}", 2) for i in range(1, 9))


def test_the_spare_takes_the_lost_nodes_place_and_slots() -> None:
    chosen = select(POOL, nodes=7)
    out = apply_replace(chosen, POOL, parse_replace(["node6=node8"]))
    assert list(out) == ["node1", "node2", "node3", "node4", "node5", "node8", "node7"]
    assert out["node8"] == [0, 1]


@pytest.mark.parametrize(("words", "needle"), [
    (["node6="], "expected OLD=NEW"),
    (["node6"], "no free spare"),
    (["node6=node6"], "expected OLD=NEW"),
    (["node6=node8", "node6=node1"], "named twice"),
    (["node8=node1"], "not among the selected hosts"),
    (["node6=node9"], "not an inventory host"),
    (["node6=node5"], "already selected"),
])
def test_bad_replacements_are_refused(words: list[str], needle: str) -> None:
    with pytest.raises(SelectionError, match=needle):
        apply_replace(select(POOL, nodes=7), POOL, parse_replace(words))


def test_the_inventorys_spares_are_never_selected_and_replace_picks_one() -> None:
    hosts = {f"node{i}": {"address": f"10.0.0.{i}", "slots": 1 if i == 8 else 2}
             for i in range(1, 10)}
    inv = parse_inventory(yaml.safe_dump({"schema_version": 1, "hosts": hosts,
                                          "spares": ["node[8-9]"]}))
    assert inv.spares == ("node8", "node9")
    names = [h.name for h, _ in select_hosts(inv)]
    assert names == [f"node{i}" for i in range(1, 8)]
    # node8 has 1 slot, node6 ran 2: the first spare that fits is node9.
    picked = [h.name for h, _ in select_hosts(inv, replace=("node6",))]
    assert picked[5] == "node9"
    with pytest.raises(SelectionError, match="no free spare with 2 slots"):
        select_hosts(inv, replace=("node6", "node5"))
    with pytest.raises(InventoryError, match="spares: node10 not among the hosts"):
        parse_inventory(yaml.safe_dump({"schema_version": 1, "hosts": hosts,
                                        "spares": ["node10"]}))


def test_a_spare_with_fewer_slots_is_refused() -> None:
    pool = OrderedDict([("a", 2), ("b", 2), ("spare", 1)])
    with pytest.raises(SelectionError, match="spare has 1 slots, b ran 2"):
        apply_replace(select(pool, nodes=2), pool, parse_replace(["b=spare"]))


# ------------------------------------------------------------------ check_continue


def test_a_replaced_node_with_the_same_slots_may_continue(tmp_path: Path) -> None:
    registry = recorded_failed_job(tmp_path, nodes=6)
    plan = plan_for("a800-7x2", "torchrun", nodes=6, replace=("node6=node7",))
    prior = registry.find(plan.job_id)
    assert plan.storage == "node-local" and [n.name for n in plan.nodes][-1] == "node7"
    note = check_continue(plan, prior)
    assert note is not None and "node index 5 runs on node7 instead of node6" in note
    assert "restored there first" in note
    assert continue_swaps(plan, prior) == [Replacement(5, "node6", "node7")]
    # Another node set: the bundled workload (--resume auto) is resharded; a user's
    # program too (its newest checkpoint converted for it, issue 31); an explicit --resume
    # is refused, and the refusal names --replace.
    other = plan_for("a800-7x2", "torchrun", exclude="node6")
    assert is_reshard(other, prior) and "resharded first" in (check_continue(other, prior) or "")
    user = plan_for("a800-7x2", "torchrun", exclude="node6", script="train.py")
    assert is_reshard(user, prior) and "resharded first" in (check_continue(user, prior) or "")
    for mine in (plan_for("a800-7x2", "torchrun", exclude="node6",
                          script_args=("--resume", "never")),):
        assert not is_reshard(mine, prior)
        with pytest.raises(LaunchError) as err:
            check_continue(mine, prior)
        assert "--replace OLD=NEW" in (err.value.hint or "")
    # The same nodes: nothing to restore.
    assert continue_swaps(plan_for("a800-7x2", "torchrun", nodes=6), prior) == []


def test_a_replacement_that_changes_the_ranks_is_refused(tmp_path: Path) -> None:
    registry = recorded_failed_job(tmp_path, nodes=6, script="train.py")
    plan = plan_for("a800-7x2", "torchrun", nodes=6, gpus_per_node=1, replace=("node6=node7",),
                    script_args=("--resume", "never"))
    assert replacements(registry.find(plan.job_id).ckpt.rank_map or [], plan) is None  # type: ignore[union-attr]
    with pytest.raises(LaunchError, match="different rank->node mapping"):
        check_continue(plan, registry.find(plan.job_id))


# ------------------------------------------------------------------ the restore


TAG = "global_step1"


def _local_plan(tmp: Path, nodes: int, replace: tuple[str, ...] = (),
                script_args: tuple[str, ...] = ()) -> JobPlan:
    hosts = {f"node{i}": {"address": "127.0.0.1",
                          "checkpoint": {"local_dir": str(tmp / f"node{i}" / "ckpt")}}
             for i in range(1, 6)}
    text = yaml.safe_dump({"schema_version": 1, "cluster": {"name": "t"},
                           "defaults": {"transport": "local", "gpus": 0, "slots": 2,
                                        "python": sys.executable, "workdir": str(tmp / "work")},
                           "hosts": hosts})
    options = JobOptions(job_id="j1", nodes=nodes, replace=replace, script_args=script_args)
    facts = LaunchFacts(python=sys.executable, cwd=str(tmp))
    return plan_job(parse_inventory(text), options, facts)


def _copy_replica(src_root: Path, holder_root: Path, index: int, tag: str = TAG) -> Path:
    """What the replication service leaves on a holder: the tag's files and the manifest."""
    dest = Path(replica_dir(str(holder_root), index, tag))
    files = {}
    for f in sorted((src_root / tag).rglob("*")):
        if f.is_file():
            rel = f"{tag}/{f.relative_to(src_root / tag)}"
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest / rel)
            files[rel] = {"size": f.stat().st_size,
                          "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    manifest = {"schema": REPLICA_SCHEMA, "version": REPLICA_SCHEMA_VERSION, "job_id": "j1",
                "tag": tag, "source": index, "source_host": f"node{index + 1}",
                "holder": holder_root.parent.parent.name, "files": files, "completed": 1.0}
    (dest / REPLICA_MANIFEST).write_text(json.dumps(manifest))
    return dest


OLD_MAP = rank_spans([["node1", 0, 2], ["node2", 2, 2], ["node3", 4, 2]])


def _lost_node2(tmp: Path) -> tuple[JobPlan, list[Path], Path]:
    """3 nodes saved TAG; node2 (node index 1) kept a replica on node3 and on node1;
    then node2 is lost. Returns the --replace node2=node5 plan, the roots, node2's copy."""
    plan = _local_plan(tmp, 3)
    roots = [Path(n.ckpt_dir) for n in plan.nodes]
    synthetic.write_node_local([str(r) for r in roots], zero_stage=2, shard_bytes=4096,
                               model_bytes=1024, tag=TAG, hosts=[n.name for n in plan.nodes])
    _copy_replica(roots[1], roots[2], 1)
    _copy_replica(roots[1], roots[0], 1)
    saved = tmp / "node2-as-saved"
    shutil.copytree(roots[1], saved)
    shutil.rmtree(tmp / "node2")
    return _local_plan(tmp, 3, ("node2=node5",)), roots, saved


def _same_tree(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_the_lost_part_is_restored_onto_the_spare(tmp_path: Path,
                                                  transport: DispatchTransport) -> None:
    plan, _roots, saved = _lost_node2(tmp_path)
    said: list[str] = []
    done = restore_replacements(transport, plan, [Replacement(1, "node2", "node5")],
                                OLD_MAP, str(tmp_path / "staging"), said.append)
    assert [(r.tag, r.holder, r.rejected) for r in done] == [(TAG, "node3", [])]
    _same_tree(saved / TAG, Path(plan.nodes[1].ckpt_dir) / TAG)
    assert any("restored global_step1 of node index 1 (node2) onto node5" in s for s in said)


def test_a_corrupted_replica_is_never_used(tmp_path: Path, transport: DispatchTransport) -> None:
    plan, roots, saved = _lost_node2(tmp_path)
    shard = next(p for p in Path(replica_dir(str(roots[2]), 1, TAG)).rglob("*optim_states.pt"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size: only the sha256 can tell
    done = restore_replacements(transport, plan, [Replacement(1, "node2", "node5")],
                                OLD_MAP, str(tmp_path / "staging"), lambda _s: None)
    assert done[0].holder == "node1"  # the next holder in ring order, verified
    assert "node3's copy of global_step1" in done[0].rejected[0]
    assert "sha256" in done[0].rejected[0]
    _same_tree(saved / TAG, Path(plan.nodes[1].ckpt_dir) / TAG)
    # With the good copy gone too, nothing is restored and the refusal names the options.
    shutil.rmtree(Path(replica_dir(str(roots[0]), 1, TAG)))
    shutil.rmtree(Path(plan.nodes[1].ckpt_dir))
    with pytest.raises(LaunchError) as err:
        restore_replacements(transport, plan, [Replacement(1, "node2", "node5")],
                             OLD_MAP, str(tmp_path / "staging2"), lambda _s: None)
    assert "every copy failed verification" in err.value.message
    assert "sha256 mismatch" in err.value.message
    assert "--replicas" in (err.value.hint or "") and "--resume never" in (err.value.hint or "")
    assert not (Path(plan.nodes[1].ckpt_dir) / TAG / marker_name(1)).exists()


def test_without_any_replica_the_launch_is_refused(tmp_path: Path,
                                                   transport: DispatchTransport) -> None:
    plan, roots, _saved = _lost_node2(tmp_path)
    for root in (roots[0], roots[2]):
        shutil.rmtree(Path(replica_dir(str(root), 1, TAG)))
    with pytest.raises(LaunchError) as err:
        restore_replacements(transport, plan, [Replacement(1, "node2", "node5")],
                             OLD_MAP, str(tmp_path / "staging"), lambda _s: None)
    assert "checkpoint global_step1 cannot be assembled" in err.value.message
    assert "node index 1 (node5): " in err.value.message
    assert "no complete replica of global_step1" in err.value.message


# ------------------------------------------------------------------ before a continued launch


def _prior(plan: JobPlan) -> JobRecord:
    record = _record(job_from_plan(render_all(plan, run_id="r0")), plan, 0)
    record.state = JobState.FAILED
    return record


def test_a_part_wiped_on_its_own_node_is_restored_there(tmp_path: Path,
                                                        transport: DispatchTransport) -> None:
    plan = _local_plan(tmp_path, 3)
    roots = [Path(n.ckpt_dir) for n in plan.nodes]
    synthetic.write_node_local([str(r) for r in roots], tag=TAG, shard_bytes=4096,
                               model_bytes=1024, hosts=[n.name for n in plan.nodes])
    _copy_replica(roots[1], roots[2], 1)
    saved = tmp_path / "saved"
    shutil.copytree(roots[1], saved)
    shutil.rmtree(roots[1] / TAG)  # node2 came back with an empty disk
    said: list[str] = []
    prepare_continue(transport, plan, _prior(plan), str(tmp_path / "home"), said.append)
    _same_tree(saved / TAG, roots[1] / TAG)
    assert any("onto node2" in s for s in said), said


def test_a_checkpoint_that_cannot_be_assembled_is_refused(tmp_path: Path,
                                                          transport: DispatchTransport) -> None:
    plan = _local_plan(tmp_path, 3)
    roots = [Path(n.ckpt_dir) for n in plan.nodes]
    synthetic.write_node_local([str(r) for r in roots], tag=TAG, shard_bytes=4096,
                               model_bytes=1024, hosts=[n.name for n in plan.nodes])
    shutil.rmtree(roots[1] / TAG)  # no replica anywhere: today's silent fresh start
    with pytest.raises(LaunchError) as err:
        prepare_continue(transport, plan, _prior(plan), str(tmp_path / "home"), lambda _s: None)
    assert err.value.message.startswith("cannot continue job j1: checkpoint global_step1 cannot "
                                        "be assembled"), err.value.message
    assert "node index 1 (node2)" in err.value.message
    hint = err.value.hint or ""
    assert "--resume never" in hint and "--replicas" in hint
    # --resume never (or a tag) is the user's explicit choice: not refused here.
    never = _local_plan(tmp_path, 3, script_args=("--resume", "never"))
    prepare_continue(transport, never, _prior(plan), str(tmp_path / "home"), lambda _s: None)


def test_a_gathered_checkpoint_holds_node_0s_model_states(tmp_path: Path) -> None:
    """collect-ckpt's DEST (what a reshard converts) keeps node 0's copy of the model states
    every ZeRO 0-2 node wrote its own of: only node 0's marker must match its size
    (checkpoints/discover._gathered_copy)."""
    roots = [tmp_path / f"n{i}" for i in range(3)]
    synthetic.write_node_local([str(r) for r in roots], tag=TAG, shard_bytes=4096,
                               model_bytes=1024)
    dest = tmp_path / "dest"
    for r in roots:
        shutil.copytree(r, dest, dirs_exist_ok=True, copy_function=_keep_first)
    model = "mp_rank_00_model_states.pt"
    for index in (1, 2):  # the other nodes' copies were of another size
        path = dest / TAG / marker_name(index)
        marker = json.loads(path.read_text())
        marker["node_files"][model] += 64
        path.write_text(json.dumps(marker))
    verify_source(str(dest), TAG)
    path = dest / TAG / marker_name(0)
    marker = json.loads(path.read_text())
    marker["node_files"][model] += 64
    path.write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="its completion marker recorded"):
        verify_source(str(dest), TAG)


def _keep_first(src: str, dst: str) -> None:
    if not Path(dst).exists():
        shutil.copy2(src, dst)


def test_the_dry_run_says_what_the_launch_would_restore(tmp_path: Path,
                                                        transport: DispatchTransport) -> None:
    plan, _roots, _saved = _lost_node2(tmp_path)
    old = _local_plan(tmp_path, 3)
    said: list[str] = []
    prepare_continue(transport, plan, _prior(old), str(tmp_path / "home"), said.append,
                     dry_run=True)
    assert ("the launch would restore node index 1 (node2)'s part of global_step1 onto node5 "
            "from its replica on node3") in said, said
    assert not (Path(plan.nodes[1].ckpt_dir) / TAG).exists()  # nothing copied
