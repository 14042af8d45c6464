"""Doctor's synced-directory parity (issue 29): does every node hold what ``clusterkit sync
DIR`` put there, byte for byte, and the same version as this machine?

``doctor --sync DIR``: each node's ``DIR`` is checked against the manifest the sync wrote
there (node/sync/store.check: files whose size or mtime moved are hashed again; a file
that differs is named), and the manifest's digest against the digest of DIR here
(:func:`add_sync_parity`); and whether each hop of the sync chain can connect on its
port (this machine to the first node, each node to the next). The rules
:func:`check_sync` and :func:`check_ports` are pure: states in, findings out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from clusterkit.checks.findings import Finding, Status

if TYPE_CHECKING:
    from clusterkit.checks.doctor import DoctorReport
    from clusterkit.remote.base import Transport
    from clusterkit.sync.engine import SyncNode
    from clusterkit.sync.source import Ignore

CHECK = "sync.parity"
PORTS_CHECK = "sync.ports"
SHOWN = 3  # files named per node


def check_sync(states: Mapping[str, Mapping[str, Any]], label: str, digest: str,
               hosts: Sequence[str]) -> list[Finding]:
    """``states``: host -> node/sync/store.check's answer; ``digest``: DIR's here."""
    fix = f"clusterkit sync {label} (sends only what differs)"
    out = []
    for host in (h for h in hosts if h in states):
        st = states[host]
        state, differ = st.get("state"), list(st.get("differ") or [])
        if state == "differs":
            names = ", ".join(differ[:SHOWN]) + (f" (+{len(differ) - SHOWN} more)"
                                                 if len(differ) > SHOWN else "")
            n_links = int(st.get("links_differ") or 0)
            what = " and ".join(w for w in (
                f"{len(differ) - n_links} file(s)" if len(differ) > n_links else "",
                f"{n_links} link(s)" if n_links else "") if w)
            out.append(Finding(CHECK, Status.FAIL, host, f"{label}: {what} differ from what "
                               f"sync put there: {names}", fix))
        elif state in ("absent", "no-manifest"):
            what = "absent" if state == "absent" else "not filled by clusterkit sync"
            out.append(Finding(CHECK, Status.FAIL, host, f"{label}: {what}", fix))
        elif state == "unreachable":
            out.append(Finding(CHECK, Status.WARN, host, f"{label}: not checked "
                               f"({st.get('why', 'no answer')})", "check the node by hand"))
        elif st.get("digest") != digest:
            out.append(Finding(CHECK, Status.FAIL, host, f"{label}: another version (digest "
                               f"{str(st.get('digest'))[:12]}, here {digest[:12]})", fix))
        else:
            links = f"{st.get('links')} link(s), " if st.get("links") else ""
            out.append(Finding(CHECK, Status.PASS, host, f"{label}: {st.get('files')} file(s), "
                               f"{links}digest {digest[:12]} equal to here"))
    return out


def add_sync_parity(report: DoctorReport, transport: Transport, nodes: Sequence[SyncNode],
                    src: str, ignore: Ignore, *, cache_dir: str | None = None,
                    deep: bool = False, port: int = 0) -> DoctorReport:
    """``report`` plus one sync.parity finding per node for ``src`` (synced to each
    node's ``dest``) and the sync.ports findings (``port``: 0, the default port)."""
    from clusterkit.sync.check import probe_ports, read_manifests
    from clusterkit.sync.engine import DEFAULT_PORT
    from clusterkit.sync.source import source_digest

    digest = source_digest(src, ignore, cache_dir)
    states = read_manifests(transport, nodes, digest=digest, deep=deep)
    found = check_sync(states, src, digest, [n.name for n in nodes])
    first = port or DEFAULT_PORT
    found += check_ports(probe_ports(transport, nodes, first), first)
    return replace(report, findings=(*report.findings, *found))


def check_ports(hops: Mapping[str, str], port: int) -> list[Finding]:
    """``hops``: ``"A -> B"`` -> why it did not connect ("" when it did). A blocked hop is
    a WARN: sync still works, sending from here to the node after it (one more copy)."""
    blocked = {hop: why for hop, why in hops.items() if why}
    if not hops:
        return []
    if not blocked:
        return [Finding(PORTS_CHECK, Status.PASS, "", f"every hop of the sync chain connects "
                        f"on port {port}+ ({len(hops)} hop(s))")]
    from clusterkit.sync.plan import SSH_COST

    fix = (f"open TCP {port}-{port + 15} between the nodes (and from here), or pick open ones "
           "with clusterkit sync --port P")
    copies = len([h for h in blocked if not h.startswith("here ")]) + 1
    return [Finding(PORTS_CHECK, Status.WARN, hop.split(" -> ")[1], f"{hop} blocked ({why}): "
                    f"clusterkit sync feeds {hop.split(' -> ')[1]} over its SSH session instead "
                    f"({SSH_COST})", fix) if hop.startswith("here ") else
            Finding(PORTS_CHECK, Status.WARN, hop.split(" -> ")[0], f"{hop} blocked ({why}): "
                    "clusterkit sync sends from here to the node after it, one more copy "
                    f"through this machine's link ({copies}x size/rate in all)", fix)
            for hop, why in blocked.items()]
