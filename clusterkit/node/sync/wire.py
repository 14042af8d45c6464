"""The wire of the node program ``sync.chain`` (node/sync/chain.py): the TCP handshake, the record
header, and the SSH session's stdin as an upstream.

The wire's handshake (one TCP connection per hop): server ``CKDIST1 <nonce> <index>``;
client ``<mode> <nonce> <mac>`` with mac = HMAC-SHA256(secret, "c" nonce_s nonce_c
mode), mode ``feed`` or ``probe``; server ``<mac'> <next seq>`` with mac' =
HMAC(secret, "s" nonce_c nonce_s). Either side that cannot verify closes at once.

Where the launcher cannot reach a node's port at all (a firewall that lets only SSH in),
it streams the same records over that node's SSH session instead: the control line
``{"op": "feed"}`` switches the node's stdin to records (:class:`StdinUp`); the node
answers ``{"ev": "feed-from", "seq"}`` (what the handshake's ``<next seq>`` says on TCP),
and launcher control messages travel as :data:`CTRL` records until the END record.
SSH authenticates that stream; the per-run secret is not needed on it.
Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
from typing import Any

from clusterkit.node.hashing import mac

GREETING = b"CKDIST1"
HDR = struct.Struct("!IIIIH")  # seq, file index, chunk index, length, number of targets
END = 0xFFFFFFFF
CTRL = 0xFFFFFFFE  # a control message inside a stdin feed (payload: one JSON object)
CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 60.0
PROGRESS_S = 0.5
PORT_TRIES = 16


class WireError(Exception):
    """A hop that failed (said in an event's ``why``)."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise WireError("connection closed")
        buf += got
    return bytes(buf)


def read_line(sock: socket.socket, limit: int = 4096) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        got = sock.recv(1)
        if not got or len(buf) > limit:
            raise WireError("connection closed during the handshake")
        buf += got
    return bytes(buf[:-1])


def dial(address: str, port: int, secret: str, mode: str = "feed",
         timeout: float = CONNECT_TIMEOUT_S) -> tuple[socket.socket, int]:
    """Connect to a node's listener and authenticate both ways; the socket and the first
    record seq the node wants."""
    key = secret.encode()
    sock = socket.create_connection((address, port), timeout=timeout)
    try:
        word, nonce_s, _index = read_line(sock).split(b" ")
        if word != GREETING:
            raise WireError("not a clusterkit sync listener")
        nonce_c = secrets.token_hex(16).encode()
        sock.sendall(b"%s %s %s\n" % (mode.encode(), nonce_c,
                                      mac(key, b"c", nonce_s, nonce_c, mode.encode()).encode()))
        their, seq = read_line(sock).split(b" ")
        if not hmac.compare_digest(their.decode(), mac(key, b"s", nonce_c, nonce_s)):
            raise WireError("the listener does not hold this run's secret")
        sock.settimeout(IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, int(seq)
    except (OSError, ValueError, WireError):
        sock.close()
        raise


def header(seq: int, fi: int, ci: int, length: int, to: Any) -> bytes:
    to = list(to)
    return HDR.pack(seq, fi, ci, length, len(to)) + struct.pack(f"!{len(to)}H", *to)



class StdinUp:
    """The SSH session's stdin (a binary reader) read as an upstream socket would be."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def recv(self, n: int) -> bytes:
        return bytes(self.reader.read1(n))

    def recv_into(self, buf: Any) -> int:
        return int(self.reader.readinto1(buf))

    def settimeout(self, _t: float) -> None:
        """SSH's keepalive bounds the session; nothing to set."""

    def sendall(self, _data: Any) -> None:
        """The launcher learns the next seq from the ``feed-from`` event instead."""

    def shutdown(self, _how: int) -> None:
        """A TCP upstream replacing this one: the launcher's stream simply stops."""

    def close(self) -> None:
        """Stdin stays open: control lines follow the END record."""
