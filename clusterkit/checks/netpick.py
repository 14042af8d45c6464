"""doctor's interface pick, kept for the plan (issue 14: "interface choice that matches NCCL's").

``clusterkit doctor`` finds, per node, the interface that reaches every peer and
saves it in ``<clusterkit home>/doctor/<cluster>.ifaces.json``. ``launch``,
``render`` and ``sbatch`` then give each node exactly that interface:
``NCCL_SOCKET_IFNAME==<iface>`` (the ``=`` makes NCCL match the name exactly, not as
a prefix) and ``GLOO_SOCKET_IFNAME=<iface>``, unless the inventory or the launching
shell already sets them. Without it NCCL takes ``ib*`` first, then every interface
but ``docker*``/``lo`` in kernel order, bridges included (docs/doctor.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.rules import peer_iface
from clusterkit.fsutil import atomic_write_text
from clusterkit.inventory import Inventory

KEYS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")  # what the kernel allows in a name


def picks_path(home: Path, cluster: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", cluster) or "cluster"
    return home / "doctor" / f"{safe}.ifaces.json"


def picks_from_facts(facts: Mapping[str, NodeFacts]) -> dict[str, str]:
    """host -> the interface that reaches every peer, for the nodes where it is clear."""
    return {h: i for h, f in facts.items() if f.ok and (i := peer_iface(f))}


def save_picks(path: Path, cluster: str, picks: Mapping[str, str]) -> None:
    atomic_write_text(path, json.dumps({"cluster": cluster, "ifaces": dict(picks)},
                                       indent=2, sort_keys=True) + "\n")


def load_picks(path: Path) -> dict[str, str]:
    """The saved picks; nothing when the file is missing or not ours (never an error:
    a launch without doctor's pick renders what it always did)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    ifaces = data.get("ifaces") if isinstance(data, dict) else None
    if not isinstance(ifaces, dict):
        return {}
    return {str(h): i for h, i in ifaces.items() if isinstance(i, str) and _IFNAME.fullmatch(i)}


def cluster_env(picks: Mapping[str, str]) -> dict[str, str]:
    """One setting for the whole cluster (launchers such as DeepSpeed's run one command
    everywhere): the one name, or NCCL's exact list and no gloo name when they differ."""
    names = sorted(set(picks.values()))
    if not names:
        return {}
    env = {"NCCL_SOCKET_IFNAME": "=" + ",".join(names)}
    if len(names) == 1:
        env["GLOO_SOCKET_IFNAME"] = names[0]
    return env


def apply_picks(inventory: Inventory, picks: Mapping[str, str],
                environ: Mapping[str, str]) -> Inventory:
    """The inventory with every host's env given doctor's exact interface names.

    The inventory's own env and the launching shell's (which the env allowlist
    passes on) win: a user who set NCCL_SOCKET_IFNAME keeps it.
    """
    env = cluster_env({h: i for h, i in picks.items() if h in inventory.names()})
    hosts = []
    for host in inventory.hosts:
        add = {k: v for k, v in env.items() if k not in host.env and k not in environ}
        hosts.append(replace(host, env={**host.env, **add}) if add else host)
    return replace(inventory, hosts=tuple(hosts))


def remember_picks(home: Path, cluster: str, facts: Mapping[str, NodeFacts]) -> dict[str, str]:
    """After a doctor run: merge this run's picks into the saved ones (a run on some
    nodes keeps the others'). A file that cannot be written costs the plan its
    hint, never the doctor run."""
    path = picks_path(home, cluster)
    picks = {**load_picks(path), **picks_from_facts(facts)}
    try:
        save_picks(path, cluster, picks)
    except OSError:
        return {}
    return picks


def inventory_with_picks(inventory: Inventory, home: Path,
                         environ: Mapping[str, str]) -> Inventory:
    """What launch/render/sbatch plan from: the inventory plus doctor's saved pick."""
    return apply_picks(inventory, load_picks(picks_path(home, inventory.name)), environ)
