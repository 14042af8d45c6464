"""An ssh_config(5) file for pdsh (used by DeepSpeed's runner and our pdsh fan-out).

pdsh connects to the host *names* of the hostfile and cannot take per-host ssh
options; ``PDSH_SSH_ARGS_APPEND="-F <job dir>/ssh_config"`` points ssh at this file,
which maps every name to its inventory address, user, port, key and jump host, and
then includes the user's own configuration for everything else (first value wins).
"""

from __future__ import annotations

from collections.abc import Sequence

from clusterkit.inventory import Host
from clusterkit.render.shellsafe import ssh_config_value

CONNECT_TIMEOUT_S = 10


def render_ssh_config(hosts: Sequence[Host]) -> str:
    lines = ["# ssh settings for pdsh, rendered by clusterkit from the inventory"]
    for host in hosts:
        lines.append(f"Host {ssh_config_value(host.name, 'host name')}")
        lines.append(f"    HostName {ssh_config_value(host.address, 'address')}")
        ssh = host.ssh
        for key, value in (("User", ssh.user), ("Port", None if ssh.port is None else str(ssh.port)),
                           ("IdentityFile", ssh.identity_file), ("ProxyJump", ssh.proxy_jump),
                           ("UserKnownHostsFile", ssh.known_hosts_file)):
            if value is not None:
                lines.append(f"    {key} {ssh_config_value(value, f'ssh.{key}')}")
        lines.append("    BatchMode yes")
        lines.append(f"    ConnectTimeout {CONNECT_TIMEOUT_S}")
    configs = sorted({h.ssh.config_file or "~/.ssh/config" for h in hosts})
    lines.append("Host *")
    lines.extend(f"    Include {ssh_config_value(c, 'ssh.config_file')}" for c in configs)
    return "\n".join(lines) + "\n"
