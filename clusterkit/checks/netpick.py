"""doctor's interface pick, kept for the plan (issue 14: "interface choice that matches NCCL's").

``clusterkit doctor`` finds, per node, the interface that reaches every peer and
saves it in ``<clusterkit home>/doctor/<cluster>.ifaces.json``. ``launch``,
``render`` and ``sbatch`` read it into the plan's facts (``LaunchFacts.doctor_ifaces``)
and the plan gives each node exactly that interface (plan/ifaces.py), where the
inventory and the launching shell set neither. Without it NCCL takes ``ib*`` first,
then every interface but ``docker*``/``lo`` in kernel order, bridges included
(docs/doctor.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.rules import peer_iface
from clusterkit.fsutil import atomic_write_text

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


def saved_picks(home: Path, cluster: str) -> dict[str, str]:
    """What launch/render/sbatch plan with (``LaunchFacts.doctor_ifaces``): the picks
    the last doctor runs on this cluster saved; plan/ifaces.py applies them."""
    return load_picks(picks_path(home, cluster))
