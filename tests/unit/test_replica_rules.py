"""The replica rules are decided once (issue 36): node/replicas/rules.py.

* the oracle: the launcher's decision (checkpoints/replicas/assemble.py, typed listings)
  and the Slurm node side's (node/slurm/restore.py, the listings' raw JSON) are fed the
  same listings of synthetic node-local checkpoints with ring replicas, whole and
  damaged (a torn or truncated own file, a missing or foreign completion marker; a
  replica with another tag or source in its manifest, without a manifest, a file of
  another size or cut short, its marker gone), and must give the same answers: which
  copies serve each node index, which indexes have none, which tag is used;
* the guard: no second definition of the rules, the placement or the tag order outside
  the rules module (an AST scan of clusterkit/, in the style of test_contract_names.py);
* placement: one rule for the plan and the Slurm nodes.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clusterkit.checkpoints.listing import NodeListing, parse_listing
from clusterkit.checkpoints.replicas.assemble import (
    assemble,
    candidate_tags,
    ranks_of_slots,
)
from clusterkit.node import contract
from clusterkit.node.ckpt.listing import listing
from clusterkit.node.replicas.rules import ring, ring_sources
from clusterkit.node.slurm import restore
from tests import synthetic_ckpt as synthetic
from tests.paths import REPO

RULES = "clusterkit/node/replicas/rules.py"
OLD, NEW = "global_step10", "global_step20"
N, RPN = 4, 2
HOSTS = [f"node{i + 1}" for i in range(N)]


# ------------------------------------------------------------------ the oracle


def _write_two_tag_roots(tmp: Path, replicas: int = 1) -> list[str]:
    roots = [str(tmp / h / "ckpt") for h in HOSTS]
    for tag in (OLD, NEW):
        synthetic.write_node_local(roots, ranks_per_node=RPN, zero_stage=2, shard_bytes=2048,
                                   model_bytes=512, tag=tag)
        synthetic.write_ring_replicas(roots, tag, replicas=replicas)
    return roots


def _shard(root: str, tag: str = NEW) -> str:
    return sorted(p for p in synthetic.shard_paths(root, tag) if "optim" in p)[0]


def _copy_dir(roots: list[str], source: int, tag: str = NEW) -> str:
    return contract.replica_dir(roots[(source + 1) % N], source, tag)


def _copy_shard(roots: list[str], source: int) -> str:
    d = os.path.join(_copy_dir(roots, source), NEW)
    return os.path.join(d, sorted(n for n in os.listdir(d) if "optim" in n)[0])


def _tear(path: str) -> None:
    """A .pt cut short at its original size: a zip's head, no end record."""
    size = os.path.getsize(path)
    with open(path, "wb") as fh:
        fh.write(b"PK\x03\x04" + b"\0" * (size - 4))


def _truncate(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 7)


def _edit_manifest(roots: list[str], whose: int, **changes: Any) -> None:
    path = os.path.join(_copy_dir(roots, whose), contract.REPLICA_MANIFEST)
    with open(path) as fh:
        doc = json.load(fh)
    doc.update(changes)
    with open(path, "w") as fh:
        json.dump(doc, fh)


def _unlink_marker(d: str, index: int) -> None:
    os.unlink(os.path.join(d, NEW, contract.marker_name(index)))


