"""collect-ckpt end to end: ``clusterkit collect-ckpt`` and ``clusterkit.api.collect``.

:func:`collect_job` resolves the nodes (jobs/resolve.py), then runs one of:

* the collect (``checkpoints.collect.verb.collect``: list, verify, hash, copy with
  sha256 end to end, ``latest``, the manifest, ``--prune-sources``), and with
  ``consolidate`` one fp32 state dict written from DEST (DeepSpeed's code);
* with ``scatter``, the way back: DEST's tag pushed to the nodes in the layout a launch
  on them resumes from.

It returns a :class:`CollectResult` and raises the project's errors
(:class:`CheckpointIncomplete` when nothing could be copied, its ``problems`` one line
per finding; :class:`CheckpointError`, ``LaunchError`` for an unknown job). What the
caller shows while it works comes through :class:`CollectHooks`; the CLI prints the
rest from the result.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterkit.checkpoints.collect.manifest import latest_tag_at
from clusterkit.checkpoints.collect.scatter import ScatterReport, ScatterTarget, scatter
from clusterkit.checkpoints.collect.verb import CollectOptions, CollectReport, collect
from clusterkit.checkpoints.collectplan import CollectPlan, WithoutMarkers, describe
from clusterkit.checkpoints.convert.consolidate import Consolidated
from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.checkpoints.sources.transfer import ProgressSink
from clusterkit.errors import CheckpointError
from clusterkit.fsutil import check_writable
from clusterkit.jobs.resolve import InventorySource, NodeChoice, ResolvedNodes, resolve_nodes
from clusterkit.remote.base import Transport
from clusterkit.remote.dispatch import transport_for

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # --max-shard-size's 5GB


@dataclass(frozen=True)
class CollectRequest:
    """What to collect and how: the fields are collect-ckpt's flags (docs/collect-ckpt.md);
    errors name those flags."""

    where: NodeChoice = field(default_factory=NodeChoice)
    dest: str | None = None  # --to; default: the job's checkpoints dir, or DEFAULT_DEST
    tag: str = "latest"
    without_markers: bool = False  # a user's own save: DeepSpeed's file set, not markers
    world_size: int | None = None  # with without_markers: the ranks that saved it
    consolidate: str | None = None  # "fp32" | "safetensors": also one state dict
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    scatter: bool = False  # push DEST/<tag> back to the nodes instead of collecting
    prune_sources: bool = False
    jobs: int = 8
    fsync: bool = True
    dry_run: bool = False


@dataclass(frozen=True)
class CollectHooks:
    """What the caller shows while the work goes on (all optional)."""

    progress: ProgressSink | None = None  # bytes and files as they are copied
    said: Callable[[str], None] = lambda line: None  # a batch job's nodes, reached how
    planned: Callable[[CollectPlan], None] = lambda plan: None  # verified, before any copy
    collected: Callable[[CollectResult], None] = lambda result: None  # before consolidating


@dataclass
class CollectResult:
    """What :func:`collect_job` did: ``report`` for a collect (a dry run too),
    ``scattered`` for a scatter; ``consolidated`` when asked for."""

    dest: str
    tag: str
    nodes: ResolvedNodes
    dry_run: bool = False
    report: CollectReport | None = None
    consolidated: Consolidated | None = None
    consolidate_seconds: float = 0.0
    scattered: ScatterReport | None = None

    def to_json(self) -> dict[str, Any]:
        """``collect-ckpt --json``'s report."""
        if self.scattered is not None:
            r = self.scattered
            return {"scatter": {"nodes": {p.node: list(p.ranks) for p in r.pushes},
                                "remapped": r.remapped}}
        assert self.report is not None
        report = self.report
        out: dict[str, Any] = {"collect": describe(report.plan), "dest": self.dest,
                               "copied_bytes": report.bytes_copied, "skipped": report.skipped,
                               "notes": report.notes}
        if report.replicas is not None:
            out["replicas"] = {"used": report.replicas.used(not self.dry_run),
                               "parts": report.replicas.parts_json()}
        if self.consolidated is not None:
            c = self.consolidated
            out["consolidated"] = {"out_dir": c.out_dir, "files": list(c.files),
                                   "tensors": c.tensors, "model_check": c.model_check}
        return out


