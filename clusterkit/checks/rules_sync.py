"""Doctor's synced-directory parity (issue 29): does every node hold what ``clusterkit sync
DIR`` put there, byte for byte, and the same version as this machine?

``doctor --sync DIR``: each node's ``DIR`` is checked against the manifest the sync wrote
there (node/dist_store.check: files whose size or mtime moved are hashed again; a file
that differs is named), and the manifest's digest against the digest of DIR here
(:func:`add_sync_parity`). The rule :func:`check_sync` is pure: states in, findings out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from clusterkit.checks.findings import Finding, Status

if TYPE_CHECKING:
    from clusterkit.checks.doctor import DoctorReport
    from clusterkit.remote.base import Transport
    from clusterkit.remote.distribute import DistNode
    from clusterkit.remote.sync import Ignore

CHECK = "sync.parity"
SHOWN = 3  # files named per node


def check_sync(states: Mapping[str, Mapping[str, Any]], label: str, digest: str,
               hosts: Sequence[str]) -> list[Finding]:
    """``states``: host -> node/dist_store.check's answer; ``digest``: DIR's here."""
    fix = f"clusterkit sync {label} (sends only what differs)"
    out = []
    for host in (h for h in hosts if h in states):
        st = states[host]
        state, differ = st.get("state"), list(st.get("differ") or [])
        if state == "differs":
            names = ", ".join(differ[:SHOWN]) + (f" (+{len(differ) - SHOWN} more)"
                                                 if len(differ) > SHOWN else "")
            out.append(Finding(CHECK, Status.FAIL, host, f"{label}: {len(differ)} file(s) "
                               f"differ from what sync put there: {names}", fix))
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
            out.append(Finding(CHECK, Status.PASS, host, f"{label}: {st.get('files')} file(s), "
                               f"digest {digest[:12]} equal to here"))
    return out


def add_sync_parity(report: DoctorReport, transport: Transport, nodes: Sequence[DistNode],
                    src: str, ignore: Ignore, *, cache_dir: str | None = None,
                    deep: bool = False) -> DoctorReport:
    """``report`` plus one sync.parity finding per node for ``src`` (synced to each
    node's ``dest``)."""
    from clusterkit.node.dist_store import entries_digest
    from clusterkit.remote.distribute import read_manifests
    from clusterkit.remote.sync import scan, source_entries

    entries, _ = source_entries(scan(src, ignore).files, cache_dir, src)
    digest = entries_digest(entries)
    states = read_manifests(transport, nodes, digest=digest, deep=deep)
    found = check_sync(states, src, digest, [n.name for n in nodes])
    return replace(report, findings=(*report.findings, *found))