# name -> (damage, the node indexes that must have no usable copy of NEW with node 3 down)
DAMAGE: dict[str, tuple[Callable[[list[str]], None], set[int]]] = {
    "whole": (lambda r: None, set()),
    "own file torn": (lambda r: _tear(_shard(r[0])), set()),
    "own file truncated": (lambda r: _truncate(_shard(r[0])), set()),
    "own marker missing": (lambda r: _unlink_marker(r[0], 0), set()),
    "own marker of another index": (lambda r: os.rename(
        os.path.join(r[0], NEW, contract.marker_name(0)),
        os.path.join(r[0], NEW, contract.marker_name(3))), set()),
    "replica without manifest": (lambda r: os.unlink(
        os.path.join(_copy_dir(r, 2), contract.REPLICA_MANIFEST)), {2}),
    "replica manifest names another tag": (lambda r: _edit_manifest(r, 2, tag=OLD), {2}),
    "replica manifest names another source": (lambda r: _edit_manifest(r, 2, source=1), {2}),
    "replica manifest of another version": (lambda r: _edit_manifest(r, 2, version=99), {2}),
    "replica file truncated": (lambda r: _truncate(_copy_shard(r, 2)), {2}),
    "replica file torn": (lambda r: _tear(_copy_shard(r, 2)), {2}),
    "replica marker missing": (lambda r: _unlink_marker(_copy_dir(r, 2), 2), {2}),
    "own and replica of a part damaged": (
        lambda r: (_truncate(_shard(r[0])), _tear(_copy_shard(r, 0))), {0}),
}
DOWN = 2  # node3 is lost: its part must come from its replica on node4


def _launcher(roots: list[str], markers: bool, tag: str | None
              ) -> tuple[str | None, bool, dict[int, list[tuple[str, str]]]]:
    """assemble(): (tag, complete, index -> [(host, own|replica)])."""
    ls = [NodeListing(h, i, r, error="cannot list (refused)") if i == DOWN
          else parse_listing(h, i, r, json.dumps(listing(r, None)))
          for i, (h, r) in enumerate(zip(HOSTS, roots, strict=True))]
    a = assemble(ls, tag, expect_nodes=N, require_markers=markers,
                 ranks=None if markers else ranks_of_slots([RPN] * N))
    return a.tag, a.complete, {i: [(c.host, "replica" if c.replica else "own") for c in cs]
                               for i, cs in a.candidates.items() if cs}


def _slurm_listings(roots: list[str]) -> dict[str, Any]:
    # A node that did not list is an empty listing there (slurmreplica.plan).
    return {h: ({} if i == DOWN else listing(r, None))
            for i, (h, r) in enumerate(zip(HOSTS, roots, strict=True))}


def _node_side(roots: list[str], markers: bool, tag: str
               ) -> dict[int, list[tuple[str, str]]]:
    saved = restore.Saved(tuple(HOSTS), markers, RPN)
    return restore.sources(_slurm_listings(roots), tag, saved)


@pytest.mark.parametrize("markers", [True, False], ids=["workload", "user-script"])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_both_paths_give_the_same_answers(tmp_path: Path, case: str, markers: bool) -> None:
    roots = _write_two_tag_roots(tmp_path)
    damage, unusable = DAMAGE[case]
    damage(roots)
    _, complete, launcher = _launcher(roots, markers, NEW)
    node = _node_side(roots, markers, NEW)
    assert launcher == node, case
    assert {i for i in range(N) if i not in node} == unusable, (case, node)
    assert complete == (not unusable)
    # The tag each path settles on: the newest that every index has a copy of.
    tag, complete, _ = _launcher(roots, markers, None)
    plan = restore.decide(_slurm_listings(roots), HOSTS, HOSTS, markers, RPN)
    assert complete and tag == (OLD if unusable else NEW)
    assert plan.get("tag") == tag and "missing" not in plan, plan
    # The same tag order (every tag with a marker, a manifest or DeepSpeed's files).
    listed = [parse_listing(h, i, r, json.dumps(listing(r, None)))
              for i, (h, r) in enumerate(zip(HOSTS, roots, strict=True))]
    raw = {h: listing(r, None) for h, r in zip(HOSTS, roots, strict=True)}
    assert candidate_tags(listed, markers=markers) == \
        restore.candidate_tags(raw, markers) == [NEW, OLD]


