"""doctor's interface pick, kept for the plan (issue 14: "interface choice that matches NCCL's").

``clusterkit doctor`` finds, per node, the interface that reaches every peer and
saves it in ``<clusterkit home>/doctor/<cluster>.ifaces.json``. ``launch``,
``render`` and ``sbatch`` read it into the plan's facts (``LaunchFacts.doctor_ifaces``)
and the plan gives each node exactly that interface (plan/ifaces.py), where the
inventory and the launching shell set neither. Without it NCCL takes ``ib*`` first,
then every interface but ``docker*``/``lo`` in kernel order, bridges included
(docs/doctor.md).

The picker's other half is here too: what NCCL and gloo would pick on their own
(``nccl_pick``/``gloo_pick``, NCCL's own search order) and the findings that say
where that is not the interface that reaches the peers (``rules_nccl`` uses them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.rules_base import is_loopback
from clusterkit.fsutil import atomic_write_text

_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")  # what the kernel allows in a name


def ifname_selected(spec: str, ifname: str) -> bool:
    """NCCL_SOCKET_IFNAME semantics: prefix list; ``=`` exact; ``^`` excludes."""
    text = spec.strip()
    exclude = text.startswith("^")
    text = text.removeprefix("^")
    exact = text.startswith("=")
    text = text.removeprefix("=")
    items = [p for p in text.split(",") if p]
    hit = any(ifname == p if exact else ifname.startswith(p) for p in items)
    return not hit if exclude else hit


def route_ifaces(f: NodeFacts) -> dict[str, str | None]:
    own = {a for addrs in f.interfaces.values() for a in addrs}
    return {a: i for a, i in f.routes.items() if a not in own and not is_loopback(a)}


# NCCL's own search without NCCL_SOCKET_IFNAME (ncclFindInterfaces), first hit wins:
# ib*, then every interface but docker*/lo, then docker*, then lo. Bridges (br-*,
# virbr*, cni*) are NOT skipped. The bootstrap takes the first match; the socket
# transport takes every match. Interfaces in kernel order (what `ip addr` lists).
NCCL_AUTO_SEARCH = ("ib", "^docker,lo", "docker", "lo")


def nccl_pick(f: NodeFacts) -> list[str]:
    """The interfaces NCCL would use on this node, its bootstrap's first."""
    names = [i for i, addrs in f.interfaces.items() if addrs]
    spec = f.env.get("NCCL_SOCKET_IFNAME")
    for rule in (spec,) if spec else NCCL_AUTO_SEARCH:
        hits = [i for i in names if ifname_selected(rule, i)]
        if hits:
            return hits
    return []


def gloo_pick(f: NodeFacts) -> tuple[str | None, str | None]:
    """(interface, address) gloo binds: GLOO_SOCKET_IFNAME, else its hostname's address."""
    spec = f.env.get("GLOO_SOCKET_IFNAME")
    if spec:
        name = spec.split(",")[0]
        return name, next(iter(f.interfaces.get(name, ())), None)
    addrs = f.forward.get(f.self_name or f.hostname or f.host)
    if isinstance(addrs, str) or not addrs:
        return None, None
    for ifname, own in f.interfaces.items():
        if addrs[0] in own:
            return ifname, addrs[0]
    return None, addrs[0]


def nccl_prediction(f: NodeFacts, iface: str) -> list[Finding]:
    picks = nccl_pick(f)
    if f.env.get("NCCL_SOCKET_IFNAME") is not None or picks == [iface]:
        return []
    order = ", ".join(picks) or "none"
    if not picks or picks[0] != iface:
        detail = (f"NCCL_SOCKET_IFNAME unset: NCCL would pick {picks[0] if picks else 'nothing'}"
                  f" (its order: ib*, then every interface but docker*/lo as the kernel lists "
                  f"them: {order}), but {iface} is the interface that reaches every peer")
    else:
        detail = (f"NCCL_SOCKET_IFNAME unset: NCCL's socket transport would also use "
                  f"{', '.join(picks[1:])} besides {iface} (it takes every interface but "
                  f"docker*/lo)")
    return [Finding("net.ifname", Status.WARN, f.host, detail,
                    f"set NCCL_SOCKET_IFNAME=={iface} and GLOO_SOCKET_IFNAME={iface} "
                    "in the inventory env")]


def gloo_prediction(f: NodeFacts, iface: str) -> list[Finding]:
    if f.env.get("GLOO_SOCKET_IFNAME") is not None:
        return []
    ifname, addr = gloo_pick(f)
    if ifname == iface or addr is None or is_loopback(addr):
        return []  # unresolvable or loopback names: names.self already FAILs
    return [Finding("net.ifname", Status.WARN, f.host,
                    f"GLOO_SOCKET_IFNAME unset: gloo would bind {addr} "
                    f"({ifname or 'no local interface'}), the address of its hostname, but "
                    f"{iface} is the interface that reaches every peer",
                    f"set GLOO_SOCKET_IFNAME={iface} in the inventory env")]


def peer_iface(f: NodeFacts) -> str | None:
    """The one interface this node's routes to every peer use (None: none or several)."""
    used = {i for i in route_ifaces(f).values()}
    return used.pop() if len(used) == 1 and None not in used else None


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
