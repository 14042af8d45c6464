"""Resolving an :class:`SSHTarget` the way OpenSSH does (``ssh -G`` is the oracle).

Options come, first value wins, from the target's own fields (the inventory,
like ``ssh -o`` on a command line: :meth:`SSHTarget.options`), then from
``~/.ssh/config``, then ``/etc/ssh/ssh_config`` — or from ``config_file`` alone
when the inventory names one (``ssh -F``). ``Host`` and ``Match`` blocks
(``all``, ``host``, ``originalhost``, ``user``, ``localuser``, ``canonical``,
``final``) and ``Include`` (globs, relative to ``~/.ssh`` or ``/etc/ssh``,
conditional inside a block) are evaluated as in OpenSSH's readconf.c;
``IdentityFile`` accumulates. Options we cannot honour faithfully (ProxyCommand,
``Match exec``) are refused with a clear error instead of being silently ignored.
"""

from __future__ import annotations

import fnmatch
import getpass
import glob
import os
import shlex
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from clusterkit.errors import TransportError
from clusterkit.remote.base import SSHTarget

DEFAULT_PORT = 22
# OpenSSH's default identities, in its order (ssh_config(5) IdentityFile).
DEFAULT_IDENTITIES = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")
MAX_JUMP_DEPTH = 8
USER_CONFIG = "~/.ssh/config"
SYSTEM_CONFIG = "/etc/ssh/ssh_config"
MAX_INCLUDE_DEPTH = 16  # OpenSSH's READCONF_MAX_DEPTH
# Keywords whose values accumulate instead of first-wins.
MULTI = frozenset({"identityfile", "certificatefile", "localforward", "remoteforward",
                   "dynamicforward", "sendenv", "setenv"})
# Match criteria we evaluate; others (exec, localnetwork, tagged, ...) are refused.
_CRITERIA = frozenset({"all", "canonical", "final", "host", "originalhost", "user", "localuser"})


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
    known_hosts_files: tuple[str, ...] = ()  # every UserKnownHostsFile (the first is written)
    global_known_hosts_files: tuple[str, ...] = ()  # GlobalKnownHostsFile: trusted, read-only

    @property
    def label(self) -> str:
        return self.target.name


@dataclass(frozen=True)
class _Line:
    keyword: str  # lower case
    args: tuple[str, ...]
    path: str
    number: int


@dataclass
class _Lookup:
    """One evaluation: the host asked for and the options decided so far."""

    original: str
    local_user: str
    final: bool = False
    options: dict[str, list[str]] = field(default_factory=dict)
    wants_final: bool = False

    def set(self, keyword: str, args: Sequence[str]) -> None:
        if keyword in MULTI:
            have = self.options.setdefault(keyword, [])
            have.extend(a for a in args if a not in have)
        elif keyword not in self.options:
            self.options[keyword] = list(args)

    def first(self, keyword: str) -> str | None:
        values = self.options.get(keyword)
        return values[0] if values else None


def _split(text: str, path: str, number: int) -> tuple[str, ...]:
    """Words of one config line: ``Key value``, ``Key=value``, quotes, trailing comments."""
    text = text.strip()
    head, sep, rest = text.partition("=")
    if sep and not any(c.isspace() for c in head.strip()):
        text = f"{head.strip()} {rest}"
    try:
        return tuple(shlex.split(text, comments=True, posix=True))
    except ValueError as exc:
        raise TransportError(f"ssh config {path}:{number}: {exc}", kind="config",
                             path=path) from None


