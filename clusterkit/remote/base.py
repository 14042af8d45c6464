"""Transport contract shared by the SSH and local transports.

Commands are ``list[str]`` end to end; a transport quotes them exactly once
(``shlex.join``) at the boundary. Work across hosts returns one result per host
and never stops at the first failure (like fabric's ``GroupResult``), and every
call has a connect and a command timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from clusterkit.errors import TransportError
from clusterkit.hostrange import fold_by_text
from clusterkit.inventory import Host, ssh_options

DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_COMMAND_TIMEOUT_S = 60.0
DEFAULT_MAX_PARALLEL = 64


@dataclass(frozen=True)
class SSHTarget:
    """Everything needed to reach one host. Built from an inventory host.

    ``name`` is the inventory name (used in reports); ``address`` is what we
    connect to (a name, an IP, or an ``~/.ssh/config`` Host alias). ``None`` fields
    fall back to ``~/.ssh/config`` (or ``config_file``) and then OpenSSH defaults.
    """

    name: str
    address: str
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None
    config_file: str | None = None
    known_hosts_file: str | None = None
    # OpenSSH StrictHostKeyChecking=accept-new behaviour; a *changed* key is always refused.
    accept_new_host_keys: bool = False
    local: bool = False  # run on this machine without SSH (embedded default / virtual nodes)

    def options(self) -> dict[str, str]:
        """The explicit ssh_config options of this target (the one mapping, see
        :func:`clusterkit.inventory.ssh_options`); ``address`` is the host argument."""
        return ssh_options(user=self.user, port=self.port, identity_file=self.identity_file,
                           proxy_jump=self.proxy_jump, known_hosts_file=self.known_hosts_file,
                           accept_new_host_keys=self.accept_new_host_keys)


def target_for(host: Host, *, accept_new_host_keys: bool = False) -> SSHTarget:
    """The one function from an inventory host to what the transports connect to."""
    return SSHTarget(
        name=host.name, address=host.address, user=host.ssh.user, port=host.ssh.port,
        identity_file=host.ssh.identity_file, proxy_jump=host.ssh.proxy_jump,
        config_file=host.ssh.config_file, known_hosts_file=host.ssh.known_hosts_file,
        accept_new_host_keys=accept_new_host_keys, local=host.transport == "local",
    )


@dataclass(frozen=True)
class CommandResult:
    host: str
    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class HostResult:
    """The outcome on one host: a completed command, or the error that prevented it."""

    host: str
    result: CommandResult | None = None
    error: TransportError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.result is not None and self.result.ok

    def reason(self) -> str | None:
        """Why this host failed, without its name (so equal reasons fold); None when ok."""
        if self.error is not None:
            text = f"{self.error.kind}: {self.error.message}"
            return f"{text} — {self.error.hint}" if self.error.hint else text
        if self.result is None:
            return "no result"
        if self.result.ok:
            return None
        tail = (self.result.stderr.strip() or self.result.stdout.strip()).splitlines()[-1:]
        return f"exit {self.result.exit_code}" + (f": {tail[0][:300]}" if tail else "")


@dataclass(frozen=True)
class GroupResult:
    """Per-host results in the order the hosts were given."""

    results: tuple[HostResult, ...] = field(default_factory=tuple)

    def __iter__(self) -> Iterator[HostResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, host: str) -> HostResult:
        for r in self.results:
            if r.host == host:
                return r
        raise KeyError(host)

    @property
    def succeeded(self) -> tuple[HostResult, ...]:
        return tuple(r for r in self.results if r.ok)

    @property
    def failed(self) -> tuple[HostResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    def folded_failures(self) -> list[tuple[str, str]]:
        """``(host range, reason)`` rows: hosts that failed the same way share one row."""
        return fold_by_text(((r.host, r.reason() or "") for r in self.failed),
                            [r.host for r in self.results])

    def raise_on_failure(self, what: str) -> None:
        if self.failed:
            raise GroupError(what, self)


class GroupError(TransportError):
    """Some hosts of a group failed; the message folds hosts with identical reasons."""

    def __init__(self, what: str, group: GroupResult) -> None:
        rows = group.folded_failures()
        text = "; ".join(f"{hosts}: {reason}" for hosts, reason in rows)
        super().__init__(f"{what} failed on {len(group.failed)} of {len(group)} host(s): {text}",
                         kind="group")
        self.group = group


@dataclass(frozen=True)
class FileStat:
    """What ``Transport.stat`` reports about a path on a host."""

    path: str
    size: int
    mtime: float
    mode: int  # permission bits (& 0o7777)
    is_dir: bool


class RemoteProcess(Protocol):
    """A long-running remote command whose output is streamed (used by launch)."""

    host: str

    def lines(self) -> Iterator[tuple[str, str]]:
        """Yield ``(stream, line)`` pairs, stream in {"stdout", "stderr"}, until EOF."""
        ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int:
        """Exit code; -1 when the connection dropped. Raises TimeoutError on timeout."""
        ...

    def close_stdin(self) -> None: ...

    def write_stdin(self, data: bytes) -> None: ...

    def terminate(self) -> None:
        """Close the channel / kill the local child. Remote cleanup is the agent's job."""
        ...


class Transport(Protocol):
    """The operations every layer above may use. Implementations: ssh, local."""

    def run(
        self,
        target: SSHTarget,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> CommandResult: ...

    def run_connected(
        self,
        target: SSHTarget,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        on_connected: Callable[[], None] | None = None,
    ) -> CommandResult:
        """``run``, calling ``on_connected`` once the host is logged in to and the command
        is about to be sent (at once for a local host): doctor starts a node's clock
        window and set-up time there, so slow logins are not counted as skew."""
        ...

    def run_all(
        self,
        targets: Sequence[SSHTarget],
        argv: Sequence[str] | Mapping[str, Sequence[str]],
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        max_parallel: int = DEFAULT_MAX_PARALLEL,
        stdin: bytes | None = None,
    ) -> GroupResult: ...

    def start(
        self,
        target: SSHTarget,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
    ) -> RemoteProcess: ...

    def put(self, target: SSHTarget, local_path: str, remote_path: str) -> None: ...

    def get(self, target: SSHTarget, remote_path: str, local_path: str) -> None: ...

    def stat(self, target: SSHTarget, path: str) -> FileStat | None:
        """``None`` when the path does not exist."""
        ...

    def listdir(self, target: SSHTarget, path: str) -> list[str]:
        """Sorted entry names (no ``.``/``..``)."""
        ...

    def makedirs(self, target: SSHTarget, path: str) -> None:
        """``mkdir -p``."""
        ...

    def sha256(self, target: SSHTarget, path: str, *, timeout: float = 600.0) -> str:
        """Hex digest of a file, computed on the host (no transfer)."""
        ...

    def close(self) -> None: ...
