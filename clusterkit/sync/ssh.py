"""The launcher's half of feeding a node over its SSH session (``clusterkit sync`` where
this machine cannot reach the node's port): the records of node/sync/wire.py written to
the node program's stdin, and the launcher's control messages kept whole between them."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

from clusterkit.errors import TransportError
from clusterkit.node.sync.wire import CTRL, header
from clusterkit.remote.base import RemoteProcess

PIECE = 1 << 20  # one stdin write: the launcher's memory stays bounded


class StdinOut:
    """One node program's stdin: control lines, then (``feed``) records until END.

    Every write goes under one lock, a record whole: a control message that comes while
    records flow travels as a CTRL record between two of them."""

    def __init__(self, proc: RemoteProcess) -> None:
        self.proc = proc
        self.lock = threading.Lock()
        self.mode = "lines"  # -> "records" (feeding) -> "lines" (END sent) | "broken"

    def say(self, msg: dict[str, Any]) -> None:
        payload = json.dumps(msg).encode()
        with self.lock, contextlib.suppress(TransportError):
            if self.mode == "records":
                self.proc.write_stdin(header(0, CTRL, 0, len(payload), ()) + payload)
            elif self.mode == "lines":
                self.proc.write_stdin(payload + b"\n")

    def start_feed(self) -> None:
        with self.lock:
            self.proc.write_stdin(b'{"op": "feed"}\n')
            self.mode = "records"

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """One record written whole; a failure inside leaves the stream unusable."""
        with self.lock:
            try:
                yield
            except BaseException:
                self.mode = "broken"
                raise

    def end_feed(self, end_record: bytes) -> None:
        with self.record():
            self.proc.write_stdin(end_record)
            self.mode = "lines"

    # the socket calls the launcher's record stream makes (engine._Run._stream)
    def sendall(self, data: bytes) -> None:
        self._write(bytes(data))

    def sendfile(self, fh: Any, offset: int, count: int) -> int:
        fh.seek(offset)
        done = 0
        while done < count:
            data = fh.read(min(PIECE, count - done))
            if not data:
                break
            self._write(data)
            done += len(data)
        return done

    def _write(self, data: bytes) -> None:
        try:
            self.proc.write_stdin(data)
        except TransportError as exc:
            raise OSError(f"the SSH session's stdin: {exc.message}") from exc
