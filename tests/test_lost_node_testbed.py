"""Issue 22 acceptance: a node lost for good, and the job goes on without it.

The test bed's ``destroy(node)`` (tests/testbed/core.py) is the lost server: its
processes killed, its namespace and its node-private /scratch deleted for good.
"""

from __future__ import annotations

import pytest

from tests.testbed import Testbed, temporary


@pytest.mark.testbed
def test_destroy_loses_a_node_for_good(testbed_required: None) -> None:
    with temporary(2) as tb:
        _check_destroy(tb)


def _check_destroy(tb: Testbed) -> None:
    a, b = tb.nodes
    local = tb.local_mountpoint / "ckpt"
    tb.exec(a, ["sh", "-c", f"mkdir -p {local} && echo x > {local}/f"], check=True)
    sleeper = tb.spawn(a, ["sleep", "600"])
    scratch = tb.node_local_path(a, "ckpt/f")
    assert scratch.exists()
    tb.destroy(a)
    assert tb.destroyed(a) and not tb.destroyed(b)
    assert sleeper.wait(timeout=10) is not None
    assert not scratch.exists() and not scratch.parent.exists()
    # The survivor cannot reach it any more: no answer, not a swallowed packet.
    r = tb.exec(b, ["sh", "-c", f"ping -c1 -W2 {a.address} >/dev/null 2>&1; echo $?"])
    assert r.stdout.strip() != "0"
    tb.destroy(a)  # idempotent
    assert tb.ensure(2)[0].name == a.name and tb.destroyed(a)  # never brought back
