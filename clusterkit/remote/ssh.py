"""SSH transport on paramiko: key auth only, known_hosts enforced, timeouts everywhere.

One paramiko connection per target per transport instance, reused for every
command, SFTP transfer and streamed process; ProxyJump hops are connections too
(shared by all targets behind the same bastion) and tunnel the next hop through
a ``direct-tcpip`` channel. Every failure becomes a :class:`TransportError` with a
``kind`` (see docs/ssh.md) and a one-line message naming the host.

This module is the transport (:class:`SSHTransport`: connections per target, commands,
SFTP files); its parts are :mod:`~clusterkit.remote.ssh_connect` (TCP, tunnels, the
handshake, :class:`Connection`), :mod:`~clusterkit.remote.ssh_auth` (key
authentication) and :mod:`~clusterkit.remote.ssh_channel` (commands and streams on a
channel, :class:`SSHProcess`). Only ``clusterkit/remote/`` imports paramiko.
"""

from __future__ import annotations

import os
import posixpath
import socket
import stat as stat_mod
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import paramiko

from clusterkit.errors import TransportError
from clusterkit.remote import hostkeys
from clusterkit.remote.base import (
    DEFAULT_COMMAND_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_PARALLEL,
    CommandResult,
    FileStat,
    GroupResult,
    SSHTarget,
)
from clusterkit.remote.command import check_argv, check_env, remote_command
from clusterkit.remote.fanout import run_all
from clusterkit.remote.ssh_auth import auth_failed, load_key, open_agent, try_key
from clusterkit.remote.ssh_channel import (
    SSHProcess,
    check_file_op,
    collect_output,
    dropped_error,
    feed_stdin,
)
from clusterkit.remote.ssh_connect import (
    LOG_IDS,
    Connection,
    handshake_error,
    open_tunnel,
    prefer_known_key_types,
    quietly,
    tcp_connect,
)
from clusterkit.remote.sshconfig import MAX_JUMP_DEPTH, ConfigCache, Endpoint, resolve

DEFAULT_KEEPALIVE_S = 5.0


