"""Issue 22: --replace OLD=NEW (hostfile.apply_replace), the continue rule for a replaced
node (launch/run.check_continue) and the restore of a lost node's part (launch/recover.py)."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from clusterkit.errors import SelectionError
from clusterkit.hostfile import apply_replace, parse_replace, select

POOL = OrderedDict((f"node{i}", 2) for i in range(1, 9))


def test_the_spare_takes_the_lost_nodes_place_and_slots() -> None:
    chosen = select(POOL, nodes=7)
    out = apply_replace(chosen, POOL, parse_replace(["node6=node8"]))
    assert list(out) == ["node1", "node2", "node3", "node4", "node5", "node8", "node7"]
    assert out["node8"] == [0, 1]


@pytest.mark.parametrize(("words", "needle"), [
    (["node6"], "expected OLD=NEW"),
    (["node6=node6"], "expected OLD=NEW"),
    (["node6=node8", "node6=node1"], "named twice"),
    (["node8=node1"], "not among the selected hosts"),
    (["node6=node9"], "not an inventory host"),
    (["node6=node5"], "already selected"),
])
def test_bad_replacements_are_refused(words: list[str], needle: str) -> None:
    with pytest.raises(SelectionError, match=needle):
        apply_replace(select(POOL, nodes=7), POOL, parse_replace(words))


def test_a_spare_with_fewer_slots_is_refused() -> None:
    pool = OrderedDict([("a", 2), ("b", 2), ("spare", 1)])
    with pytest.raises(SelectionError, match="spare has 1 slots, b ran 2"):
        apply_replace(select(pool, nodes=2), pool, parse_replace(["b=spare"]))
