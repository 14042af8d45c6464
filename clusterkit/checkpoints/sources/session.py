"""One connection per node for collect-ckpt: list, hash and stream over one ``ssh``.

A :class:`NodeSession` runs the node program :mod:`clusterkit.node.ckpt.stream` in one
OpenSSH ``ssh`` process (or a local child for ``transport: local`` hosts, or one
``srun`` task for a node reached through Slurm: :mod:`clusterkit.slurm.steps`) and
keeps it open from the listing to the last byte: no second connection for hashing
or data. The stream is the same whichever process carries it.
OpenSSH rather than paramiko carries the session because bulk data is the point:
its AES-GCM runs in C with AES-NI (figures in docs/collect-ckpt.md).

Through Slurm the bytes do not ride srun's I/O forwarding (tens of MB/s): the node
program connects back to this process on a socket of its own (:class:`BackChannel`,
``ckpt.stream``'s ``socket`` request; issue 31) and everything after the request, file
bytes included, comes that way. If the node cannot connect (a firewall between the
nodes and this host), the session stays on srun's stdout and says why
(:attr:`NodeSession.fallback`); either way every byte is verified the same.

Every wait has a deadline: the connect timeout is ssh's ``ConnectTimeout``; a
watchdog kills the process when a reply (listing, hashes) takes longer than its
command timeout, or when a stream delivers no byte for ``stall`` seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import IO, Any, cast

from clusterkit.node.ckpt.stream import SOCKET_GREETING, SOCKET_TIMEOUT_S, socket_proof
from clusterkit.remote.base import DEFAULT_CONNECT_TIMEOUT_S, SSHTarget
from clusterkit.remote.command import remote_command
from clusterkit.remote.openssh import openssh_argv
from clusterkit.ship import node_command
from clusterkit.slurm.steps import SlurmPlace

PIPE_BUFFER = 1 << 20
# srun killed with SIGKILL cannot end its step or give its allocation back: it gets
# SIGTERM first (it cancels the step and leaves), SIGKILL only after this grace.
SRUN_TERM_GRACE_S = 5.0


class SessionError(Exception):
    """The session ended or misbehaved; ``str()`` carries ssh's/the node's words."""


class BackChannel:
    """The socket a Slurm session's node program connects back on (issue 31).

    Listens on every address of this host, port chosen by the kernel, for as long as
    the session may take to start; accepts the first connection that proves the
    per-run secret (``ckpt.stream``'s ``socket_proof``), proves it back, and closes the
    listener. The secret travels only in the request on the node program's stdin."""

    def __init__(self, wait_s: float) -> None:
        self.secret = secrets.token_hex(32)
        self.listener = _listen()
        self.port = int(self.listener.getsockname()[1])
        self.sock: socket.socket | None = None
        self.why = ""
        self.done = threading.Event()
        threading.Thread(target=self._accept, args=(wait_s,), daemon=True,
                         name="clusterkit-session-socket").start()

    def request(self) -> bytes:
        """``ckpt.stream``'s ``socket`` request (written to its stdin, never on argv)."""
        return json.dumps({"op": "socket", "port": self.port,
                           "secret": self.secret}).encode() + b"\n"

    def _accept(self, wait_s: float) -> None:
        try:
            self.listener.settimeout(wait_s)
            want = SOCKET_GREETING + b" " + socket_proof(self.secret, b"node", self.port)
            while self.sock is None:
                conn, _ = self.listener.accept()
                try:
                    conn.settimeout(SOCKET_TIMEOUT_S)
                    if _line(conn) != want:
                        conn.close()  # not our node: keep waiting for it
                        continue
                    conn.sendall(socket_proof(self.secret, b"collector", self.port) + b"\n")
                    conn.settimeout(None)
                except OSError:
                    conn.close()
                    continue
                self.sock = conn
        except OSError as exc:
            self.why = str(exc)
        finally:
            self.listener.close()
            self.done.set()

    def close(self) -> None:
        """Stop listening; end the data socket (a reader blocked on it returns)."""
        with contextlib.suppress(OSError):
            self.listener.close()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


def _listen() -> socket.socket:
    """A listener on every address (IPv4 and, where the host has it, IPv6)."""
    if socket.has_dualstack_ipv6():
        with contextlib.suppress(OSError):
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", 0))


def _line(conn: socket.socket) -> bytes:
    got = b""
    while not got.endswith(b"\n") and len(got) < 200:
        piece = conn.recv(200 - len(got))
        if not piece:
            break
        got += piece
    return got.strip()


class NodeSession:
    """The node program ``ckpt.stream`` on one node, spoken to request by request."""

    def __init__(self, name: str, target: SSHTarget, python: str, root: str, *,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 via: SlurmPlace | None = None) -> None:
        self.name, self.target, self.via = name, target, via
        cmd = node_command(python, "ckpt.stream", [root])
        env = None
        if via is not None:
            self.argv, env = via.argv(cmd.argv), via.env()
        else:
            self.argv = cmd.argv if target.local else collect_ssh_argv(
                target, remote_command(cmd.argv), connect_timeout)
        self._errf = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._errf, bufsize=PIPE_BUFFER,
                                     start_new_session=True, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin: IO[bytes] = self.proc.stdin
        self.stdout: IO[bytes] = self.proc.stdout
        widen_pipe(self.stdout.fileno())
        self._next_id = 0
        self._deadline = float("inf")
        self._budget = 0.0
        self.killed_why = ""
        self._write_error = ""
        self._closed = threading.Event()
        self._pipe = self.stdout
        self.back = BackChannel(self.startup_s + 120.0) if via is not None else None
        self.fallback = ""  # why a Slurm session's bytes ride srun's stdout after all
        threading.Thread(target=self._watch, daemon=True,
                         name=f"clusterkit-session-{name}").start()
        self._write(cmd.stdin)
        if self.back is not None:
            self._write(self.back.request())

    # -------------------------------------------------------------- deadlines

    @property
    def carrier(self) -> str:
        """What carries the stream, for messages: ssh, slurm or local."""
        return "slurm" if self.via is not None else "local" if self.target.local else "ssh"

    @property
    def startup_s(self) -> float:
        """Extra time the first answer may take: waiting for a Slurm allocation."""
        return self.via.startup_s if self.via is not None else 0.0

    def expect_within(self, seconds: float) -> None:
        """The next byte must arrive within ``seconds`` (called per chunk while streaming)."""
        self._deadline = time.monotonic() + seconds
        self._budget = seconds

    def _watch(self) -> None:
        while not self._closed.wait(1.0):
            if time.monotonic() > self._deadline:
                self.kill(f"no data for {self._budget:.0f} s: session killed")
                return

    # -------------------------------------------------------------- requests

    def _write(self, data: bytes) -> None:
        try:
            self.stdin.write(data)
            self.stdin.flush()
        except OSError as exc:  # the process is gone: the reader reports why
            # Its exit status and stderr say why (srun refused, ssh failed); the broken
            # pipe only when they say nothing (it raced the process's end).
            self._write_error = self._write_error or f"cannot write to the session ({exc})"

    def request(self, op: str, timeout: float, **fields: Any) -> int:
        self._next_id += 1
        self.expect_within(timeout)
        self._write(json.dumps({"op": op, "id": self._next_id, **fields}).encode() + b"\n")
        return self._next_id

    def _settle_back(self, back: BackChannel) -> None:
        """The node's answer to the ``socket`` request (its first line): read the rest
        from the socket, or stay on srun's stdout and keep why."""
        self.back = None
        line = self.stdout.readline()
        if not line:
            back.close()
            raise SessionError(self.why_ended())
        try:
            msg = json.loads(line)
        except ValueError:
            msg = {}
        if not isinstance(msg, dict) or msg.get("t") != "socket":
            back.close()
            raise SessionError(f"expected the socket answer, got {line[:200]!r}")
        if msg.get("ok") and back.done.wait(SOCKET_TIMEOUT_S + 5.0) and back.sock is not None:
            self.back = back
            self.stdout = cast(IO[bytes], back.sock.makefile("rb", buffering=PIPE_BUFFER))
            return
        back.close()
        self.fallback = str(msg.get("why") or back.why or "the node's connection was not seen")

    def read_msg(self) -> dict[str, Any]:
        if self.back is not None and self.stdout is self._pipe:
            self._settle_back(self.back)
        line = self.stdout.readline()
        if not line:
            raise SessionError(self.why_ended())
        try:
            msg = json.loads(line)
        except ValueError:
            raise SessionError(f"unreadable answer {line[:200]!r}") from None
        if not isinstance(msg, dict):
            raise SessionError(f"unreadable answer {line[:200]!r}")
        return msg

    def wait_for(self, kind: str, req_id: int) -> dict[str, Any]:
        """The answer ``kind`` to request ``req_id`` (no file frames may come first)."""
        msg = self.read_msg()
        if msg.get("t") != kind or msg.get("id") != req_id:
            raise SessionError(f"expected {kind} #{req_id}, got {str(msg)[:200]}")
        self._deadline = float("inf")
        return msg

    # -------------------------------------------------------------- ending

    def why_ended(self) -> str:
        """Exit status and the last stderr line(s): what ssh or the node said."""
        code = self.reap(5.0)
        self._errf.seek(0)
        err = " ".join(self._errf.read().decode("utf-8", "replace").split())[-300:]
        parts = [self.killed_why] if self.killed_why else []
        if not err and self._write_error:
            parts.append(self._write_error)
        parts.append(f"exit {code}" + (f": {err}" if err else ""))
        return "; ".join(parts)

    def reap(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill("did not exit")
            return self.proc.wait()

    def kill(self, why: str = "") -> None:
        self.killed_why = self.killed_why or why
        if self.back is not None:  # a reader blocked on the socket returns now
            self.back.close()
        if self.via is not None and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            timer = threading.Timer(SRUN_TERM_GRACE_S, self._signal, (signal.SIGKILL,))
            timer.daemon = True
            timer.start()
            return
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        """Say bye and reap; a session that does not leave within 10 s is killed."""
        with contextlib.suppress(OSError, ValueError):
            self.stdin.write(b'{"op": "bye"}\n')
            self.stdin.close()
        self.reap(10.0)
        self._closed.set()
        if self.back is not None:
            self.back.close()
        for f in {self.stdout, self._pipe, self._errf}:
            with contextlib.suppress(OSError):
                f.close()


def widen_pipe(fd: int) -> None:
    """A 1 MiB pipe instead of 64 KiB: 16x fewer wake-ups between ssh and us per MB.
    Best effort (F_SETPIPE_SZ is Linux; the limit is /proc/sys/fs/pipe-max-size)."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BUFFER)


def collect_ssh_argv(target: SSHTarget, command: str,
                     connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> list[str]:
    """The one OpenSSH argv (:func:`clusterkit.remote.openssh.openssh_argv`) with collect's
    data-path choices: compression off (shards are float tensors, which do not compress,
    and zlib would cap one stream at tens of MB/s) and the ciphers below."""
    return openssh_argv(target, command, connect_timeout=connect_timeout,
                        extra={"Compression": "no", "Ciphers": SSH_CIPHERS})


# Fastest first on this class of machine (AES-NI + VAES: measured in docs/collect-ckpt.md);
# every OpenSSH since 6.2 offers one of these.
SSH_CIPHERS = ("aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,"
               "aes128-ctr,aes256-ctr")