def collect_job(request: CollectRequest, *, home: Path, inventory: InventorySource,
                hooks: CollectHooks | None = None,
                transport: Transport | None = None) -> CollectResult:
    """collect-ckpt for ``request``: resolve the nodes, then collect (and consolidate) or
    scatter. ``home``: the clusterkit home whose registry names the jobs;
    ``inventory``: the inventory (or how to load it) for nodes no job records.
    ``transport``: the one to use (default: a new one, closed afterwards)."""
    hooks = hooks or CollectHooks()
    if request.jobs < 1:
        raise CheckpointError("--jobs must be >= 1", key="--jobs")
    if request.dest is not None and not request.scatter:  # its parent must exist (like cp)
        check_writable(request.dest, "--to", directory=True)
    resolved = resolve_nodes(request.where, home=home, inventory=inventory)
    if resolved.places:
        hooks.said(resolved.places)
    dest = os.path.abspath(request.dest or resolved.default_dest)
    options = CollectOptions(dest=dest, tag=request.tag, jobs=request.jobs,
                             method=request.where.via, fsync=request.fsync,
                             dry_run=request.dry_run, prune_sources=request.prune_sources,
                             without_markers=without_markers(request, resolved))
    if request.scatter:
        tag = _scatter_tag(request, resolved.nodes, dest)
        with _transport(transport) as t:
            scattered = _scatter(t, resolved, dest, tag, request.jobs)
        return CollectResult(dest, tag, resolved, scattered=scattered)
    with _transport(transport) as t:
        report = collect(t, resolved.nodes, options, hooks.progress, on_plan=hooks.planned)
    result = CollectResult(dest, report.plan.tag, resolved, request.dry_run, report)
    hooks.collected(result)
    if request.consolidate and not request.dry_run:
        t0 = time.monotonic()
        result.consolidated = _consolidate(dest, report.plan, request)
        result.consolidate_seconds = time.monotonic() - t0
    return result


def without_markers(request: CollectRequest, resolved: ResolvedNodes) -> WithoutMarkers | None:
    """How a save without clusterkit's markers is judged: asked for, or a launched user's
    script (its record says it writes none: no flag needed, issue 32); else None."""
    users_script = resolved.markers is False
    if not request.without_markers and not users_script:
        if request.world_size is not None:
            raise CheckpointError("--world-size is for --without-markers (markers record it)",
                                  key="--world-size", hint="add --without-markers or drop it")
        return None
    slots = resolved.slots
    world = request.world_size if request.world_size is not None else sum(slots)
    if world < 1 or (request.world_size is None and not all(slots)):
        raise CheckpointError("the world size of the save is not known", key="--world-size",
                              hint="pass --world-size N (the number of ranks that saved it)")
    return WithoutMarkers(world_size=world,
                          slots=tuple(slots) if request.world_size is None else ())


def _scatter_tag(request: CollectRequest, nodes: list[CollectNode], dest: str) -> str:
    """The tag a scatter pushes, after its refusals (in the order the CLI always gave)."""
    if any(n.via is not None for n in nodes):
        raise CheckpointError("--scatter does not run through Slurm", key="--scatter",
                              hint="scatter over SSH: -i INVENTORY --dir CKPT_DIR --scatter "
                                   "(or the job with --via ssh)")
    tag = request.tag if request.tag != "latest" else latest_tag_at(dest)
    if tag is None:
        raise CheckpointError("DEST has no 'latest' file", path=dest,
                              hint="pass --tag, or collect a checkpoint into DEST first")
    if request.dry_run or request.consolidate or request.prune_sources:
        raise CheckpointError("--scatter pushes DEST back to the nodes and does nothing else",
                              key="--scatter", hint="run the collect and the scatter separately")
    return tag


def _scatter(transport: Transport, resolved: ResolvedNodes, dest: str, tag: str,
             jobs: int) -> ScatterReport:
    if not all(resolved.slots):
        raise CheckpointError("--scatter needs the slots of each node", key="--scatter",
                              hint="use the inventory (not a JOB) to scatter")
    targets = [ScatterTarget(n, s) for n, s in zip(resolved.nodes, resolved.slots, strict=True)]
    return scatter(transport, dest, tag, targets, jobs=jobs)


def _consolidate(dest: str, plan: CollectPlan, request: CollectRequest) -> Consolidated:
    # Both import torch (DeepSpeed's zero_to_fp32, the bundled model): only when asked.
    from clusterkit.checkpoints.convert.consolidate import consolidate
    from clusterkit.workload.verify import check_against_workload

    assert request.consolidate is not None
    return consolidate(dest, plan.tag, request.consolidate,
                       max_shard_size=request.max_shard_size, ds_subdir=plan.ds_subdir,
                       universal=plan.universal, model_check=check_against_workload)


@contextlib.contextmanager
def _transport(given: Transport | None) -> Iterator[Transport]:
    """The caller's transport as is, or a new one closed on the way out."""
    if given is not None:
        yield given
        return
    with transport_for() as transport:
        yield transport
