"""Line splitting shared by the SSH and local :class:`RemoteProcess` implementations.

Readers (threads owned by the process object) feed raw bytes per stream; consumers
iterate ``(stream, line)`` pairs. The queue is unbounded on purpose: the reader
must keep draining the channel/pipe even when nobody iterates, otherwise the
remote side blocks on a full window and ``wait()`` would deadlock.
"""

from __future__ import annotations

import codecs
import queue
import threading
from collections.abc import Iterator

_EOF = object()


class LineQueue:
    def __init__(self, streams: tuple[str, ...] = ("stdout", "stderr")) -> None:
        self._queue: queue.Queue[object] = queue.Queue()
        self._open = set(streams)
        self._pending = {s: "" for s in streams}
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")(errors="replace") for s in streams}
        self._lock = threading.Lock()
        self.done = threading.Event()

    def feed(self, stream: str, data: bytes) -> None:
        with self._lock:
            text = self._pending[stream] + self._decoders[stream].decode(data)
            *complete, self._pending[stream] = text.split("\n")
        for line in complete:
            self._queue.put((stream, line.removesuffix("\r")))

    def close(self, stream: str) -> None:
        with self._lock:
            if stream not in self._open:
                return
            self._open.discard(stream)
            rest = self._pending[stream] + self._decoders[stream].decode(b"", final=True)
            self._pending[stream] = ""
            last = not self._open
        if rest:
            self._queue.put((stream, rest))
        if last:
            self._queue.put(_EOF)
            self.done.set()

    def close_all(self) -> None:
        for stream in list(self._open):
            self.close(stream)

    def lines(self) -> Iterator[tuple[str, str]]:
        """Yield lines until every stream hit EOF. Single consumer."""
        while True:
            item = self._queue.get()
            if item is _EOF:
                self._queue.put(_EOF)  # a second iteration ends at once too
                return
            assert isinstance(item, tuple)
            yield item
