"""A job named by the user, resolved: its record, its nodes and their checkpoint dirs.

``clusterkit collect-ckpt JOB`` (and ``clusterkit.api.collect``) name a job by its
clusterkit id, by the Slurm id of a batch job `clusterkit sbatch --submit` recorded, or
by a batch job's dir (also given as ``--dir``); with no job, an inventory and a node
selection name the nodes. Either way the answer is a :class:`ResolvedNodes`: one
:class:`CollectNode` per node (its SSH target or its Slurm place, its interpreter, its
checkpoint dir), the ranks each held, and where a collect goes by default.

Lives in ``jobs`` because it joins ``launch`` (the registry and the record), ``slurm``
(a batch job's places) and ``checkpoints`` (``CollectNode``), one layer whose packages
may not import each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from clusterkit.checkpoints.sources.base import CollectNode
from clusterkit.errors import CheckpointError
from clusterkit.hostfile import filter_resources, select_hosts
from clusterkit.hostrange import fold
from clusterkit.inventory import Host, Inventory
from clusterkit.launch.registry import SBATCH_SCRIPT, JobRecord, Registry, is_sbatch_dir
from clusterkit.node.contract import JobDir
from clusterkit.remote.base import SSHTarget, target_for
from clusterkit.slurm.client import SlurmClient
from clusterkit.slurm.steps import ALLOC_WAIT_S, SlurmPlace, job_places, site_args

DEFAULT_DEST = "checkpoints-collected"  # without a job: ./checkpoints-collected

# An inventory, or how to load one: only some jobs need it (a node without a recorded
# checkpoint dir), so the CLI's -i is read only then.
InventorySource = Inventory | Callable[[], Inventory]


@dataclass(frozen=True)
class NodeChoice:
    """Which nodes to read: the job (``job``, or a batch job's dir as ``ckpt_dir``), or
    the inventory's hosts as ``--nodes/--gpus-per-node/--include/--exclude`` select them
    (over a job's own nodes, ``include``/``exclude`` apply too)."""

    job: str | None = None  # clusterkit job id, Slurm job id, or a batch job's dir
    ckpt_dir: str | None = None  # checkpoint root on every node ({host}, {node} expand)
    nodes: int | None = None
    gpus_per_node: int | None = None
    include: str = ""  # DeepSpeed's NAME[:SLOT[,SLOT]][@...]
    exclude: str = ""
    via: str = "auto"  # auto | ssh | sftp | slurm: how the nodes are reached
    slurm_wait: int = ALLOC_WAIT_S  # a batch job that no longer runs: the allocation's wait


@dataclass(frozen=True)
class ResolvedNodes:
    """The nodes to read, in node-index order, and what the job says about them."""

    nodes: list[CollectNode]
    slots: list[int]  # ranks per node (0: not known)
    default_dest: str  # the job's ``checkpoints`` dir, or ./checkpoints-collected
    record: JobRecord | None = None  # None: the inventory's hosts, no job
    places: str = ""  # a batch job: which nodes, reached how (one line for the console)

    @property
    def markers(self) -> bool | None:
        """Whether the job's program writes clusterkit's completion markers (the bundled
        workload does, a user's script does not); None: no job, not known."""
        return None if self.record is None else self.record.ckpt.markers


def find_job(job: str | None, ckpt_dir: str | None, home: Path
             ) -> tuple[JobRecord | None, str | None]:
    """The job ``job`` names (clusterkit id, Slurm id or job dir), or the batch job whose
    dir ``ckpt_dir`` is; and the checkpoint root left once a job dir named the job.
    (None, ckpt_dir): no job named."""
    if is_sbatch_dir(ckpt_dir):
        if job:
            raise CheckpointError("JOB and a job dir as --dir name the job twice", key="--dir",
                                  path=ckpt_dir, hint="pass one of them")
        assert ckpt_dir is not None
        return JobRecord.for_sbatch(ckpt_dir), None  # it named the job, not the root
    if not job:
        return None, ckpt_dir
    if is_sbatch_dir(job):
        return JobRecord.for_sbatch(job), ckpt_dir
    return Registry(home).resolve(job), ckpt_dir


def resolve_nodes(choice: NodeChoice, *, home: Path, inventory: InventorySource
                  ) -> ResolvedNodes:
    """The nodes ``choice`` names: a batch job's Slurm nodes, a launched job's recorded
    nodes, or the inventory's selected hosts."""
    record, root = find_job(choice.job, choice.ckpt_dir, home)
    if record is not None and record.transport == "slurm":
        return batch_job_nodes(record, choice, root, home)
    if record is not None:
        return launched_job_nodes(record, choice, root, home, inventory)
    return inventory_nodes(_load(inventory), choice, root)


def checkpoint_root(pattern: str | None, host: Host | None, name: str, index: int) -> str:
    """A node's checkpoint dir: ``pattern`` (``--dir``, or the job's) with ``{host}`` and
    ``{node}`` expanded, else the inventory's ``checkpoint.local_dir``."""
    value = pattern or (host.checkpoint.local_dir if host else None)
    if not value:
        raise CheckpointError("no checkpoint directory for this node", host=name,
                              key="checkpoint.local_dir",
                              hint="set checkpoint.local_dir in the inventory or pass --dir")
    return value.replace("{host}", name).replace("{node}", str(index))


def inventory_nodes(inventory: Inventory, choice: NodeChoice, root: str | None
                    ) -> ResolvedNodes:
    chosen = select_hosts(inventory, nodes=choice.nodes, gpus_per_node=choice.gpus_per_node,
                          include=choice.include, exclude=choice.exclude)
    nodes = [CollectNode(h.name, target_for(h), h.python or "python3",
                         checkpoint_root(root, h, h.name, i), via=_allocation(choice, h.name))
             for i, (h, _) in enumerate(chosen)]
    return ResolvedNodes(nodes, [len(s) for _, s in chosen], DEFAULT_DEST)


def launched_job_nodes(record: JobRecord, choice: NodeChoice, root: str | None, home: Path,
                       inventory: InventorySource) -> ResolvedNodes:
    """A job `clusterkit launch` started: its recorded nodes, each with its recorded
    checkpoint dir (else ``root``, else the inventory's)."""
    inv: Inventory | None = None
    nodes = []
    for index, n in enumerate(record.nodes):
        pattern = root or record.ckpt.dir_of(n.node)
        host = None
        if not pattern:
            inv = inv or _load(inventory)
            if n.node not in {h.name for h in inv.hosts}:  # not a KeyError (exit 70)
                raise CheckpointError(
                    f"job {record.job_id} ran on {n.node}, which this inventory does not list",
                    host=n.node, path=inv.path, key="-i",
                    hint="pass the inventory the job was launched with (-i FILE), or "
                         "--dir with the checkpoint directory")
            host = inv.host(n.node)
        nodes.append(CollectNode(n.node, n.target, n.python,
                                 checkpoint_root(pattern, host, n.node, index),
                                 via=_allocation(choice, n.node)))
    slots = list(record.ckpt.slots) or [0] * len(nodes)
    if choice.include or choice.exclude:
        nodes, slots = select_job_nodes(nodes, slots, choice.include, choice.exclude)
    elif not record.ckpt.node_local and not root:
        # Shared storage: every node wrote into the one directory, so the whole
        # checkpoint is read from the first node (each file once), all ranks its own.
        nodes, slots = nodes[:1], [sum(slots)]
    return ResolvedNodes(nodes, slots, str(home / "jobs" / record.job_id / "checkpoints"),
                         record)


def select_job_nodes(nodes: Sequence[CollectNode], slots: Sequence[int], include: str,
                     exclude: str) -> tuple[list[CollectNode], list[int]]:
    """--include/--exclude over a job's own nodes (DeepSpeed's rules, by node name). One
    node kept out of several reads the whole checkpoint from it: the way to collect a
    node-local dir that was one shared directory (discover.shared_dir's hint)."""
    pool = {n.name: list(range(s)) for n, s in zip(nodes, slots, strict=True)}
    kept = filter_resources(pool, include, exclude)
    chosen = [(n, s) for n, s in zip(nodes, slots, strict=True) if n.name in kept]
    if len(chosen) == 1 < len(nodes):
        return [chosen[0][0]], [sum(slots)]
    return [n for n, _ in chosen], [s for _, s in chosen]


def batch_job_nodes(record: JobRecord, choice: NodeChoice, root: str | None, home: Path
                    ) -> ResolvedNodes:
    """A `clusterkit sbatch` job: its Slurm nodes, reached through Slurm (default) or,
    with ``via`` ssh/sftp, over SSH by node name."""
    ckpt = record.ckpt
    if not ckpt.node_local and not root:
        raise CheckpointError(
            f"job {record.job_id} saved its checkpoints to shared storage: they are in one "
            "place already, nothing to gather", path=str(ckpt.dir),
            hint="read them there (<dir>/zero_to_fp32.py consolidates), or pass --dir")
    slurm_id = record.slurm_job_id
    job = job_places(SlurmClient(), slurm_id, first_nodes(record), batch_site(record),
                     wait_s=choice.slurm_wait, job_name=f"ck-collect-{record.job_id}")
    pattern = root or str(ckpt.dir)
    python = record.python or "python3"
    over_ssh = choice.via in ("ssh", "sftp")
    nodes = [CollectNode(p.node, SSHTarget(name=p.node, address=p.node), python,
                         checkpoint_root(pattern, None, p.node, i), via=None if over_ssh else p)
             for i, p in enumerate(job.places)]
    how = (f"over {choice.via}" if over_ssh else "through Slurm, "
           + ("a step of the running job on each node" if job.places[0].job_id
              else f"a one-task allocation on each node (waits up to {choice.slurm_wait} s)"))
    places = (f"job {record.job_id} (Slurm job {slurm_id or '?'}, {job.state}): collecting "
              f"{pattern} from {fold(p.node for p in job.places)} {how}")
    slots = list(ckpt.slots)
    slots = slots if len(slots) == len(nodes) else [slots[0] if slots else 0] * len(nodes)
    job_home = record.job_dir or str(home / "jobs" / record.job_id)
    return ResolvedNodes(nodes, slots, os.path.join(job_home, "checkpoints"), record, places)


def batch_site(record: JobRecord) -> tuple[str, ...]:
    """The job script's partition/account/QOS/reservation as the script says now (an
    edit since the submit counts: the fix for a partition that is gone), else as
    recorded at submit."""
    if record.job_dir:
        try:
            return site_args((Path(record.job_dir) / SBATCH_SCRIPT).read_text(encoding="utf-8"))
        except OSError:
            pass
    return tuple(record.slurm_site)


def first_nodes(record: JobRecord) -> str | None:
    """The node list the job's first run wrote (node-local jobs): where the shards are."""
    if not record.job_dir:
        return None
    try:
        return (Path(record.job_dir) / JobDir.SLURM_NODES).read_text(encoding="utf-8").strip() \
            or None
    except OSError:
        return None


def recorded_nodes(prior: JobRecord) -> list[CollectNode]:
    """The job's nodes as recorded, in node-index order (a lost one included: collect
    takes its part from a replica)."""
    by_name = {n.node: n for n in prior.nodes}
    out = []
    for span in prior.ckpt.rank_map or ():
        n = by_name[span.node]
        out.append(CollectNode(n.node, n.target, n.python, str(prior.ckpt.dir_of(n.node))))
    return out


def _allocation(choice: NodeChoice, node: str) -> SlurmPlace | None:
    """``via="slurm"`` on inventory hosts: an allocation on each (host name = Slurm node)."""
    return SlurmPlace(node, wait_s=choice.slurm_wait) if choice.via == "slurm" else None


def _load(inventory: InventorySource) -> Inventory:
    return inventory if isinstance(inventory, Inventory) else inventory()