class ConfigCache:
    """Parsed ssh_config files, read once per transport (thread-safe).

    ``user_config``/``system_config``: where OpenSSH looks (tests point them elsewhere).
    """

    def __init__(self, user_config: str = USER_CONFIG,
                 system_config: str = SYSTEM_CONFIG) -> None:
        self.user_config = user_config
        self.system_config = system_config
        self._lock = threading.Lock()
        self._parsed: dict[str, tuple[_Line, ...]] = {}

    def lines(self, path: str) -> tuple[_Line, ...]:
        """The lines of one file (expanded path); a missing file has none."""
        with self._lock:
            if path in self._parsed:
                return self._parsed[path]
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                raw = fh.read().splitlines()
        except FileNotFoundError:
            raw = []
        except OSError as exc:
            raise TransportError(f"cannot read ssh config: {exc.strerror}", kind="config",
                                 path=path) from None
        out = []
        for number, text in enumerate(raw, 1):
            words = _split(text, path, number)
            if words:
                out.append(_Line(words[0].lower(), words[1:], path, number))
        with self._lock:
            self._parsed[path] = tuple(out)
        return self._parsed[path]

    def files(self, target: SSHTarget) -> list[tuple[str, bool]]:
        """(path, is_user_file) in the order OpenSSH reads them for this target."""
        if target.config_file is not None:
            full = os.path.expanduser(target.config_file)
            if not os.path.exists(full):
                raise TransportError(f"ssh config file {full} does not exist", kind="config",
                                     host=target.name, path=full,
                                     hint="fix config_file in the inventory")
            return [(full, True)]
        return [(os.path.expanduser(self.user_config), True),
                (os.path.expanduser(self.system_config), False)]

    def lookup(self, target: SSHTarget) -> dict[str, list[str]]:
        """Every option for ``target.address``: the target's own first, then the files."""
        state = _Lookup(original=target.address, local_user=getpass.getuser())
        for keyword, value in target.options().items():
            state.set(keyword.lower(), [value])
        for path, user in self.files(target):
            self._read(path, user, state, target.name, depth=0)
        if state.wants_final:  # OpenSSH reads the files once more for `Match final`
            state.final = True
            for path, user in self.files(target):
                self._read(path, user, state, target.name, depth=0)
        return state.options

    def _read(self, path: str, user: bool, state: _Lookup, host: str, depth: int,
              never: bool = False) -> None:
        # Each file starts active; its Host/Match state does not leak back to the includer
        # (measured with `ssh -G`). Inside an inactive block an Include matches nothing.
        active = not never
        for line in self.lines(path):
            where = f"{line.path}:{line.number}"
            if line.keyword == "host":
                active = not never and _pattern_list_matches(state.original, line.args)
            elif line.keyword == "match":
                active = _match(line.args, state, where, host) and not never
            elif line.keyword == "include":
                if depth >= MAX_INCLUDE_DEPTH:
                    raise TransportError(f"ssh config {where}: Include nested too deeply",
                                         kind="config", host=host, path=line.path)
                for inc in _include_paths(line.args, user):
                    self._read(inc, user, state, host, depth + 1, never=not active)
            elif active:
                state.set(line.keyword, line.args)


def _pattern_list_matches(value: str, patterns: Sequence[str]) -> bool:
    """OpenSSH match_pattern_list: a negated match wins; else any positive match."""
    hit = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = (pattern[1:] if negated else pattern).lower().replace("[", "[[]")
        if fnmatch.fnmatchcase(value.lower(), body):
            if negated:
                return False
            hit = True
    return hit


def _match(args: Sequence[str], state: _Lookup, where: str, host: str) -> bool:
    """One ``Match`` line (criteria ANDed, ``!`` negates one)."""
    words = list(args)
    result = True
    while words:
        word = words.pop(0)
        negated = word.startswith("!")
        criterion = (word[1:] if negated else word).lower()
        if criterion not in _CRITERIA and not result:
            words = words[1:]  # an earlier criterion already failed: like ssh, never run it
            continue
        if criterion not in _CRITERIA:
            raise TransportError(f"ssh config {where}: `Match {criterion}` is not supported by "
                                 "clusterkit", kind="config", host=host,
                                 hint="use Host blocks, or set the option in the inventory")
        if criterion in ("all", "canonical", "final"):
            state.wants_final = state.wants_final or criterion == "final"
            hit = criterion == "all" or (criterion == "final" and state.final)
        else:
            if not words:
                raise TransportError(f"ssh config {where}: Match {criterion} needs a value",
                                     kind="config", host=host)
            hit = _pattern_list_matches(_criterion_value(criterion, state),
                                        words.pop(0).split(","))
        result = result and (hit != negated)
    return result


def _criterion_value(criterion: str, state: _Lookup) -> str:
    if criterion == "host":  # the HostName decided so far (with %h), else the argument
        hostname = state.first("hostname")
        return _tokens(hostname, {"h": state.original}) if hostname else state.original
    if criterion == "originalhost":
        return state.original
    if criterion == "user":
        return state.first("user") or state.local_user
    return state.local_user


