"""Text of the files a test bed writes: keys, sshd/ssh configs, hosts, known_hosts.

Pure functions (values in, text out) so the layout is easy to read and review.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


@dataclass(frozen=True)
class KeyPair:
    private_openssh: str
    public_openssh: str  # "ssh-ed25519 AAAA..."


@dataclass(frozen=True)
class HostEntry:
    name: str
    address: str
    host_public_key: str


def new_ed25519(comment: str) -> KeyPair:
    """An OpenSSH ed25519 key pair, generated in-process (no ssh-keygen fork per node)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode()
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()
    return KeyPair(private, f"{public} {comment}")


def sshd_config(host_key: Path, authorized_keys: Path, users_own_keys: bool = False) -> str:
    """``users_own_keys``: also each user's ``~/.ssh/authorized_keys`` (a bed with a user)."""
    keys = f"{authorized_keys} .ssh/authorized_keys" if users_own_keys else str(authorized_keys)
    return "\n".join([
        "# clusterkit test bed node sshd (runs as `sshd -D -e -f` this file)",
        "Port 22",
        "ListenAddress 0.0.0.0",
        f"HostKey {host_key}",
        "PidFile /run/sshd.pid",  # /run is the node's private tmpfs
        f"AuthorizedKeysFile {keys}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        "StrictModes no",
        "UseDNS no",
        "PrintMotd no",
        "PrintLastLog no",
        # pdsh/doctor fan-out may open many connections to one node at once;
        # the default 10:30:100 randomly drops some of them.
        "MaxStartups 256:30:512",
        "MaxSessions 256",
        "Subsystem sftp internal-sftp",
        "",
    ])


def host_ssh_config(
    root: Path, hosts: Sequence[HostEntry], name_glob: str, subnet_glob: str,
    ssh_dir: Path | None = None, user: str = "root",
) -> str:
    """``<root>/ssh/config`` for the host: node names map to bridge addresses (``ssh_dir``
    and ``user``: the same for the bed's unprivileged user, tests/testbed/users.py)."""
    lines = ["# clusterkit test bed: use with `ssh -F <this file> node1`", ""]
    for h in hosts:
        lines += [f"Host {h.name}", f"  HostName {h.address}", ""]
    lines += [f"Host {name_glob} {subnet_glob}",
              *_common_client_options(ssh_dir or root / "ssh", user), ""]
    return "\n".join(lines)


def node_ssh_config(user: str = "root") -> str:
    """``~/.ssh/config`` inside nodes: names resolve through the node's /etc/hosts."""
    return "\n".join(["# clusterkit test bed (inside nodes)", "Host *",
                      *_common_client_options(Path("~/.ssh"), user), ""])


def _common_client_options(ssh_dir: Path, user: str = "root") -> list[str]:
    return [
        f"  User {user}",
        "  Port 22",
        f"  IdentityFile {ssh_dir}/id_ed25519",
        "  IdentitiesOnly yes",
        f"  UserKnownHostsFile {ssh_dir}/known_hosts",
        "  GlobalKnownHostsFile /dev/null",
        "  StrictHostKeyChecking yes",
        "  BatchMode yes",
        "  ConnectTimeout 10",
    ]


def known_hosts(hosts: Sequence[HostEntry]) -> str:
    """One line per node, valid for both its name and its address."""
    return "".join(f"{h.name},{h.address} {_key_only(h.host_public_key)}\n" for h in hosts)


def _key_only(public: str) -> str:
    return " ".join(public.split()[:2])


def etc_hosts_header() -> str:
    # Never a Debian-style "127.0.1.1 <name>" line: it makes gloo bind loopback.
    return "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"


def etc_hosts_lines(hosts: Sequence[HostEntry]) -> str:
    return "".join(f"{h.address} {h.name}\n" for h in hosts)


RESOLV_CONF = (
    "# clusterkit test bed: no DNS server on purpose; names come from /etc/hosts.\n"
    "options timeout:1 attempts:1\n"
)
