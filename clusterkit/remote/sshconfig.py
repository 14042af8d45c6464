"""Resolving an :class:`SSHTarget` against ``~/.ssh/config`` the way OpenSSH does.

Explicit target fields win; ``None`` fields fall back to the config file (Host
aliases, HostName, User, Port, IdentityFile, IdentitiesOnly, ProxyJump,
UserKnownHostsFile, HostKeyAlias, StrictHostKeyChecking=accept-new), then to
OpenSSH defaults. Options we cannot honour faithfully (ProxyCommand) are refused
with a clear error instead of being silently ignored.
"""

from __future__ import annotations

import getpass
import os
import threading
from dataclasses import dataclass, replace

import paramiko

from clusterkit.errors import TransportError
from clusterkit.remote.base import SSHTarget

DEFAULT_PORT = 22
# OpenSSH's default identities, in its order (ssh_config(5) IdentityFile).
DEFAULT_IDENTITIES = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")
MAX_JUMP_DEPTH = 8


@dataclass(frozen=True)
class Endpoint:
    """A target with every connection parameter decided."""

    target: SSHTarget
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    use_agent: bool
    known_hosts_file: str
    accept_new_host_keys: bool
    hostkey_name: str  # the known_hosts lookup key: host or [host]:port
    jump: SSHTarget | None  # the hop to tunnel through, itself resolvable

    @property
    def label(self) -> str:
        return self.target.name


class ConfigCache:
    """Parsed ssh_config files, read once per transport (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parsed: dict[str, paramiko.SSHConfig] = {}

    def get(self, path: str | None, host: str) -> paramiko.SSHConfig:
        explicit = path is not None
        full = os.path.expanduser(path if path is not None else "~/.ssh/config")
        with self._lock:
            if full in self._parsed:
                return self._parsed[full]
            if not os.path.exists(full):
                if explicit:
                    raise TransportError(
                        f"ssh config file {full} does not exist",
                        kind="config",
                        host=host,
                        path=full,
                        hint="fix config_file in the inventory",
                    )
                parsed = paramiko.SSHConfig()
            else:
                try:
                    parsed = paramiko.SSHConfig.from_path(full)
                except (OSError, paramiko.SSHException) as exc:
                    raise TransportError(
                        f"cannot read ssh config: {exc}", kind="config", host=host, path=full
                    ) from exc
            self._parsed[full] = parsed
            return parsed


def _lookup(cache: ConfigCache, target: SSHTarget) -> dict[str, object]:
    config = cache.get(target.config_file, target.name)
    try:
        return dict(config.lookup(target.address))
    except paramiko.SSHException as exc:  # bad Match blocks, canonicalization failures
        raise TransportError(
            f"ssh config lookup for {target.address} failed: {exc}",
            kind="config",
            host=target.name,
        ) from exc


def _port(value: object, host: str) -> int:
    try:
        port = int(str(value))
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise TransportError(f"invalid ssh port {value!r}", kind="config", host=host)
    return port


def _as_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value)]


def hostkey_name(name: str, port: int) -> str:
    """The known_hosts key OpenSSH uses: ``host`` on port 22, ``[host]:port`` otherwise."""
    return name if port == DEFAULT_PORT else f"[{name}]:{port}"


def resolve(cache: ConfigCache, target: SSHTarget) -> Endpoint:
    opts = _lookup(cache, target)
    if "proxycommand" in opts and not target.proxy_jump and "proxyjump" not in opts:
        raise TransportError(
            "ProxyCommand in ssh config is not supported",
            kind="config",
            host=target.name,
            hint="use ProxyJump (or proxy_jump in the inventory) for a bastion",
        )
    hostname = str(opts.get("hostname", target.address))
    port = _port(target.port if target.port is not None else opts.get("port", DEFAULT_PORT), target.name)
    user = target.user or str(opts.get("user") or getpass.getuser())
    identities = _as_list(target.identity_file) + _as_list(opts.get("identityfile"))
    if not identities:
        identities = list(DEFAULT_IDENTITIES)
    identities_only = str(opts.get("identitiesonly", "no")).lower() == "yes"
    known_hosts = target.known_hosts_file or _first_known_hosts(opts)
    strict = str(opts.get("stricthostkeychecking", "")).lower()
    alias = str(opts.get("hostkeyalias") or hostname)
    jump_spec = target.proxy_jump or opts.get("proxyjump")
    jump = _jump_target(target, str(jump_spec)) if jump_spec else None
    return Endpoint(
        target=target,
        hostname=hostname,
        port=port,
        user=user,
        identity_files=tuple(dict.fromkeys(os.path.expanduser(p) for p in identities)),
        use_agent=not identities_only and bool(os.environ.get("SSH_AUTH_SOCK")),
        known_hosts_file=os.path.expanduser(known_hosts),
        accept_new_host_keys=target.accept_new_host_keys or strict == "accept-new",
        hostkey_name=hostkey_name(alias, port),
        jump=jump,
    )


def _first_known_hosts(opts: dict[str, object]) -> str:
    # UserKnownHostsFile may list several files; the first is where OpenSSH writes.
    value = opts.get("userknownhostsfile")
    files = str(value).split() if value else []
    return files[0] if files else "~/.ssh/known_hosts"


def parse_jump_hop(spec: str, host: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` or ``ssh://[user@]host[:port]`` → (user, host, port)."""
    hop = spec.strip()
    if hop.startswith("ssh://"):
        hop = hop[len("ssh://") :]
    user: str | None = None
    if "@" in hop:
        user, hop = hop.rsplit("@", 1)
    port: int | None = None
    if hop.startswith("["):  # [v6addr]:port or [name]:port
        end = hop.find("]")
        rest = hop[end + 1 :]
        hop, port = hop[1:end], (_port(rest[1:], host) if rest.startswith(":") else None)
    elif hop.count(":") == 1:
        hop, port_text = hop.split(":")
        port = _port(port_text, host)
    if not hop:
        raise TransportError(f"invalid ProxyJump {spec!r}", kind="config", host=host)
    return user or None, hop, port


def _jump_target(target: SSHTarget, spec: str) -> SSHTarget | None:
    """The last hop of a ProxyJump chain, carrying the earlier hops as its own jump."""
    if spec.strip().lower() == "none":
        return None
    hops = [h for h in spec.split(",") if h.strip()]
    if not hops:
        return None
    user, host, port = parse_jump_hop(hops[-1], target.name)
    earlier = ",".join(hops[:-1]) or None
    return replace(
        target,
        name=hops[-1].strip(),
        address=host,
        user=user,
        port=port,
        identity_file=target.identity_file,
        proxy_jump=earlier,
        local=False,
    )
