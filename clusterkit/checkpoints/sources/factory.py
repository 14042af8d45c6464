"""The source factory: the data path ``--via`` names, opened for a set of nodes.

collect-ckpt (:mod:`clusterkit.checkpoints.collect.verb`), ``status``'s replica health
(:mod:`clusterkit.checkpoints.replicas.health`) and recovery all read nodes' checkpoint
files through the :class:`~clusterkit.checkpoints.sources.base.Source` this returns.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

from clusterkit.checkpoints.sources.base import CollectNode, Source
from clusterkit.checkpoints.sources.sftp import SftpSource
from clusterkit.checkpoints.sources.stream import StreamSource
from clusterkit.checkpoints.sources.transfer import have_ssh_binary
from clusterkit.errors import CheckpointError
from clusterkit.remote.base import Transport


def resolve_method(method: str, nodes: Sequence[CollectNode] = ()) -> str:
    """``auto`` -> ``slurm`` when every node has its Slurm place, else ``ssh`` where the
    OpenSSH binary exists, else ``sftp``; an explicit method is checked, not changed."""
    if method == "slurm" and not all(n.via is not None for n in nodes):
        raise CheckpointError("--via slurm needs every node's Slurm place", key="--via",
                              hint="collect a Slurm job (JOB or its job dir), or drop --via slurm")
    if method == "auto" and nodes and all(n.via is not None for n in nodes):
        return "slurm"
    if method == "auto":
        return "ssh" if have_ssh_binary() else "sftp"
    if method == "ssh" and not have_ssh_binary():
        raise CheckpointError("--via ssh needs the OpenSSH 'ssh' program on PATH",
                              hint="install openssh-client, or use --via sftp")
    return method


def open_source(transport: Transport, nodes: Sequence[CollectNode], *, dest: str,
                method: str = "auto", jobs: int = 8, fsync: bool = True,
                on_start: Callable[[subprocess.Popen[bytes]], None] | None = None) -> Source:
    """The data path ``method`` names, copying into ``dest`` with ``jobs`` nodes at once."""
    method = resolve_method(method, nodes)
    if method == "sftp":
        return SftpSource(transport, nodes, dest=dest, jobs=jobs, fsync=fsync)
    return StreamSource(method, transport, nodes, dest=dest, jobs=jobs, fsync=fsync,
                        on_start=on_start)