def _include_paths(args: Sequence[str], user: bool) -> list[str]:
    """Include globs: ``~`` expanded; relative to ~/.ssh (user file) or /etc/ssh (system)."""
    out: list[str] = []
    for arg in args:
        path = os.path.expanduser(arg)
        if not os.path.isabs(path):
            path = os.path.join(os.path.expanduser("~/.ssh") if user else "/etc/ssh", path)
        out += sorted(glob.glob(path))
    return out


def _tokens(value: str, table: Mapping[str, str]) -> str:
    """ssh_config(5) TOKENS such as ``%h``; an unknown token is left as it is."""
    out, i = [], 0
    while i < len(value):
        if value[i] == "%" and i + 1 < len(value):
            key = value[i + 1]
            out.append("%" if key == "%" else table.get(key, "%" + key))
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def expand_path(value: str, *, hostname: str, user: str, port: int, original: str) -> str:
    """An IdentityFile/UserKnownHostsFile value with tokens and ``~`` expanded, like ssh."""
    local = socket.gethostname()
    table = {"h": hostname, "r": user, "p": str(port), "n": original,
             "d": os.path.expanduser("~"), "u": getpass.getuser(), "l": local.split(".")[0],
             "L": local.split(".")[0], "i": str(os.getuid())}
    return os.path.expanduser(_tokens(value, table))


def lookup(cache: ConfigCache, target: SSHTarget) -> dict[str, list[str]]:
    """Every option for ``target`` (errors name the host)."""
    try:
        return cache.lookup(target)
    except TransportError as exc:
        if exc.host is not None:
            raise
        raise TransportError(exc.message, kind=exc.kind, host=target.name, path=exc.path,
                             hint=exc.hint) from None


def _port(value: object, host: str) -> int:
    try:
        port = int(str(value))
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise TransportError(f"invalid ssh port {value!r}", kind="config", host=host)
    return port


def hostkey_name(name: str, port: int) -> str:
    """The known_hosts key OpenSSH uses: ``host`` on port 22, ``[host]:port`` otherwise."""
    return name if port == DEFAULT_PORT else f"[{name}]:{port}"


def resolve(cache: ConfigCache, target: SSHTarget) -> Endpoint:
    opts = lookup(cache, target)

    def first(key: str) -> str | None:
        values = opts.get(key)
        return values[0] if values else None

    proxy_command = first("proxycommand")
    if proxy_command and proxy_command.lower() != "none" and not first("proxyjump"):
        raise TransportError(
            "ProxyCommand in ssh config is not supported",
            kind="config",
            host=target.name,
            hint="use ProxyJump (or proxy_jump in the inventory) for a bastion",
        )
    hostname = _tokens(first("hostname") or target.address, {"h": target.address})
    port = _port(first("port") or DEFAULT_PORT, target.name)
    user = first("user") or getpass.getuser()

    def path(value: str) -> str:
        return expand_path(value, hostname=hostname, user=user, port=port,
                           original=target.address)

    identities = opts.get("identityfile") or list(DEFAULT_IDENTITIES)
    identities_only = (first("identitiesonly") or "no").lower() == "yes"
    # UserKnownHostsFile takes several files; the first is where a new key is written.
    known = [path(p) for p in opts.get("userknownhostsfile", [])] or [
        path("~/.ssh/known_hosts"), path("~/.ssh/known_hosts2")]
    system_known = [path(p) for p in opts.get("globalknownhostsfile", [])] or [
        "/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2"]
    strict = (first("stricthostkeychecking") or "").lower()
    alias = first("hostkeyalias") or hostname
    jump_spec = first("proxyjump")
    return Endpoint(
        target=target,
        hostname=hostname,
        port=port,
        user=user,
        identity_files=tuple(dict.fromkeys(path(p) for p in identities)),
        use_agent=not identities_only and bool(os.environ.get("SSH_AUTH_SOCK")),
        known_hosts_file=known[0],
        accept_new_host_keys=target.accept_new_host_keys or strict == "accept-new",
        hostkey_name=hostkey_name(alias, port),
        jump=_jump_target(target, jump_spec) if jump_spec else None,
        known_hosts_files=tuple(known),
        global_known_hosts_files=tuple(system_known),
    )


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
