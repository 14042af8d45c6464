"""SSH transport on paramiko: key auth only, known_hosts enforced, timeouts everywhere.

One paramiko connection per target per transport instance, reused for every
command, SFTP transfer and streamed process; ProxyJump hops are connections too
(shared by all targets behind the same bastion) and tunnel the next hop through
a ``direct-tcpip`` channel. Every failure becomes a :class:`TransportError` with a
``kind`` (see docs/ssh.md) and a one-line message naming the host.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import posixpath
import select
import socket
import stat as stat_mod
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import paramiko
from paramiko.ssh_exception import IncompatiblePeer

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
from clusterkit.remote.sshconfig import MAX_JUMP_DEPTH, ConfigCache, Endpoint, resolve
from clusterkit.remote.streams import LineQueue

DEFAULT_KEEPALIVE_S = 5.0
# Linux: abort the TCP connection when sent data (our keepalives) stays unacked this
# long, so a vanished peer surfaces as a dropped connection instead of a 15-minute hang.
_TCP_USER_TIMEOUT_MS = 20_000
_READ_CHUNK = 65536


class _OpenFailures(logging.Handler):
    """Keeps the server's reason for refused channel opens, which paramiko only logs.

    ``ChannelException`` carries a generic "Connect failed"; the bastion's own text
    ("Connection refused", "Name or service not known") is what tells the user which
    of refused/resolve/unreachable happened behind it.
    """

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.last: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "open FAILED:" in message:
            self.last[record.name] = message.split("open FAILED:", 1)[1].strip()


_OPEN_FAILURES = _OpenFailures()
_LOG_IDS = itertools.count()
# paramiko logs handshake failures with tracebacks at ERROR; every failure already
# reaches the user as one TransportError line, so keep its log out of the app's.
logging.getLogger("paramiko").addHandler(_OPEN_FAILURES)
logging.getLogger("paramiko").propagate = False


class _Connection:
    """One authenticated SSH connection plus its lazily opened SFTP session."""

    def __init__(self, endpoint: Endpoint, transport: paramiko.Transport) -> None:
        self.endpoint = endpoint
        self.transport = transport
        self.lock = threading.Lock()  # serialises SFTP use
        self._sftp: paramiko.SFTPClient | None = None

    def reset_sftp(self) -> None:
        if self._sftp is not None:
            _quietly(self._sftp.close)
            self._sftp = None

    def sftp(self, timeout: float) -> paramiko.SFTPClient:
        if self._sftp is None:
            client = paramiko.SFTPClient.from_transport(self.transport)
            if client is None:
                raise TransportError(
                    "cannot open an SFTP session",
                    kind="channel",
                    host=self.endpoint.label,
                    hint="is the sftp Subsystem enabled in sshd_config?",
                )
            # Per-request inactivity timeout: a stalled transfer errors out instead of hanging.
            client.get_channel().settimeout(timeout)  # type: ignore[union-attr]
            self._sftp = client
        return self._sftp

    @property
    def alive(self) -> bool:
        return self.transport.is_active()

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
        self.transport.close()
        _OPEN_FAILURES.last.pop(self.transport.get_log_channel(), None)


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
        self._conns: dict[SSHTarget, _Connection] = {}
        self._conn_locks: dict[SSHTarget, threading.Lock] = {}
        self._keys: dict[str, paramiko.PKey | str] = {}  # path -> key, or why unusable

    # ------------------------------------------------------------------ connections

    def connect(self, target: SSHTarget) -> None:
        """Connect (or reuse) without running anything: the cheapest reachability probe."""
        self._connection(target)

    def _connection(self, target: SSHTarget, depth: int = 0) -> _Connection:
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

    def _open(self, ep: Endpoint, depth: int) -> _Connection:
        sock = self._socket(ep, depth)
        transport = self._handshake(ep, sock)
        try:
            self._authenticate(ep, transport)
        except BaseException:
            transport.close()
            raise
        transport.set_keepalive(int(max(1, self.keepalive_s)))
        return _Connection(ep, transport)

    def _socket(self, ep: Endpoint, depth: int) -> socket.socket | paramiko.Channel:
        if ep.jump is None:
            return _tcp_connect(ep, self.connect_timeout)
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
        return _open_tunnel(bastion, ep, self.connect_timeout)

    def _handshake(self, ep: Endpoint, sock: socket.socket | paramiko.Channel) -> paramiko.Transport:
        transport = paramiko.Transport(sock)
        transport.set_log_channel(f"paramiko.transport.clusterkit{next(_LOG_IDS)}")
        transport.banner_timeout = self.banner_timeout
        transport.auth_timeout = self.auth_timeout
        transport.handshake_timeout = self.connect_timeout
        _prefer_known_key_types(transport, ep)
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
            raise _handshake_error(exc, ep, self.connect_timeout, banner_timeout=self.banner_timeout,
                                   elapsed=time.monotonic() - started) from exc
        return transport

    # ------------------------------------------------------------------ authentication

    def _authenticate(self, ep: Endpoint, transport: paramiko.Transport) -> None:
        notes: list[str] = []
        agent = _open_agent(notes) if ep.use_agent else None
        try:
            keys: list[tuple[str, paramiko.PKey]] = [
                (f"agent key {k.get_name()}", k) for k in (agent.get_keys() if agent else ())
            ]
            keys += self._identity_keys(ep, notes)
            for _label, key in keys:
                if _try_key(ep, transport, key, self.auth_timeout):
                    return
            raise _auth_failed(ep, [label for label, _ in keys], notes)
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
                cached = _load_key(path)
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

    def _session(self, target: SSHTarget) -> tuple[_Connection, paramiko.Channel]:
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
            raise _dropped(target.name, exc) from exc

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
            _feed_stdin(chan, stdin)
            code, out, err = _collect(chan, conn, time.monotonic() + timeout, target.name, timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise _dropped(target.name, exc) from exc
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
            raise _dropped(target.name, exc) from exc
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
                    raise _dropped(target.name, exc) from exc
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
                _quietly(lambda: sftp.remove(tmp))
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
                _quietly(lambda: os.unlink(tmp))
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
        _check_file_op(result, path, "mkdir")

    def sha256(self, target: SSHTarget, path: str, *, timeout: float = 600.0) -> str:
        result = self.run(target, ["sha256sum", "--", path], timeout=timeout)
        _check_file_op(result, path, "sha256")
        return result.stdout.split()[0]

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        # Newest first: tunnelled connections before the bastions they ride on.
        for conn in reversed(conns):
            _quietly(conn.close)

    def __enter__(self) -> SSHTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SSHProcess:
    """A streamed remote command (:class:`~clusterkit.remote.base.RemoteProcess`)."""

    def __init__(self, host: str, chan: paramiko.Channel, conn: _Connection) -> None:
        self.host = host
        self._chan = chan
        self._conn = conn
        self._lines = LineQueue()
        self._code: int | None = None
        self._finished = threading.Event()
        self.dropped = False  # True when the connection, not the command, ended it
        self._reader = threading.Thread(target=self._read, name=f"clusterkit-ssh-{host}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        chan = self._chan
        try:
            while True:
                got = _drain(chan, self._lines)
                if chan.closed or (chan.eof_received and not got):
                    break
                if not got:
                    select.select([chan], [], [], 1.0)
            # exit-status arrives with (or right after) EOF; a dead connection never sends it.
            while not chan.exit_status_ready() and self._conn.alive and not chan.closed:
                chan.status_event.wait(1.0)
        finally:
            self._lines.close_all()
            self._finish()

    def _finish(self) -> None:
        chan = self._chan
        if chan.exit_status_ready() and chan.exit_status != -1:
            self._code = chan.exit_status
        else:
            self._code = -1
            self.dropped = not self._conn.alive
        _quietly(chan.close)
        self._finished.set()

    def lines(self) -> Iterator[tuple[str, str]]:
        return self._lines.lines()

    def poll(self) -> int | None:
        return self._code if self._finished.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.host}: still running after {timeout}s")
        assert self._code is not None
        return self._code

    def write_stdin(self, data: bytes) -> None:
        try:
            self._chan.sendall(data)
        except (OSError, paramiko.SSHException) as exc:
            raise _dropped(self.host, exc) from exc

    def close_stdin(self) -> None:
        _quietly(self._chan.shutdown_write)

    def terminate(self) -> None:
        """Ask sshd to SIGTERM the command (RFC 4254 "signal"), then close the channel."""
        _send_signal(self._chan, "TERM")
        _quietly(self._chan.close)


# ---------------------------------------------------------------------- helpers


def _quietly(fn: Any) -> None:
    # Cleanup on an already-failing path: the first error is the one to report.
    with contextlib.suppress(Exception):
        fn()


def _getaddrinfo(ep: Endpoint, timeout: float) -> list[Any]:
    """getaddrinfo under a deadline (glibc's own resolver timeouts can be 30 s+)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["addrs"] = socket.getaddrinfo(ep.hostname, ep.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            box["error"] = exc

    thread = threading.Thread(target=work, daemon=True, name="clusterkit-resolve")
    thread.start()
    thread.join(timeout)
    if "addrs" in box:
        return list(box["addrs"])
    reason = "timed out" if thread.is_alive() else str(box["error"])
    raise TransportError(
        f"cannot resolve the host's address ({reason})",
        kind="resolve",
        host=ep.label,
        hint="check the address in the inventory or HostName in ~/.ssh/config, and /etc/hosts or DNS",
    )


def _tcp_connect(ep: Endpoint, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    errors: list[OSError] = []
    for family, kind, proto, _, addr in _getaddrinfo(ep, timeout):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            sock.connect(addr)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        _tune_socket(sock)
        return sock
    raise _connect_error(errors, ep, timeout)


def _tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _TCP_USER_TIMEOUT_MS)


def _where(ep: Endpoint) -> str:
    """The endpoint in a message, without the host's own name or address: reports fold
    identical messages of many hosts into one ``node[1-7]`` row (``ssh -G HOST`` shows
    the address)."""
    return f"port {ep.port}"


def _connect_error(errors: list[OSError], ep: Endpoint, timeout: float) -> TransportError:
    where = _where(ep)
    codes = {e.errno for e in errors}
    if errno.ECONNREFUSED in codes:
        return TransportError(
            f"connection refused on {where}",
            kind="refused",
            host=ep.label,
            hint=f"is sshd running and listening on port {ep.port}?",
        )
    if any(isinstance(e, TimeoutError) for e in errors) or not errors:
        return TransportError(
            f"no answer from {where} within {timeout:g}s",
            kind="timeout",
            host=ep.label,
            hint="the host is down, firewalled, or the address is wrong",
        )
    if codes & {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}:
        return TransportError(
            f"{where} is unreachable ({errors[0].strerror})",
            kind="timeout",
            host=ep.label,
            hint="the host is down or there is no route to it",
        )
    return TransportError(f"cannot connect to {where}: {errors[0]}", kind="network", host=ep.label)


def _open_tunnel(bastion: _Connection, ep: Endpoint, timeout: float) -> paramiko.Channel:
    where = _where(ep)
    via = bastion.endpoint.label
    try:
        chan = bastion.transport.open_channel(
            "direct-tcpip", (ep.hostname, ep.port), ("127.0.0.1", 0), timeout=timeout
        )
    except paramiko.ChannelException as exc:
        reason = _OPEN_FAILURES.last.get(bastion.transport.get_log_channel(), str(exc.text))
        text = reason.lower()
        if "refused" in text:
            kind, what = "refused", f"connection refused on {where} (seen from jump host {via})"
        elif "resolve" in text or "not known" in text or "unknown host" in text:
            kind, what = "resolve", f"jump host {via} cannot resolve the host's address"
        elif any(w in text for w in ("timed out", "unreachable", "no route")):
            kind, what = "timeout", f"{where} unreachable from jump host {via}"
        else:
            kind, what = "proxy", f"jump host {via} refused to forward to {where} ({reason})"
        raise TransportError(
            what,
            kind=kind,
            host=ep.label,
            hint="check the address as the jump host sees it, and AllowTcpForwarding there",
        ) from exc
    except (paramiko.SSHException, EOFError, OSError) as exc:
        raise TransportError(
            f"jump host {via} did not open a tunnel to {where} within {timeout:g}s ({exc})",
            kind="timeout",
            host=ep.label,
        ) from exc
    return chan


def _prefer_known_key_types(transport: paramiko.Transport, ep: Endpoint) -> None:
    """Negotiate the host key type known_hosts has, so a known host never looks 'changed'."""
    known = [t for p in (ep.known_hosts_file, *ep.known_hosts_files[1:],
                         *ep.global_known_hosts_files)
             for t in hostkeys.known_key_types(p, ep.hostkey_name)]
    if not known:
        return
    options = transport.get_security_options()
    available = list(options.key_types)
    preferred = [k for k in known if k in available]
    options.key_types = preferred + [k for k in available if k not in preferred]


def _handshake_error(exc: BaseException, ep: Endpoint, timeout: float, *,
                     banner_timeout: float | None = None, elapsed: float | None = None
                     ) -> TransportError:
    text = str(exc)
    where = _where(ep)
    if "banner" in text.lower():
        return _banner_error(text, ep, banner_timeout or timeout, elapsed)
    if isinstance(exc, IncompatiblePeer) or "negotiat" in text.lower():
        return TransportError(
            f"SSH negotiation with {where} failed: {text}",
            kind="protocol",
            host=ep.label,
            hint="the server offers no algorithm paramiko supports",
        )
    if isinstance(exc, TimeoutError) or "timeout" in text.lower():
        return TransportError(
            f"SSH handshake with {where} did not finish within {timeout:g}s",
            kind="timeout",
            host=ep.label,
        )
    return TransportError(
        f"connection to {where} closed during the SSH handshake ({text or type(exc).__name__})",
        kind="channel",
        host=ep.label,
        hint="sshd refused us early: check its log (MaxStartups, AllowUsers, tcp wrappers)",
    )


def _banner_error(text: str, ep: Endpoint, timeout: float, elapsed: float | None
                  ) -> TransportError:
    """What really happened before the banner: paramiko says "Error reading SSH protocol
    banner" both when its wait ran out and when the peer closed at once (issue 25: "no
    SSH banner within 10s", 0.7 s after starting, on an address that was not an SSH
    server), so the elapsed time tells the two apart."""
    where = _where(ep)
    detail = text.split("banner", 1)[-1].strip()
    if elapsed is not None and elapsed < timeout * 0.9:
        how = "reset" if "reset" in detail.lower() else "closed"
        return TransportError(
            f"connection to {where} was {how} after {elapsed:.1f}s without an SSH banner"
            + (f" ({detail})" if detail else ""),
            kind="channel",
            host=ep.label,
            hint="something accepted the TCP connection but is not an SSH server (wrong "
                 "address or port?), or sshd dropped us early (MaxStartups, tcp wrappers)",
        )
    return TransportError(
        f"no SSH banner from {where} within {timeout:g}s" + (f" ({detail})" if detail else ""),
        kind="timeout",
        host=ep.label,
        hint="is this port an SSH server? (sshd overloaded: MaxStartups)",
    )


def _open_agent(notes: list[str]) -> paramiko.Agent | None:
    try:
        return paramiko.Agent()
    except (paramiko.SSHException, OSError) as exc:  # stale SSH_AUTH_SOCK
        notes.append(f"ssh-agent: {exc}")
        return None


def _load_key(path: str) -> paramiko.PKey | str:
    if not os.path.exists(path):
        return "missing"
    try:
        return paramiko.PKey.from_path(path)
    except paramiko.PasswordRequiredException:
        # We never prompt: encrypted keys are usable only through ssh-agent.
        return "encrypted (load it into ssh-agent)"
    except (paramiko.SSHException, OSError, ValueError) as exc:
        return f"unusable ({exc})"


def _try_key(ep: Endpoint, transport: paramiko.Transport, key: paramiko.PKey, timeout: float) -> bool:
    try:
        remaining = transport.auth_publickey(ep.user, key)
    except paramiko.BadAuthenticationType as exc:
        raise TransportError(
            f"user {ep.user} cannot log in with a public key "
            f"(allows: {', '.join(exc.allowed_types) or 'nothing'})",
            kind="auth",
            host=ep.label,
            hint="clusterkit uses key authentication only; enable PubkeyAuthentication",
        ) from exc
    except paramiko.AuthenticationException as exc:
        if "timeout" in str(exc).lower():
            raise TransportError(
                f"authentication as {ep.user} did not finish within {timeout:g}s",
                kind="auth",
                host=ep.label,
            ) from exc
        return False
    except (paramiko.SSHException, EOFError, OSError) as exc:
        raise TransportError(
            f"the host closed the connection during authentication ({exc})",
            kind="auth",
            host=ep.label,
            hint="too many keys offered (sshd MaxAuthTries)? set identity_file / IdentitiesOnly",
        ) from exc
    if transport.is_authenticated():
        return True
    raise TransportError(
        f"the host wants further authentication ({', '.join(remaining)}) after the key",
        kind="auth",
        host=ep.label,
        hint="clusterkit supports key-only logins",
    )


def _auth_failed(ep: Endpoint, offered: list[str], notes: list[str]) -> TransportError:
    detail = f"rejected {len(offered)} key(s): {', '.join(offered)}" if offered else "no key to offer"
    if notes:
        detail += f"; skipped {'; '.join(notes)}"
    return TransportError(
        f"authentication failed for user {ep.user} ({detail})",
        kind="auth",
        host=ep.label,
        hint=f"add your public key to ~{ep.user}/.ssh/authorized_keys there, or set "
        "identity_file (IdentityFile) to the right key; passwords are never tried",
    )


def _dropped(host: str, exc: BaseException) -> TransportError:
    return TransportError(
        f"connection dropped ({exc or type(exc).__name__})",
        kind="channel",
        host=host,
        hint="the host rebooted, sshd restarted, or the network went away; retry",
    )


def _feed_stdin(chan: paramiko.Channel, data: bytes | None) -> None:
    if data is None:
        chan.shutdown_write()
        return

    # A separate writer so a command that prints before reading cannot deadlock us.
    def write() -> None:
        try:
            chan.sendall(data)
        except (OSError, paramiko.SSHException):
            return  # the reader sees the closed channel and reports it
        _quietly(chan.shutdown_write)

    threading.Thread(target=write, daemon=True, name="clusterkit-stdin").start()


def _drain(chan: paramiko.Channel, sink: LineQueue | tuple[bytearray, bytearray]) -> bool:
    got = False
    while chan.recv_ready():
        data = chan.recv(_READ_CHUNK)
        if not data:
            break
        got = True
        if isinstance(sink, LineQueue):
            sink.feed("stdout", data)
        else:
            sink[0].extend(data)
    while chan.recv_stderr_ready():
        data = chan.recv_stderr(_READ_CHUNK)
        if not data:
            break
        got = True
        if isinstance(sink, LineQueue):
            sink.feed("stderr", data)
        else:
            sink[1].extend(data)
    return got


def _collect(
    chan: paramiko.Channel, conn: _Connection, deadline: float, host: str, timeout: float
) -> tuple[int, bytearray, bytearray]:
    """Read both streams until the exit status arrives, or fail at the deadline."""
    out, err = bytearray(), bytearray()
    while True:
        got = _drain(chan, (out, err))
        if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
            break
        if chan.closed:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            chan.close()  # sshd then closes the command's pipes; no waiting on it
            raise TransportError(
                f"command did not finish within {timeout:g}s (channel closed)",
                kind="command-timeout",
                host=host,
                hint="raise the timeout, or check the command by hand on that host",
            )
        if got:
            continue
        if chan.eof_received:
            chan.status_event.wait(min(remaining, 1.0))  # output done; exit status pending
        else:
            select.select([chan], [], [], min(remaining, 1.0))
    if chan.exit_status_ready() and chan.exit_status != -1:
        return chan.exit_status, out, err
    if not conn.alive:
        raise _dropped(host, EOFError("connection closed before the exit status arrived"))
    # paramiko ignores "exit-signal": the command was killed by a signal.
    return -1, out, err


def _check_file_op(result: CommandResult, path: str, what: str) -> None:
    if not result.ok:
        message = (result.stderr.strip().splitlines() or [f"exit code {result.exit_code}"])[-1]
        raise TransportError(f"{what} failed: {message}", kind="file", host=result.host, path=path)


def _send_signal(chan: paramiko.Channel, name: str) -> None:
    """RFC 4254 6.9 "signal" request. paramiko has no API for it; OpenSSH ≥ 7.9 honours it."""
    try:
        message = paramiko.Message()
        message.add_byte(bytes([98]))  # SSH_MSG_CHANNEL_REQUEST
        message.add_int(chan.remote_chanid)
        message.add_string("signal")
        message.add_boolean(False)
        message.add_string(name)
        transport: Any = chan.get_transport()
        transport._send_user_message(message)
    except Exception:  # best effort: closing the channel still follows
        pass