class SSHTransport:
    """The :class:`~clusterkit.remote.base.Transport` over SSH (paramiko)."""

    def __init__(
        self,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        banner_timeout: float | None = None,
        auth_timeout: float | None = None,
        transfer_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.banner_timeout = banner_timeout if banner_timeout is not None else connect_timeout
        self.auth_timeout = auth_timeout if auth_timeout is not None else connect_timeout
        self.transfer_timeout = transfer_timeout
        self.keepalive_s = keepalive_s
        self._configs = ConfigCache()
        self._lock = threading.Lock()
        self._conns: dict[SSHTarget, Connection] = {}
        self._conn_locks: dict[SSHTarget, threading.Lock] = {}
        self._keys: dict[str, paramiko.PKey | str] = {}  # path -> key, or why unusable

    # ------------------------------------------------------------------ connections

    def connect(self, target: SSHTarget) -> None:
        """Connect (or reuse) without running anything: the cheapest reachability probe."""
        self._connection(target)

    def _connection(self, target: SSHTarget, depth: int = 0) -> Connection:
        with self._lock:
            lock = self._conn_locks.setdefault(target, threading.Lock())
        with lock:  # one connect per target even when many threads ask at once
            conn = self._conns.get(target)
            if conn is not None and conn.alive:
                return conn
            if conn is not None:
                conn.close()
            conn = self._open(resolve(self._configs, target), depth)
            with self._lock:
                self._conns[target] = conn
            return conn

    def _drop(self, target: SSHTarget) -> None:
        with self._lock:
            conn = self._conns.pop(target, None)
        if conn is not None:
            conn.close()

    def _open(self, ep: Endpoint, depth: int) -> Connection:
        sock = self._socket(ep, depth)
        transport = self._handshake(ep, sock)
        try:
            self._authenticate(ep, transport)
        except BaseException:
            transport.close()
            raise
        transport.set_keepalive(int(max(1, self.keepalive_s)))
        return Connection(ep, transport)

    def _socket(self, ep: Endpoint, depth: int) -> socket.socket | paramiko.Channel:
        if ep.jump is None:
            return tcp_connect(ep, self.connect_timeout)
        if depth >= MAX_JUMP_DEPTH:
            raise TransportError(
                f"ProxyJump chain deeper than {MAX_JUMP_DEPTH} hops (a loop?)",
                kind="config",
                host=ep.label,
            )
        try:
            bastion = self._connection(ep.jump, depth + 1)
        except TransportError as exc:
            raise TransportError(
                f"via jump host {ep.jump.name}: {exc.message}",
                kind=exc.kind,
                host=ep.label,
                path=exc.path,
                hint=exc.hint,
            ) from exc
        return open_tunnel(bastion, ep, self.connect_timeout)

    def _handshake(self, ep: Endpoint, sock: socket.socket | paramiko.Channel) -> paramiko.Transport:
        transport = paramiko.Transport(sock)
        transport.set_log_channel(f"paramiko.transport.clusterkit{next(LOG_IDS)}")
        transport.banner_timeout = self.banner_timeout
        transport.auth_timeout = self.auth_timeout
        transport.handshake_timeout = self.connect_timeout
        prefer_known_key_types(transport, ep)
        started = time.monotonic()
        try:
            # start_client returns quietly when its timeout passes; the banner error,
            # if any, is raised from inside it, so give the banner its full time first.
            transport.start_client(timeout=self.banner_timeout + self.connect_timeout)
            if not (transport.is_active() and transport.initial_kex_done):
                raise TimeoutError("key exchange did not finish")
            hostkeys.verify(
                ep.known_hosts_file,
                ep.hostkey_name,
                transport.get_remote_server_key(),
                accept_new=ep.accept_new_host_keys,
                host=ep.label,
                also=(*ep.known_hosts_files[1:], *ep.global_known_hosts_files),
            )
        except TransportError:
            transport.close()
            raise
        except (paramiko.SSHException, EOFError, OSError) as exc:
            transport.close()
            raise handshake_error(exc, ep, self.connect_timeout, banner_timeout=self.banner_timeout,
                                   elapsed=time.monotonic() - started) from exc
        return transport

    # ------------------------------------------------------------------ authentication

    def _authenticate(self, ep: Endpoint, transport: paramiko.Transport) -> None:
        notes: list[str] = []
        agent = open_agent(notes) if ep.use_agent else None
        try:
            keys: list[tuple[str, paramiko.PKey]] = [
                (f"agent key {k.get_name()}", k) for k in (agent.get_keys() if agent else ())
            ]
            keys += self._identity_keys(ep, notes)
            for _label, key in keys:
                if try_key(ep, transport, key, self.auth_timeout):
                    return
            raise auth_failed(ep, [label for label, _ in keys], notes)
        finally:
            if agent is not None:
                agent.close()

    def _identity_keys(self, ep: Endpoint, notes: list[str]) -> list[tuple[str, paramiko.PKey]]:
        explicit = ep.target.identity_file
        found: list[tuple[str, paramiko.PKey]] = []
        for path in ep.identity_files:
            with self._lock:
                cached = self._keys.get(path)
            if cached is None:
                cached = load_key(path)
                with self._lock:
                    self._keys[path] = cached
            if isinstance(cached, str):
                # Missing default identities are normal; anything else is worth saying.
                if not cached.startswith("missing") or (explicit and path == os.path.expanduser(explicit)):
                    notes.append(f"{path}: {cached}")
                continue
            found.append((path, cached))
        return found

    # ------------------------------------------------------------------ commands

    def _session(self, target: SSHTarget) -> tuple[Connection, paramiko.Channel]:
        conn = self._connection(target)
        try:
            return conn, conn.transport.open_session(timeout=self.connect_timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if conn.alive:
                raise TransportError(
                    f"cannot open a session channel: {exc}",
                    kind="channel",
                    host=target.name,
                    hint="sshd MaxSessions reached, or the server refused the session",
                ) from exc
        # The cached connection died since its last use: reconnect once.
        self._drop(target)
        conn = self._connection(target)
        try:
            return conn, conn.transport.open_session(timeout=self.connect_timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise dropped_error(target.name, exc) from exc

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
        """``run``, connecting first and calling ``on_connected`` once logged in."""
        self.connect(target)
        if on_connected is not None:
            on_connected()
        return self.run(target, argv, timeout=timeout, env=env, stdin=stdin)

    def run(
        self,
        target: SSHTarget,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> CommandResult:
        words = check_argv(argv, target.name)
        command = remote_command(words, check_env(env, target.name))
        started = time.monotonic()
        conn, chan = self._session(target)
        try:
            chan.exec_command(command)
            feed_stdin(chan, stdin)
            code, out, err = collect_output(chan, conn, time.monotonic() + timeout, target.name, timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise dropped_error(target.name, exc) from exc
        finally:
            chan.close()
        return CommandResult(
            host=target.name,
            argv=words,
            exit_code=code,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            duration_s=time.monotonic() - started,
        )

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
        return run_all(self, targets, argv, timeout=timeout, env=env, max_parallel=max_parallel,
                       stdin=stdin, connect_budget_s=self.connect_budget_s)

    @property
    def connect_budget_s(self) -> float:
        """Worst case for one connect: TCP + banner + kex + auth, per hop."""
        return self.connect_timeout * 2 + self.banner_timeout + self.auth_timeout

    def start(
        self,
        target: SSHTarget,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
    ) -> SSHProcess:
        words = check_argv(argv, target.name)
        command = remote_command(words, check_env(env, target.name))
        conn, chan = self._session(target)
        try:
            chan.exec_command(command)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            chan.close()
            raise dropped_error(target.name, exc) from exc
        return SSHProcess(target.name, chan, conn)

    # ------------------------------------------------------------------ files

    def _sftp_call(self, target: SSHTarget, path: str, what: str, fn: Any) -> Any:
        conn = self._connection(target)
        with conn.lock:
            try:
                return fn(conn.sftp(self.transfer_timeout))
            except TransportError:
                raise
            except FileNotFoundError as exc:
                raise TransportError(
                    f"{what}: no such file or directory",
                    kind="file",
                    host=target.name,
                    path=path,
                ) from exc
            except PermissionError as exc:
                raise TransportError(
                    f"{what}: permission denied", kind="file", host=target.name, path=path
                ) from exc
            except TimeoutError as exc:
                conn.reset_sftp()  # a late reply would desync the next request
                raise TransportError(
                    f"{what}: no progress for {self.transfer_timeout:.0f}s",
                    kind="command-timeout",
                    host=target.name,
                    path=path,
                ) from exc
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if not conn.alive:
                    self._drop(target)
                    raise dropped_error(target.name, exc) from exc
                raise TransportError(f"{what}: {exc}", kind="file", host=target.name, path=path) from exc

    def put(self, target: SSHTarget, local_path: str, remote_path: str) -> None:
        """Upload; the remote file appears complete or not at all (temp + rename)."""
        try:
            mode = os.stat(local_path).st_mode & 0o777
        except OSError as exc:
            raise TransportError(
                f"cannot read local file: {exc.strerror}", kind="file", path=local_path
            ) from exc
        directory, name = posixpath.split(remote_path)
        tmp = posixpath.join(directory, f".{name}.clusterkit-{uuid.uuid4().hex[:12]}")

        def upload(sftp: paramiko.SFTPClient) -> None:
            try:
                sftp.put(local_path, tmp, confirm=True)
                sftp.chmod(tmp, mode)
                sftp.posix_rename(tmp, remote_path)
            except BaseException:
                quietly(lambda: sftp.remove(tmp))
                raise

        self._sftp_call(target, remote_path, "upload", upload)

    def get(self, target: SSHTarget, remote_path: str, local_path: str) -> None:
        """Download; the local file appears complete or not at all (temp + os.replace)."""
        directory = os.path.dirname(os.path.abspath(local_path))

        def download(sftp: paramiko.SFTPClient) -> None:
            mode = (sftp.stat(remote_path).st_mode or 0o644) & 0o777
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(local_path)}.", dir=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    sftp.getfo(remote_path, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, mode)
                os.replace(tmp, local_path)
            except BaseException:
                quietly(lambda: os.unlink(tmp))
                raise

        self._sftp_call(target, remote_path, "download", download)

    def stat(self, target: SSHTarget, path: str) -> FileStat | None:
        """``None`` when the path does not exist."""

        def do(sftp: paramiko.SFTPClient) -> FileStat | None:
            try:
                attrs = sftp.stat(path)
            except FileNotFoundError:
                return None
            mode = attrs.st_mode or 0
            return FileStat(
                path=path,
                size=attrs.st_size or 0,
                mtime=float(attrs.st_mtime or 0),
                mode=mode & 0o7777,
                is_dir=stat_mod.S_ISDIR(mode),
            )

        result: FileStat | None = self._sftp_call(target, path, "stat", do)
        return result

    def listdir(self, target: SSHTarget, path: str) -> list[str]:
        names: list[str] = self._sftp_call(target, path, "list", lambda s: sorted(s.listdir(path)))
        return names

    def makedirs(self, target: SSHTarget, path: str) -> None:
        result = self.run(target, ["mkdir", "-p", "--", path], timeout=self.transfer_timeout)
        check_file_op(result, path, "mkdir")

    def sha256(self, target: SSHTarget, path: str, *, timeout: float = 600.0) -> str:
        result = self.run(target, ["sha256sum", "--", path], timeout=timeout)
        check_file_op(result, path, "sha256")
        return result.stdout.split()[0]

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        # Newest first: tunnelled connections before the bastions they ride on.
        for conn in reversed(conns):
            quietly(conn.close)

    def __enter__(self) -> SSHTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
