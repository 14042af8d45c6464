"""Nodes for the collect tests: local "nodes" on this machine, each with its own
checkpoint root under a test's tmp dir."""

from __future__ import annotations

import sys
from pathlib import Path

from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.remote.base import SSHTarget


def local_collect_nodes(tmp: Path, n: int) -> list[CollectNode]:
    """node1..node{n}, reached locally, running this interpreter; node i's root is
    ``tmp/node{i}/ckpt``."""
    return [CollectNode(f"node{i + 1}", SSHTarget(name=f"node{i + 1}", address="127.0.0.1",
                                                  local=True),
                        sys.executable, str(tmp / f"node{i + 1}" / "ckpt")) for i in range(n)]
