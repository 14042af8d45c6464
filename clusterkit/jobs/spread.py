"""A file the program writes on one rank only, on every node before a restart (issue 38).

A torch snapshot program (pytorch/examples' multinode.py) saves ``snapshot.pt`` on
global rank 0, and on start every rank loads it if it exists: on node-local storage
the other nodes have none (or an older one) and start from epoch 0 while rank 0
resumes. Before a restart or a relaunch of such a program (its profile's
``one_writer``), every file at the top of the job's checkpoint dir is made the same on
every node of the plan: the newest copy (by mtime) is fetched from its writer here,
put on each node whose copy is missing or differs, and its sha256 checked there
against the writer's. A node that cannot be reached is left out (the gate names it).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from clusterkit.errors import LaunchError
from clusterkit.hostrange import fold
from clusterkit.node.ckpt.ready import newest_holder, spread_line
from clusterkit.remote.base import FileStat, Transport, target_for
from clusterkit.spec.job import JobPlan, NodePlan

Say = Callable[[str], None]


@dataclass(frozen=True)
class Copy:
    """One node's copy of one top-level file."""

    node: NodePlan
    stat: FileStat | None


def top_files(transport: Transport, node: NodePlan) -> list[str] | None:
    """The plain files at the top of ``node``'s checkpoint dir; None: not reachable.

    A reachable node without the dir (a spare taking a lost node's place, a node new to
    the job) holds none: it is the node that most needs the copy, never one left out."""
    target = target_for(node.host)
    try:
        if transport.stat(target, node.ckpt_dir) is None:
            return []
        names = transport.listdir(target, node.ckpt_dir)
    except Exception:  # each transport has its own error: not reachable
        return None
    out = []
    for name in names:
        st = transport.stat(target, posixpath.join(node.ckpt_dir, name))
        if st is not None and not st.is_dir and not name.startswith("."):
            out.append(name)
    return out


def newest(copies: Sequence[Copy]) -> Copy | None:
    """The writer's copy (pure): node/ckpt/ready.newest_holder's rule, the batch script's too."""
    held = {c.node.name: c for c in copies if c.stat is not None}
    name = newest_holder({n: c.stat.mtime for n, c in held.items() if c.stat is not None})
    return None if name is None else held[name]


def spread_files(transport: Transport, plan: JobPlan, staging: str, say: Say) -> None:
    """Every top-level file of the checkpoint dir the same on every reachable node."""
    reachable: list[NodePlan] = []
    names: set[str] = set()
    for node in plan.nodes:
        found = top_files(transport, node)
        if found is not None:
            reachable.append(node)
            names.update(found)
    for name in sorted(names):
        _spread_one(transport, reachable, name, staging, say)


def _spread_one(transport: Transport, nodes: Sequence[NodePlan], name: str, staging: str,
                say: Say) -> None:
    copies = [Copy(n, transport.stat(target_for(n.host), posixpath.join(n.ckpt_dir, name)))
              for n in nodes]
    src = newest(copies)
    if src is None:
        return
    path = posixpath.join(src.node.ckpt_dir, name)
    digest = transport.sha256(target_for(src.node.host), path)
    behind = [c.node for c in copies if c.node is not src.node and (
        c.stat is None or transport.sha256(target_for(c.node.host),
                                           posixpath.join(c.node.ckpt_dir, name)) != digest)]
    if not behind:
        return
    local = os.path.join(staging, name)
    transport.get(target_for(src.node.host), path, local)
    for node in behind:
        target = target_for(node.host)
        transport.makedirs(target, node.ckpt_dir)
        dest = posixpath.join(node.ckpt_dir, name)
        # Put beside it, then rename: a program never finds half a file.
        tmp = posixpath.join(node.ckpt_dir, f".{name}.clusterkit-partial")
        transport.put(target, local, tmp)
        if transport.sha256(target, tmp) != digest:
            raise LaunchError(f"{name}: sha256 mismatch on {node.name} after the copy from "
                              f"{src.node.name}", host=node.name)
        res = transport.run(target, ["mv", "-f", "--", tmp, dest], timeout=60.0)
        if not res.ok:
            raise LaunchError(f"{name}: cannot move it into place on {node.name}: "
                              f"{res.stderr.strip()[-200:]}", host=node.name)
    os.remove(local)
    say(spread_line(name, src.node.name, fold([n.name for n in behind])))