def test_the_damage_is_named_where_a_part_has_no_copy(tmp_path: Path) -> None:
    """The launcher names why (the node side only needs whether): the rule's words."""
    roots = _write_two_tag_roots(tmp_path)
    _edit_manifest(roots, 2, source=1)
    ls = [NodeListing(h, i, r, error="down") if i == DOWN
          else parse_listing(h, i, r, json.dumps(listing(r, None)))
          for i, (h, r) in enumerate(zip(HOSTS, roots, strict=True))]
    assert assemble(ls, NEW).missing == {2: (
        "unreachable; no complete replica of global_step20 on any reachable node (node4's "
        "copy has a manifest for global_step20 of node index 1, not global_step20 of 2)")}


def test_a_spare_node_takes_the_lost_part_on_both_paths(tmp_path: Path) -> None:
    """Another node set (Slurm): node3 lost, node5 a spare. The node side moves node
    index 2's part from its replica on node4; its sources equal the launcher's."""
    roots = _write_two_tag_roots(tmp_path)
    spare = str(tmp_path / "node5" / "ckpt")
    os.makedirs(spare)
    new = ["node1", "node2", "node5", "node4"]
    raw = {h: listing(spare if h == "node5" else roots[HOSTS.index(h)], None) for h in new}
    saved = restore.Saved(tuple(HOSTS), True, RPN)
    _, _, launcher = _launcher(roots, True, NEW)
    assert restore.sources(raw, NEW, saved) == launcher
    plan = restore.decide(raw, new, HOSTS, True, RPN)
    assert plan["lines"] == ["node index 2 (was node3) -> node5: from its replica on node4"]


def test_at_usr1_only_a_save_complete_on_every_node_counts(tmp_path: Path) -> None:
    """node/slurm/end.py's question at USR1 (restore.saved_after): the newest tag that
    decide() assembles, node3's part from its replica, when written after the run's
    start; a newer tag that cannot be assembled is no save, the older one answers."""
    roots = _write_two_tag_roots(tmp_path)
    raw = _slurm_listings(roots)
    written = max(float(st[1]) for ls in raw.values() for st in
                  ((ls.get("tags") or {}).get(NEW) or {}).values())
    assert restore.saved_after(raw, HOSTS, True, RPN, 0.0) == NEW
    assert restore.saved_after(raw, HOSTS, True, RPN, written) is None  # before the run
    DAMAGE["replica file torn"][0](roots)
    assert restore.saved_after(_slurm_listings(roots), HOSTS, True, RPN, 0.0) == OLD


# ------------------------------------------------------------------ placement


def test_one_placement_rule_for_the_plan_and_the_slurm_nodes() -> None:
    ids = [("n1", "10.0.0.1"), ("n2", "10.0.0.2"), ("n3", "10.0.0.1"), ("n4", "10.0.0.4")]
    assert [ring(i, ids, 1) for i in range(4)] == [[1], [2], [3], [0]]
    assert ring(0, ids, 3) == [1, 3]  # n3 shares n1's address: never n1's holder
    assert ring_sources(0, ids, 1) == [3]


# ------------------------------------------------------------------ the guard

# A function of these names outside the rules module is at most a thin caller of it.
RULE_NAMES = {"ring", "ring_sources", "candidate_tags", "replica_ok", "own_index",
              "copy_problem", "own_problem", "part_problem", "missing_rank_files",
              "held_index", "part_sources", "sources", "tag_order", "parse_replica_manifest"}
# tag_step is the step rule: the replica code orders tags through the rules module;
# layout reads a tag's step number, collect-ckpt orders the tags its nodes all hold (its
# own choice, not a replica's) by the same rule.
TAG_STEP_USERS = {"clusterkit/node/contract.py", RULES, "clusterkit/checkpoints/layout.py",
                  "clusterkit/checkpoints/collect/discover.py",
                  "clusterkit/checkpoints/collect/manifest.py"}


def _parsed_modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(REPO)), ast.parse(p.read_text(encoding="utf-8")))
            for p in sorted((REPO / "clusterkit").rglob("*.py"))]


