"""Doctor rules: can the probe reach each node, and can the nodes reach the master's port."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.rules_base import (
    DoctorContext,
)

# ----------------------------------------------------------------------------- reachability


# What to do for each way the probe can fail to answer (TransportError kinds, docs/ssh.md).
_PROBE_FIXES = {
    "refused": "start sshd on the node (`systemctl start ssh`) or fix the port in the inventory",
    "timeout": "the node is down, firewalled or the address is wrong: check `ping` and the "
               "inventory address",
    "resolve": "fix the inventory address (or HostName in the ssh config), /etc/hosts or DNS",
    "auth": "put your public key in ~/.ssh/authorized_keys on the node, or set identity_file",
    "hostkey-unknown": "verify the fingerprint, then `ssh` to the node once or rerun with "
                       "--accept-new-host-keys",
    "hostkey-changed": "the node was reinstalled or this is a man-in-the-middle: after "
                       "verifying, `ssh-keygen -R <address>` and connect once",
    "command-timeout": "the probe did not finish: a login shell blocked in ~/.bashrc (e.g. "
                       "a `pyenv init` lock), a stuck nvidia-smi or NFS mount; time "
                       "`ssh <host> true` and run the probe by hand",
    "interpreter": "the inventory's python does not exist on this node: install it at that path "
                   "or set `python:` for this host",
    "probe": "copy clusterkit/node/facts/probe.py to the node and run `<python> probe.py facts` there "
             "to see the error",
}


def check_probe(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in facts.values():
        if not f.ok:
            kind = f.error_kind
            fix = _PROBE_FIXES.get(kind or "") or f.error_hint or (
                "check `ssh -o BatchMode=yes <host> true` and that the inventory's python "
                "exists on the node")
            detail = (f"unreachable ({kind}): {f.probe_error}" if kind
                      else f"no answer from the probe: {f.probe_error}")
            out.append(Finding("ssh", Status.FAIL, f.host, detail, fix))
            continue
        out.append(Finding("ssh", Status.PASS, f.host, "probe answered"))
        for section, err in sorted({**f.section_errors, **f.parse_errors}.items()):
            out.append(Finding(f"probe.{section}", Status.WARN, f.host,
                               f"could not read {section}: {err}", None))
        if f.heavy_modules:
            out.append(Finding("probe.imports", Status.WARN, f.host,
                               f"probe imported {', '.join(f.heavy_modules)} (slow)", None))
    return out


# ----------------------------------------------------------------------------- ports (two-phase)


def check_master_port(master: str, port: int, listen: Mapping[str, Any] | None,
                      connects: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    """Phase 1: ``listen`` result on the master; phase 2: each node's ``connect`` result."""
    check = f"port:{port}"
    if listen is None or not listen.get("bound"):
        err = (listen or {}).get("error", "listener did not start")
        return [Finding(check, Status.FAIL, master, f"cannot listen on {port}: {err}",
                        f"pick another --master-port, or find the owner: "
                        f"`ss -ltnp 'sport = :{port}'`")]
    out = [Finding(check, Status.PASS, master, f"port {port} free on the master")]
    fixes = {
        "refused": "nothing listened where the name points: check the master's name/address",
        "timeout": f"a firewall drops the traffic: open TCP {port} (and the NCCL/gloo ports) "
                   "between nodes",
        "resolve": "the master's name does not resolve here: add it to /etc/hosts",
        "unreachable": "no route to the master: check addresses/subnets",
    }
    for host, res in connects.items():
        if res.get("ok"):
            out.append(Finding(check, Status.PASS, host, f"reaches {master}:{port}"))
        else:
            kind = str(res.get("error_kind") or "unreachable")
            out.append(Finding(check, Status.FAIL, host,
                               f"cannot reach {master}:{port} ({kind}: {res.get('error')})",
                               fixes.get(kind, fixes["unreachable"])))
    return out
