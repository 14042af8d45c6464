"""Commands on a paramiko channel: feeding stdin, collecting both streams under a
deadline, the streamed :class:`SSHProcess`, and the RFC 4254 signal request. A channel
whose connection died is a :class:`TransportError` of kind ``channel`` (``dropped_error``)."""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Iterator
from typing import Any

import paramiko

from clusterkit.errors import TransportError
from clusterkit.remote.base import CommandResult
from clusterkit.remote.ssh_connect import Connection, quietly
from clusterkit.remote.streams import LineQueue

READ_CHUNK = 65536


class SSHProcess:
    """A streamed remote command (:class:`~clusterkit.remote.base.RemoteProcess`)."""

    def __init__(self, host: str, chan: paramiko.Channel, conn: Connection) -> None:
        self.host = host
        self._chan = chan
        self._conn = conn
        self._lines = LineQueue()
        self._code: int | None = None
        self._finished = threading.Event()
        self.dropped = False  # True when the connection, not the command, ended it
        self._terminated = False  # terminate() called: we ended it, whatever it answers
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
        if chan.exit_status_ready() and chan.exit_status != -1 and not self._terminated:
            self._code = chan.exit_status
        else:
            self._code = -1
            self.dropped = not self._conn.alive
        quietly(chan.close)
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
            raise dropped_error(self.host, exc) from exc

    def close_stdin(self) -> None:
        quietly(self._chan.shutdown_write)

    def terminate(self) -> None:
        """Ask sshd to SIGTERM the command (RFC 4254 "signal"), then close the channel.

        The code is then -1, as for a dropped channel: sshd may refuse the signal, and
        the command, its stdin closed with the channel, may still answer a status of its
        own first (``cat`` exits 0 on that EOF), or not, depending on timing."""
        self._terminated = True
        send_signal(self._chan, "TERM")
        quietly(self._chan.close)


def dropped_error(host: str, exc: BaseException) -> TransportError:
    return TransportError(
        f"connection dropped ({exc or type(exc).__name__})",
        kind="channel",
        host=host,
        hint="the host rebooted, sshd restarted, or the network went away; retry",
    )


def feed_stdin(chan: paramiko.Channel, data: bytes | None) -> None:
    if data is None:
        chan.shutdown_write()
        return

    # A separate writer so a command that prints before reading cannot deadlock us.
    def write() -> None:
        try:
            chan.sendall(data)
        except (OSError, paramiko.SSHException):
            return  # the reader sees the closed channel and reports it
        quietly(chan.shutdown_write)

    threading.Thread(target=write, daemon=True, name="clusterkit-stdin").start()


def _drain(chan: paramiko.Channel, sink: LineQueue | tuple[bytearray, bytearray]) -> bool:
    got = False
    while chan.recv_ready():
        data = chan.recv(READ_CHUNK)
        if not data:
            break
        got = True
        if isinstance(sink, LineQueue):
            sink.feed("stdout", data)
        else:
            sink[0].extend(data)
    while chan.recv_stderr_ready():
        data = chan.recv_stderr(READ_CHUNK)
        if not data:
            break
        got = True
        if isinstance(sink, LineQueue):
            sink.feed("stderr", data)
        else:
            sink[1].extend(data)
    return got


def collect_output(
    chan: paramiko.Channel, conn: Connection, deadline: float, host: str, timeout: float
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
        raise dropped_error(host, EOFError("connection closed before the exit status arrived"))
    # paramiko ignores "exit-signal": the command was killed by a signal.
    return -1, out, err


def check_file_op(result: CommandResult, path: str, what: str) -> None:
    if not result.ok:
        message = (result.stderr.strip().splitlines() or [f"exit code {result.exit_code}"])[-1]
        raise TransportError(f"{what} failed: {message}", kind="file", host=result.host, path=path)


def send_signal(chan: paramiko.Channel, name: str) -> None:
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
