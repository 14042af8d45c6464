"""doctor's interface pick applied to a job (issue 14: "interface choice that matches NCCL's").

``clusterkit doctor`` saves, per node, the interface that reaches every peer
(``checks/netpick.py``); the verbs that plan a job read it into
``LaunchFacts.doctor_ifaces``, and the plan gives each node exactly that interface:
``NCCL_SOCKET_IFNAME==<iface>`` (the ``=`` makes NCCL match the name exactly, not as
a prefix) and ``GLOO_SOCKET_IFNAME=<iface>``, unless the inventory or the launching
shell already sets them. What it added, per node, is ``JobPlan.doctor_ifaces``, shown in
plan.json and the dry run's summary, so the pick never changes a plan unseen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from clusterkit.inventory import Inventory

KEYS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


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


def added_env(before: Inventory, after: Inventory) -> dict[str, dict[str, str]]:
    """host -> the settings ``apply_picks`` added to its env (hosts it left alone: absent)."""
    old = {h.name: h.env for h in before.hosts}
    out: dict[str, dict[str, str]] = {}
    for host in after.hosts:
        add = {k: v for k, v in host.env.items() if k not in old.get(host.name, {})}
        if add:
            out[host.name] = add
    return out
