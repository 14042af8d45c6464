"""One transport for mixed inventories: ``target.local`` picks local or SSH.

Callers never branch on where a host is. The SSH transport (and paramiko) is
only created when a non-local target is first used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from clusterkit.remote.base import (
    DEFAULT_COMMAND_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_PARALLEL,
    CommandResult,
    FileStat,
    GroupResult,
    RemoteProcess,
    SSHTarget,
)
from clusterkit.remote.fanout import run_all
from clusterkit.remote.local import LocalTransport

if TYPE_CHECKING:
    from clusterkit.remote.ssh import SSHTransport


class DispatchTransport:
    """Routes each call to :class:`LocalTransport` or :class:`SSHTransport`."""

    def __init__(
        self,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        ssh: SSHTransport | None = None,
        local: LocalTransport | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self._ssh = ssh
        self._ssh_lock = threading.Lock()
        self.local = local or LocalTransport()

    @property
    def ssh(self) -> SSHTransport:
        # Fan-out threads reach this at the same moment; without the lock each could
        # build its own SSHTransport and the connection cache would be split.
        with self._ssh_lock:
            if self._ssh is None:
                from clusterkit.remote.ssh import SSHTransport

                self._ssh = SSHTransport(connect_timeout=self.connect_timeout)
            return self._ssh

    def _for(self, target: SSHTarget) -> LocalTransport | SSHTransport:
        return self.local if target.local else self.ssh

    def run(
        self,
        target: SSHTarget,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> CommandResult:
        return self._for(target).run(target, argv, timeout=timeout, env=env, stdin=stdin)

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
        return self._for(target).run_connected(target, argv, timeout=timeout, env=env,
                                               stdin=stdin, on_connected=on_connected)

    def run_all(
        self,
        targets: Sequence[SSHTarget],
        argv: Sequence[str] | Mapping[str, Sequence[str]],
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        max_parallel: int = DEFAULT_MAX_PARALLEL,
        stdin: bytes | None = None,
    ) -> GroupResult:
        budget = 0.0 if all(t.local for t in targets) else self.ssh.connect_budget_s
        return run_all(self, targets, argv, timeout=timeout, env=env, max_parallel=max_parallel,
                       stdin=stdin, connect_budget_s=budget)

    def start(
        self, target: SSHTarget, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> RemoteProcess:
        return self._for(target).start(target, argv, env=env)

    def put(self, target: SSHTarget, local_path: str, remote_path: str) -> None:
        self._for(target).put(target, local_path, remote_path)

    def get(self, target: SSHTarget, remote_path: str, local_path: str) -> None:
        self._for(target).get(target, remote_path, local_path)

    def stat(self, target: SSHTarget, path: str) -> FileStat | None:
        return self._for(target).stat(target, path)

    def listdir(self, target: SSHTarget, path: str) -> list[str]:
        return self._for(target).listdir(target, path)

    def makedirs(self, target: SSHTarget, path: str) -> None:
        self._for(target).makedirs(target, path)

    def sha256(self, target: SSHTarget, path: str, *, timeout: float = 600.0) -> str:
        return self._for(target).sha256(target, path, timeout=timeout)

    def close(self) -> None:
        if self._ssh is not None:
            self._ssh.close()
        self.local.close()

    def __enter__(self) -> DispatchTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def transport_for(
    targets: Sequence[SSHTarget] = (), *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
) -> DispatchTransport:
    """The transport for these targets (any mix of local and SSH hosts)."""
    del targets  # the dispatcher decides per call; kept so call sites read naturally
    return DispatchTransport(connect_timeout=connect_timeout)
