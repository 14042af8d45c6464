"""A doctor run from this machine: ``clusterkit doctor`` and ``clusterkit.api.doctor``.

The checks themselves are ``checks/`` (one SSH session per node, the master port in
the same round; docs/doctor.md). Here: which nodes, the port and the replica count
as ``clusterkit launch`` would take them, the optional bandwidth round, and keeping
each node's peer interface for the next launch/render/sbatch (checks/netpick.py).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clusterkit.checks.bandwidth import add_bandwidth
from clusterkit.checks.doctor import DoctorReport, fanout_transport, run_doctor
from clusterkit.checks.doctor_plan import plan_doctor
from clusterkit.checks.netpick import picks_path, remember_picks
from clusterkit.errors import ClusterkitError
from clusterkit.hostfile import select_hosts
from clusterkit.inventory import Host, Inventory, replicas_problem
from clusterkit.jobs.here import clusterkit_home
from clusterkit.launchers import BACKENDS, DEFAULT_LAUNCHER
from clusterkit.remote.base import DEFAULT_CONNECT_TIMEOUT_S, Transport
from clusterkit.remote.dispatch import transport_for
from clusterkit.spec.ports import master_port as job_master_port

HEAD_TOOLS = ("pdsh", "ninja", "ssh")
# A check of the caller's run on the same connections, after the doctor's own round
# (``doctor --sync DIR``: the sync parity, jobs/sync.py): the report, the transport and
# the selected hosts in, the report with its findings added out.
ExtraCheck = Callable[[DoctorReport, Transport, Sequence[Host]], DoctorReport]


@dataclass(frozen=True)
class DoctorResult:
    """The report, and the peer interfaces this run kept for the next launch/render/sbatch
    (node -> interface, merged with earlier runs' picks; empty when none was clear or the
    file could not be written) in ``ifaces_file``."""

    report: DoctorReport
    ifaces: dict[str, str] = field(default_factory=dict)
    ifaces_file: Path | None = None


def doctor_master_port(master_port: int | None, job_id: str | None, cluster: str) -> int | None:
    """The port to test: ``master_port`` (0: none), else the one launch derives from the
    job id, else from the inventory name."""
    if master_port is not None:
        return master_port or None
    return job_master_port(job_id or cluster)


def doctor_replicas(replicas: int | None, hosts: Sequence[Host]) -> int:
    """K as launch would take it: ``replicas``, the inventory's, else 1 when storage
    would be node-local (storage auto: not every host has checkpoint.shared_dir)."""
    if replicas is not None:
        if why := replicas_problem(replicas):
            raise ClusterkitError(why, key="--replicas")
        return int(replicas)
    if hosts and hosts[0].checkpoint.replicas is not None:
        return hosts[0].checkpoint.replicas
    return 1 if len(hosts) > 1 and not all(h.checkpoint.shared_dir for h in hosts) else 0


def spare_hosts(inventory: Inventory, selected: Sequence[Host]) -> list[Host]:
    """The inventory's spares outside the selection: doctor checks them with the job's
    nodes, since ``launch --replace`` runs a lost node's ranks there (docs/doctor.md)."""
    chosen = {h.name for h in selected}
    return [inventory.host(name) for name in inventory.spares if name not in chosen]


def run_checks(inventory: Inventory, *, nodes: int | None = None,
               gpus_per_node: int | None = None, include: str = "", exclude: str = "",
               launcher: str = DEFAULT_LAUNCHER, job_id: str | None = None,
               master_port: int | None = None, ckpt_bytes: int | None = None,
               replicas: int | None = None, storage: str | None = None,
               bandwidth_bytes: int | None = None,
               connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
               accept_new_host_keys: bool = False,
               extra: Sequence[ExtraCheck] = ()) -> DoctorResult:
    """Every check on every selected node, in parallel; ``bandwidth_bytes``: also the
    all_reduce and pairwise round with messages of that size."""
    if launcher not in BACKENDS:
        raise ClusterkitError(f"unknown launcher {launcher!r}", key="--launcher",
                              hint=f"one of {', '.join(BACKENDS)}")
    selected = [h for h, _slots in select_hosts(inventory, nodes=nodes,
                                                gpus_per_node=gpus_per_node,
                                                include=include, exclude=exclude)]
    spares = spare_hosts(inventory, selected)
    hosts = selected + spares  # after the selection: its first node stays the master
    plan = plan_doctor(
        hosts, head_python=sys.executable, head_cwd=os.getcwd(),
        head_tools={t: shutil.which(t) for t in HEAD_TOOLS},
        backend=launcher, master_port=doctor_master_port(master_port, job_id, inventory.name),
        checkpoint_bytes=ckpt_bytes or None, replicas=doctor_replicas(replicas, selected),
        storage=storage, connect_timeout_s=connect_timeout_s,
        accept_new_host_keys=accept_new_host_keys, spares=[h.name for h in spares],
    )
    with transport_for(connect_timeout=connect_timeout_s) as transport:
        fast, client = fanout_transport(plan, transport)
        report = run_doctor(plan, fast, ssh_client=client)
        for check in extra:
            report = check(report, transport, hosts)
        if bandwidth_bytes is not None:
            report = add_bandwidth(report, transport, nbytes=bandwidth_bytes)
    home = clusterkit_home()
    ifaces = remember_picks(home, inventory.name, report.facts)
    return DoctorResult(report, ifaces, picks_path(home, inventory.name))

