"""Node preparation for a set of hosts: what ``clusterkit nodes install|env|build-ops``
and the API's ``install_nodes``, ``copy_env`` and ``build_ops`` run.

The hosts come chosen (the inventory's selection words, applied by the caller); each
function opens the transport, runs the provisioning step on every node in parallel and
returns per-node results: a node that failed is a result, never an exception, so the
caller says which nodes did and which did not. Bad input (a wheel that is no wheel, an
environment that cannot travel) raises before any node is asked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterkit.inventory import Host
from clusterkit.jobs.here import clusterkit_home
from clusterkit.provision.envcopy import (
    EnvNode,
    EnvSource,
    NodeEnv,
    describe_local,
    distribute_transfer,
    replicate,
)
from clusterkit.provision.install import Installed, InstallNode, check_wheel, install_all
from clusterkit.provision.jitbuild import OpsNode, build_all
from clusterkit.remote.base import GroupResult, target_for
from clusterkit.remote.dispatch import transport_for
from clusterkit.remote.openssh import with_openssh


@dataclass(frozen=True)
class InstallResult:
    """Per node: what installing did (``Installed``); ``group`` the per-node outcomes."""

    nodes: dict[str, Installed]
    group: GroupResult


@dataclass(frozen=True)
class BuildOpsResult:
    """Per node: the build program's answer; ``failed`` node -> the reason."""

    nodes: dict[str, dict[str, Any]]
    failed: dict[str, str]


def install_hosts(hosts: Sequence[Host], wheel: Path | None = None, *,
                  announce: Callable[[int], None] | None = None) -> InstallResult:
    """This clusterkit (a wheel built here, offline, or ``wheel``) on every host.
    ``announce`` hears the number of nodes once the wheel passed its check."""
    if wheel is not None:
        check_wheel(wheel)  # before any node is asked
    nodes = [InstallNode(h.name, target_for(h), h.python or sys.executable) for h in hosts]
    if announce is not None:
        announce(len(nodes))
    with transport_for() as transport:
        results, group = install_all(transport, nodes, wheel)
    return InstallResult(results, group)


def copy_env_hosts(hosts: Sequence[Host], *, python: str | None = None,
                   node_python: str = "python3",
                   announce: Callable[[EnvSource, int], None] | None = None,
                   on_progress: Callable[[Any], None] | None = None) -> dict[str, NodeEnv]:
    """This machine's Python environment (``python``'s, default this interpreter's) onto
    every host at the same path, through the sync engine (``node_python``: a Python each
    node has now, to run the node side). ``announce`` hears what
    travels before anything does; ``on_progress`` the engine's progress."""
    source = describe_local(python)  # an editable tree that cannot travel: refused here
    nodes = [EnvNode(h.name, target_for(h), node_python, h.address, dict(h.env)) for h in hosts]
    if announce is not None:
        announce(source, len(nodes))
    cache = str(clusterkit_home() / "sync-cache")
    with transport_for() as transport:
        return replicate(with_openssh(transport), nodes, source, transfer=lambda t, ns, part:
                         distribute_transfer(t, ns, part, cache_dir=cache,
                                             on_progress=on_progress))


def build_ops_hosts(hosts: Sequence[Host], request: Mapping[str, Any]) -> BuildOpsResult:
    """DeepSpeed's JIT ops (``request``: ``ops``, ``ds_config``, ``remove_stale``) built on
    every host, each with its own interpreter and environment."""
    nodes = [OpsNode(h.name, target_for(h), h.python or sys.executable, dict(h.env))
             for h in hosts]
    with transport_for() as transport:
        results, failed = build_all(transport, nodes, request)
    return BuildOpsResult(results, failed)
