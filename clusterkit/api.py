"""clusterkit from Python: launch, status, stop, doctor, collect, sync and node
preparation (install_nodes, copy_env, build_ops) (docs/api.md).

The CLI verbs call these same functions, so a job launched from a notebook lands in
the same registry, prints the same console and refuses the same inputs as
``clusterkit launch``. Arguments are the job model's own types
(:class:`clusterkit.spec.job.JobOptions` is every job flag, :class:`RunOptions`
launch's runtime flags); results are dataclasses of the modules that produce them.
Every refusal is a :class:`clusterkit.errors.ClusterkitError` (``InventoryError``,
``SelectionError``, ``LaunchError``, ``CheckpointError``, ...), the exception the CLI
prints as one line with exit code 2. Each call prints what the verb prints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

from clusterkit.hostfile import select_hosts
from clusterkit.inventory import Inventory
from clusterkit.jobs.collect import CollectHooks, CollectRequest, CollectResult, collect_job
from clusterkit.jobs.doctor import DoctorResult, ExtraCheck, run_checks
from clusterkit.jobs.here import clusterkit_home, find_inventory
from clusterkit.jobs.launch import Sync, plan_launch, run_launch
from clusterkit.jobs.prepare import (
    BuildOpsResult,
    InstallResult,
    build_ops_hosts,
    copy_env_hosts,
    install_hosts,
)
from clusterkit.jobs.resolve import NodeChoice
from clusterkit.jobs.status import JobStatus, job_status, list_jobs
from clusterkit.jobs.stop import StopResult, stop_job
from clusterkit.jobs.sync import SyncHooks, sync_hosts
from clusterkit.launch.registry import JobRecord
from clusterkit.launch.run import LaunchResult
from clusterkit.launchers import DEFAULT_LAUNCHER
from clusterkit.node.protocol import DEFAULT_GRACE_S
from clusterkit.provision.envcopy import EnvSource, NodeEnv
from clusterkit.remote.base import DEFAULT_CONNECT_TIMEOUT_S
from clusterkit.spec.job import JobOptions, RunOptions
from clusterkit.sync.types import SyncResult


def _inventory(inventory: str | Inventory | None) -> Inventory:
    return inventory if isinstance(inventory, Inventory) else find_inventory(inventory)


def launch(options: JobOptions | None = None, *, inventory: str | Inventory | None = None,
           launcher: str = DEFAULT_LAUNCHER, run: RunOptions | None = None,
           master_addr: str | None = None, quiet: bool = False,
           ranks: frozenset[int] | None = None, sync: Sync | None = None) -> LaunchResult:
    """Launch a job on every selected node and wait for its end, as ``clusterkit launch``.

    ``options``: the job (default ``JobOptions(job_id="")``: the bundled workload); an
    empty ``job_id`` gets a new ``<cluster>-<date>-<time>`` id, an existing job's id
    continues that job. ``options.max_restarts`` is clusterkit's own relaunches after a
    failure. ``inventory``: a YAML path or an :class:`Inventory` (default:
    ``$CLUSTERKIT_INVENTORY``, ``./clusterkit.yaml``, else the embedded local default).
    ``launcher``: a name of ``clusterkit.launchers.BACKENDS``. ``quiet``: no rank lines;
    ``ranks``: whose lines stream (default all). ``sync``: the CLI's ``--sync DIR``.

    Returns the :class:`clusterkit.launch.run.LaunchResult` (``exit_code``: 0 when the
    job finished; ``plan.job_id``; ``outcomes[-1].summary``: rank 0's summary). A job
    that failed is a result with a nonzero ``exit_code``, not an exception; a launch
    that refuses to start raises."""
    inv = _inventory(inventory)
    run = run or RunOptions()
    request = plan_launch(options or JobOptions(job_id=""), inv, run=run, launcher=launcher,
                          master_addr=master_addr)
    return run_launch(request, run=run, sync=sync, quiet=quiet, ranks=ranks)


@overload
def status(job: None = None) -> list[JobRecord]: ...


@overload
def status(job: str) -> JobStatus: ...


def status(job: str | None = None) -> list[JobRecord] | JobStatus:
    """``status()``: every job launched from this machine (its registry's records, oldest
    first). ``status(JOB)``: that job's :class:`clusterkit.jobs.status.JobStatus`, each
    node asked for its processes (``nodes``) and a node-local job's replica health
    (``checkpoints``). Raises :class:`~clusterkit.errors.LaunchError` for an unknown job."""
    if job is None:
        return list_jobs(clusterkit_home())
    return job_status(clusterkit_home(), job)


def stop(job: str, *, grace_s: float = DEFAULT_GRACE_S) -> StopResult:
    """Stop job ``job`` on every node (SIGTERM, ``grace_s``, SIGKILL; only that job's
    processes), as ``clusterkit stop``. Raises :class:`~clusterkit.errors.LaunchError`
    for an unknown or batch job and :class:`clusterkit.jobs.stop.StopIncomplete` (its
    ``result`` names each node) when a node keeps a process of the job."""
    return stop_job(clusterkit_home(), job, grace_s)


def doctor(inventory: str | Inventory | None = None, *, nodes: int | None = None,
           gpus_per_node: int | None = None, include: str = "", exclude: str = "",
           launcher: str = DEFAULT_LAUNCHER, job_id: str | None = None,
           master_port: int | None = None, ckpt_bytes: int | None = None,
           replicas: int | None = None, storage: str | None = None,
           bandwidth: int | None = None,
           connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
           accept_new_host_keys: bool = False,
           extra: tuple[ExtraCheck, ...] = ()) -> DoctorResult:
    """The pre-flight checks on every selected node, as ``clusterkit doctor`` (same
    selection words as ``JobOptions``: ``nodes``, ``gpus_per_node``, ``include``,
    ``exclude``). ``bandwidth``: also an all_reduce and pairwise round with messages of
    that many bytes. Returns :class:`clusterkit.jobs.doctor.DoctorResult`:
    ``report.exit_code(strict=False)`` is the verb's exit code, ``report.to_json()`` its
    ``--json``; the peer interfaces kept for the next launch in ``ifaces``."""
    return run_checks(_inventory(inventory), nodes=nodes, gpus_per_node=gpus_per_node,
                      include=include, exclude=exclude, launcher=launcher, job_id=job_id,
                      master_port=master_port, ckpt_bytes=ckpt_bytes, replicas=replicas,
                      storage=storage, bandwidth_bytes=bandwidth,
                      connect_timeout_s=connect_timeout_s,
                      accept_new_host_keys=accept_new_host_keys, extra=extra)


def collect(request: CollectRequest | str, *, inventory: str | Inventory | None = None,
            hooks: CollectHooks | None = None) -> CollectResult:
    """Gather a checkpoint from the nodes into one directory, as ``clusterkit collect-ckpt``.

    ``request``: a job id (its newest checkpoint, into the job's ``checkpoints`` dir), or
    a :class:`clusterkit.jobs.collect.CollectRequest` (which nodes: ``where``, a
    :class:`clusterkit.jobs.resolve.NodeChoice`; ``dest``, ``tag``, ``consolidate``, ...).
    ``inventory`` is read only for nodes no job records. Returns the
    :class:`clusterkit.jobs.collect.CollectResult` (``dest``, ``tag``, ``report``);
    raises :class:`~clusterkit.checkpoints.collectplan.CheckpointIncomplete` (nothing
    copied; its ``problems``) or :class:`~clusterkit.errors.CheckpointError`."""
    if isinstance(request, str):
        request = CollectRequest(where=NodeChoice(job=request))
    if isinstance(inventory, Inventory):
        return collect_job(request, home=clusterkit_home(), inventory=inventory, hooks=hooks)
    path = inventory  # read when a node needs it: a job's own nodes do not
    return collect_job(request, home=clusterkit_home(), inventory=lambda: find_inventory(path),
                       hooks=hooks)


def sync(src: str = ".", *, inventory: str | Inventory | None = None,
         nodes: int | None = None, gpus_per_node: int | None = None, include: str = "",
         exclude: str = "", delete: bool = False, exclude_from: str | None = None,
         dest: str | None = None, port: int | None = None,
         hooks: SyncHooks | None = None) -> SyncResult:
    """Copy directory ``src`` to the same path under every selected node's workdir, as
    ``clusterkit sync`` (same selection words as ``JobOptions``; ``delete``,
    ``exclude_from``, ``dest``, ``port`` are the verb's flags). ``hooks`` (a
    :class:`clusterkit.jobs.sync.SyncHooks`) hears the start, the progress and the notes.

    Returns the :class:`clusterkit.sync.types.SyncResult`: ``ok`` when every node holds
    the source's ``digest``, ``nodes`` the per-node results. A node that could not be
    completed is a result (``ok`` false), not an exception; bad input (no such
    directory, ``--dest`` outside the workdir) raises."""
    chosen = select_hosts(_inventory(inventory), nodes=nodes, gpus_per_node=gpus_per_node,
                          include=include, exclude=exclude)
    return sync_hosts(src, [h for h, _ in chosen], delete=delete, exclude_from=exclude_from,
                      dest=dest, port=port, hooks=hooks)


def install_nodes(inventory: str | Inventory | None = None, *, wheel: str | None = None,
                  nodes: int | None = None, gpus_per_node: int | None = None,
                  include: str = "", exclude: str = "",
                  announce: Callable[[int], None] | None = None) -> InstallResult:
    """``clusterkit nodes install``: this clusterkit (a wheel built here, offline, or
    ``wheel``) on every selected node. Per-node results; ``group`` says which failed.
    ``announce`` hears the number of nodes once the wheel passed its check."""
    chosen = select_hosts(_inventory(inventory), nodes=nodes, gpus_per_node=gpus_per_node,
                          include=include, exclude=exclude)
    return install_hosts([h for h, _ in chosen], Path(wheel) if wheel else None,
                         announce=announce)


def copy_env(inventory: str | Inventory | None = None, *, python: str | None = None,
             node_python: str = "python3", nodes: int | None = None,
             gpus_per_node: int | None = None, include: str = "", exclude: str = "",
             announce: Callable[[EnvSource, int], None] | None = None,
             on_progress: Callable[[Any], None] | None = None) -> dict[str, NodeEnv]:
    """``clusterkit nodes env``: this machine's Python environment onto every selected
    node at the same path (docs/sync.md). Per-node results: a node's ``error`` says why
    it does not hold the environment."""
    chosen = select_hosts(_inventory(inventory), nodes=nodes, gpus_per_node=gpus_per_node,
                          include=include, exclude=exclude)
    return copy_env_hosts([h for h, _ in chosen], python=python, node_python=node_python,
                          announce=announce, on_progress=on_progress)


def build_ops(inventory: str | Inventory | None = None, *, ops: Sequence[str] = (),
              ds_config: Mapping[str, object] | None = None, remove_stale_locks: bool = False,
              nodes: int | None = None, gpus_per_node: int | None = None, include: str = "",
              exclude: str = "") -> BuildOpsResult:
    """``clusterkit nodes build-ops``: DeepSpeed's JIT ops (those ``ds_config`` needs, and
    ``ops``) built on every selected node. Per-node answers; ``failed`` names the nodes
    that could not and why."""
    chosen = select_hosts(_inventory(inventory), nodes=nodes, gpus_per_node=gpus_per_node,
                          include=include, exclude=exclude)
    request = {"ops": list(ops), "ds_config": dict(ds_config) if ds_config is not None else None,
               "remove_stale": remove_stale_locks}
    return build_ops_hosts([h for h, _ in chosen], request)
