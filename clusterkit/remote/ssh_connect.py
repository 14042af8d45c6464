"""paramiko connections: TCP under deadlines, ProxyJump tunnels, the handshake's errors.

Every way a connection can fail before authentication becomes one
:class:`TransportError` with a ``kind`` (docs/ssh.md) and a message that names the
port but not the host, so reports fold identical failures of many hosts. The
:class:`Connection` (one per target, with its lazy SFTP session) lives here too.
Used by :mod:`clusterkit.remote.ssh`, the transport.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import socket
import threading
import time
from typing import Any

import paramiko
from paramiko.ssh_exception import IncompatiblePeer

from clusterkit.errors import TransportError
from clusterkit.remote import hostkeys
from clusterkit.remote.sshconfig import Endpoint

# Linux: abort the TCP connection when sent data (our keepalives) stays unacked this
# long, so a vanished peer surfaces as a dropped connection instead of a 15-minute hang.
TCP_USER_TIMEOUT_MS = 20_000


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


OPEN_FAILURES = _OpenFailures()
LOG_IDS = itertools.count()
# paramiko logs handshake failures with tracebacks at ERROR; every failure already
# reaches the user as one TransportError line, so keep its log out of the app's.
logging.getLogger("paramiko").addHandler(OPEN_FAILURES)
logging.getLogger("paramiko").propagate = False


def quietly(fn: Any) -> None:
    # Cleanup on an already-failing path: the first error is the one to report.
    with contextlib.suppress(Exception):
        fn()


class Connection:
    """One authenticated SSH connection plus its lazily opened SFTP session."""

    def __init__(self, endpoint: Endpoint, transport: paramiko.Transport) -> None:
        self.endpoint = endpoint
        self.transport = transport
        self.lock = threading.Lock()  # serialises SFTP use
        self._sftp: paramiko.SFTPClient | None = None

    def reset_sftp(self) -> None:
        if self._sftp is not None:
            quietly(self._sftp.close)
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
        OPEN_FAILURES.last.pop(self.transport.get_log_channel(), None)


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


def tcp_connect(ep: Endpoint, timeout: float) -> socket.socket:
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
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)


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


def open_tunnel(bastion: Connection, ep: Endpoint, timeout: float) -> paramiko.Channel:
    where = _where(ep)
    via = bastion.endpoint.label
    try:
        chan = bastion.transport.open_channel(
            "direct-tcpip", (ep.hostname, ep.port), ("127.0.0.1", 0), timeout=timeout
        )
    except paramiko.ChannelException as exc:
        reason = OPEN_FAILURES.last.get(bastion.transport.get_log_channel(), str(exc.text))
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


def prefer_known_key_types(transport: paramiko.Transport, ep: Endpoint) -> None:
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


def handshake_error(exc: BaseException, ep: Endpoint, timeout: float, *,
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
