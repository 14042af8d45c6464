"""An ssh_config(5) file for pdsh (used by DeepSpeed's runner and our pdsh fan-out).

pdsh connects to the host *names* of the hostfile and cannot take per-host ssh
options; ``PDSH_SSH_ARGS_APPEND="-F <job dir>/ssh_config"`` points ssh at this file,
which maps every name to its inventory address, user, port, key and jump host, and
then includes, for everything else, what ssh would have read without ``-F``:
``~/.ssh/config`` then ``/etc/ssh/ssh_config`` (first value wins), or the
inventory's ``config_file`` alone, which replaces both as ``ssh -F`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

from clusterkit.inventory import Host
from clusterkit.shellsafe import ssh_config_value

CONNECT_TIMEOUT_S = 10


def render_ssh_config(hosts: Sequence[Host]) -> str:
    lines = ["# ssh settings for pdsh, rendered by clusterkit from the inventory"]
    for host in hosts:
        lines.append(f"Host {ssh_config_value(host.name, 'host name')}")
        if host.address != host.name:
            # Only when the inventory says so: a HostName written here would win over the
            # one /etc/ssh/ssh_config.d gives a bare name (first value wins).
            lines.append(f"    HostName {ssh_config_value(host.address, 'address')}")
        # The one options mapping (clusterkit.inventory.ssh_options): paramiko and the
        # OpenSSH tar streams honour exactly these fields too.
        for key, value in host.ssh_options().items():
            lines.append(f"    {key} {ssh_config_value(value, f'ssh.{key}')}")
        lines.append("    BatchMode yes")
        lines.append(f"    ConnectTimeout {CONNECT_TIMEOUT_S}")
    # -F replaces both default files: include them again, in OpenSSH's order.
    defaults = ["~/.ssh/config", "/etc/ssh/ssh_config"]
    explicit = sorted({h.ssh.config_file for h in hosts if h.ssh.config_file})
    configs = explicit + (defaults if any(not h.ssh.config_file for h in hosts) else [])
    lines.append("Host *")
    lines.extend(f"    Include {ssh_config_value(c, 'ssh.config_file')}" for c in configs)
    return "\n".join(lines) + "\n"
