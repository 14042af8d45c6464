"""``collect-ckpt --prune-sources``: delete the collected tag's files on every node,
only after DEST verified them; over SSH, or through Slurm for nodes reached that way."""

from __future__ import annotations

import concurrent.futures as cf
import posixpath
from collections.abc import Mapping, Sequence

from clusterkit.checkpoints.collectplan import CollectPlan
from clusterkit.checkpoints.sources.base import LIST_TIMEOUT_S, CollectNode
from clusterkit.remote.base import Transport
from clusterkit.slurm.steps import run_step


def prune_sources(transport: Transport, nodes: Sequence[CollectNode], plan: CollectPlan
                  ) -> dict[str, str]:
    """Per node with files of the tag: "ok" or why not."""
    argv: dict[str, list[str]] = {}
    for n in nodes:
        rels = sorted({c.relpath for copies in plan.files.values() for c in copies
                       if c.node == n.name and c.relpath.startswith(plan.tag + "/")})
        if rels:
            paths = [posixpath.join(n.root, r) for r in rels]
            script = 'rm -f -- "$@" && find "$0" -depth -type d -empty -delete'
            argv[n.name] = ["sh", "-c", script, posixpath.join(n.root, plan.tag), *paths]
    out = _prune_through_slurm([n for n in nodes if n.name in argv and n.via is not None], argv)
    chosen = [n for n in nodes if n.name in argv and n.via is None]
    group = transport.run_all([n.target for n in chosen], argv, timeout=LIST_TIMEOUT_S)
    for n, res in zip(chosen, group, strict=True):
        out[n.name] = "ok" if res.ok else (res.error.message if res.error else
                                           (res.result.stderr.strip() if res.result else "?"))
    return out


def _prune_through_slurm(nodes: Sequence[CollectNode], argv: Mapping[str, list[str]]
                         ) -> dict[str, str]:
    def one(n: CollectNode) -> str:
        assert n.via is not None
        res = run_step(n.via, argv[n.name], LIST_TIMEOUT_S + n.via.startup_s)
        tail = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        return "ok" if res.returncode == 0 else tail

    with cf.ThreadPoolExecutor(max_workers=min(64, len(nodes) or 1)) as pool:
        return dict(zip([n.name for n in nodes], pool.map(one, nodes), strict=True))