def _calls_rules(fn: ast.AST, rules_names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in rules_names for n in ast.walk(fn))


def _from_rules(tree: ast.Module) -> set[str]:
    return {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and n.module == "clusterkit.node.replicas.rules" for a in n.names}


def _is_ring_arithmetic(node: ast.AST) -> bool:
    """``(a + b) % count`` / ``(a - b) % count``: a position on a ring of nodes (a
    modulus written in capitals is a constant span, a port rule's, not a ring)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)):
        return False
    if not (isinstance(node.left, ast.BinOp) and isinstance(node.left.op, (ast.Add, ast.Sub))):
        return False
    right = node.right
    return not (isinstance(right, ast.Constant)
                or (isinstance(right, ast.Name) and right.id.isupper()))


def test_no_second_definition_of_the_replica_rules() -> None:
    problems = []
    for path, tree in _parsed_modules():
        if path == RULES:
            continue
        imported = _from_rules(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name in RULE_NAMES and not _calls_rules(node, imported):
                problems.append(f"{path}:{node.lineno}: def {node.name} decides a replica "
                                f"rule itself: call {RULES}")
            if _is_ring_arithmetic(node):
                problems.append(f"{path}:{node.lineno}: ring arithmetic: use "
                                f"{RULES}'s ring/ring_distance")
            if isinstance(node, ast.Name) and node.id == "tag_step" \
                    and path not in TAG_STEP_USERS:
                problems.append(f"{path}:{node.lineno}: orders tags by tag_step: use "
                                f"{RULES}'s tag_order/oldest_first")
            if isinstance(node, ast.Compare) and any(
                    isinstance(n, ast.Name) and n.id in ("REPLICA_SCHEMA", "REPLICA_SCHEMA_VERSION")
                    for n in ast.walk(node)):
                problems.append(f"{path}:{node.lineno}: judges a replica manifest: use "
                                f"{RULES}'s parse_replica_manifest")
    assert not problems, "\n".join(problems)


def test_the_guard_sees_a_second_ring() -> None:
    """The scan's shapes match what the rules module used to be copied as."""
    code = ast.parse("def ring(i, a, k):\n    return [(i + s) % len(a) for s in range(k)]\n")
    assert any(_is_ring_arithmetic(n) for n in ast.walk(code))
    fn = code.body[0]
    assert isinstance(fn, ast.FunctionDef) and not _calls_rules(fn, set())
    assert not any(_is_ring_arithmetic(n) for n in ast.walk(ast.parse("(h + i) % SPAN")))


def test_a_universal_conversion_beside_a_tag_is_no_part_of_its_save() -> None:
    """HF's checkpoint-N after a reshard holds the old world's global_stepN and, beside it,
    global_stepN_universal, whose ZeRO-3 model states are every rank's of the new world:
    node index 1's own dir (ranks 2-3) is still node index 1's part, complete, judged by
    the save's own files only (before, its lowest rank file was the conversion's rank 0)."""
    from clusterkit.node.replicas.rules import Copy, held_index, own_problem

    st = (100, 1.0, True)
    files = {f"global_step10/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt": st
             for r in (2, 3) for kind in ("model", "optim")}
    files.update({f"global_step10_universal/zero_pp_rank_{r}_mp_rank_00_model_states.pt": st
                  for r in (0, 1, 2)})
    files["global_step10_universal/zero/w/fp32.pt"] = st
    own = Copy(files=files, markers={})
    ranks = {0: range(0, 2), 1: range(2, 4)}
    assert held_index(own, 1, False, ranks) == 1
    assert own_problem(own, 1, "checkpoint-10", False, ranks[1]) == ""
    del files["global_step10/zero_pp_rank_3_mp_rank_00_optim_states.pt"]
    assert "zero_pp_rank_3_mp_rank_00_optim_states.pt" in own_problem(
        Copy(files=files, markers={}), 1, "checkpoint-10", False, ranks[1])
