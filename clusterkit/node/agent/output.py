"""The node agent's output: label each line, log it, send it, spot the first failure.

Part of the node agent (:mod:`clusterkit.node.agent.core`; node program ``agent.core``, whose
module list in :mod:`clusterkit.ship` names this file). It holds everything
between a line a rank or launcher printed and the launcher's console: reading the
launchers' rank labels (torchrun's ``[default0]:``, pdsh's ``node3: ``), following
DeepSpeed's per-rank log files, the per-node log files, the one writer thread to the
SSH session, and the launchers' own failure reports. What it sends::

    @ck:L <node> <local-rank|-> <text>     protocol.Line: one output line of a rank or launcher
    @ck:E {"ev": ...}                      one protocol.AgentEvent (Started, RankFailed, ...)

Every line also lands in ``<job_dir>/nodes/<node>/rank<R>.log`` (or ``launcher.log``).
Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from clusterkit.node import protocol
from clusterkit.node.contract import node_log_name
from clusterkit.node.protocol import AgentSpec

# torchrun --tee 3: "[default0]:text"; pdsh: "node3: text".
_TORCHRUN_LINE = re.compile(r"^\[[A-Za-z_]*?(\d+)\]:(.*)$")
_PDSH_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*): (.*)$")
# torchrun: "... failed (exitcode: -9) local_rank: 1 (pid: 20825) of binary: ..."
_TORCHRUN_FAIL = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# deepspeed.launcher.launch: "[... '--local_rank=1', ...] exits with return code = -9"
_DS_FAIL = re.compile(r"--local_rank=(\d+).*exits with return code = (-?\d+)")
# pdsh: "pdsh@node1: node5: ssh exited with exit code 1"
_PDSH_FAIL = re.compile(r"^pdsh@\S+: (\S+): \S+ exited with exit code (\d+)")
_RANK_LOG = re.compile(r"_rank(\d+)\.log$")


def tee_parts(line: str) -> list[str]:
    """torchrun's tee glues a rank's line that ends without a newline (a tqdm progress
    bar's carriage-return update) to the next line it reads, often another rank's:
    ``[default0]: 10%|...| 6/60 [...][default1]:text`` is two lines, each with its label."""
    m = _TORCHRUN_LINE.match(line)
    if m is None:
        return [line]
    label = re.compile(re.escape(line[:m.start(1)]) + r"(\d+)\]:")
    # Only another rank's label starts a new line: the same rank's header again is
    # torchrun's half-written line read in two parts (classify() joins those).
    cuts, rank = [0], m.group(1)
    for c in label.finditer(line, m.end(1)):
        if c.group(1) != rank:
            cuts.append(c.start())
            rank = c.group(1)
    ends = [*cuts[1:], len(line)]
    return [line[cuts[i]:ends[i]] for i in range(len(cuts))]


class RankLogTail:
    """Follow ``<dir>/*_rank<R>.log`` (DeepSpeed's per-rank logs) as complete lines."""

    def __init__(self, directory: str, want: Any = None) -> None:
        self.directory = directory
        self.want = want or (lambda rank: True)  # which ranks' files to follow
        self._files: dict[str, tuple[int, IO[bytes]]] = {}
        self._partial: dict[str, bytes] = {}

    def poll(self, final: bool = False) -> list[tuple[int, str]]:
        """(global rank, line) of every line completed since the last poll."""
        out: list[tuple[int, str]] = []
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(self.directory)):
                m = _RANK_LOG.search(name)
                if m and name not in self._files and self.want(int(m.group(1))):
                    with contextlib.suppress(OSError):
                        self._files[name] = (int(m.group(1)),
                                             open(os.path.join(self.directory, name), "rb"))  # noqa: SIM115
        for name, (rank, fh) in self._files.items():
            data = self._partial.pop(name, b"") + fh.read()
            *lines, rest = data.split(b"\n")
            if rest and final:
                lines.append(rest)
            elif rest:
                self._partial[name] = rest
            out += [(rank, ln.decode("utf-8", "replace").rstrip("\r")) for ln in lines]
        return out

    def close(self) -> None:
        for _, fh in self._files.values():
            fh.close()


class AgentOutput:
    """One agent's output side: ``out`` is its stdout (the SSH session to the launcher).

    ``on_stop(reason)`` is the agent's stop request: a node that pdsh reports failed
    ends the job right here (see :meth:`watch_failure`)."""

    def __init__(self, spec: AgentSpec, node_dir: str, out: IO[str],
                 on_stop: Callable[[str], None]) -> None:
        self.spec = spec
        self.node_dir = node_dir
        self.out = out
        self._on_stop = on_stop
        self._out_ok = True
        # Set when the keepalive is lost: behind a partition a write to the session
        # blocks, so nothing more is sent (the log files keep everything).
        self.silenced = False
        self.lock = threading.Lock()
        self._logs: dict[str, IO[str]] = {}
        self.failure_sent = False
        self.tail_done = threading.Event()
        self.last_line: dict[int, float] = {}  # global rank -> time of its last output line
        # Output goes through one writer thread: behind a network partition a write to
        # the SSH session blocks, and nothing else (the teardown) may wait on it.
        self._outq: queue.Queue[str] = queue.Queue()
        self._threaded = False  # see start_writer

    def start_writer(self) -> None:
        """From now on output goes through a writer thread (the real agent, not tests)."""
        self._threaded = True
        threading.Thread(target=self._writer, daemon=True, name="agent-out").start()

    def emit_raw(self, line: str) -> None:
        if not self._out_ok or self.silenced:
            return
        if self._threaded:
            self._outq.put(line)
            return
        with self.lock:
            try:
                self.out.write(line + "\n")
                self.out.flush()
            except (OSError, ValueError):
                self._out_ok = False

    def _writer(self) -> None:
        while True:
            line = self._outq.get()
            try:
                self.out.write(line + "\n")
                if self._outq.empty():
                    self.out.flush()
            except (OSError, ValueError):
                self._out_ok = False  # the launcher is gone; keep writing log files

    def drain(self, timeout: float = 5.0) -> None:
        """Give the writer a moment to send what is queued (the exit event)."""
        deadline = time.monotonic() + timeout
        while not self._outq.empty() and self._out_ok and not self.silenced \
                and time.monotonic() < deadline:
            time.sleep(0.02)

    def send(self, msg: protocol.Message) -> None:
        """One typed message (``protocol.encode``) to the launcher."""
        self.emit_raw(protocol.encode(msg))

    def _log(self, name: str, text: str) -> None:  # the caller holds self.lock
        fh = self._logs.get(name)
        if fh is None:
            fh = open(os.path.join(self.node_dir, name), "a", encoding="utf-8")  # noqa: SIM115
            self._logs[name] = fh
        fh.write(text + "\n")
        fh.flush()

    def log(self, name: str, text: str) -> None:
        """One line into this node's log file ``name`` only (not to the console)."""
        with self.lock:
            self._log(name, text)

    def close(self) -> None:
        for fh in self._logs.values():
            fh.close()

    def handle_line(self, line: str) -> None:
        for part in tee_parts(line):
            self._handle_part(part)

    def _handle_part(self, line: str) -> None:
        node, lrank, text = self.classify(line)
        offset = self.spec.rank_offsets.get(node)
        if lrank is not None and offset is not None:
            log_name = node_log_name(offset + lrank)
        else:
            log_name = node_log_name(None) if node == self.spec.node else f"{node}.log"
        self.log(log_name, text)
        if lrank is not None and offset is not None:
            self.last_line[offset + lrank] = time.monotonic()
        self.send(protocol.Line(node, lrank, text))
        self.watch_failure(node, text)

    def handle_rank_line(self, rank: int, text: str) -> None:
        """A line read from a rank's own log file on this node (global rank known)."""
        offset = self.spec.rank_offsets.get(self.spec.node, 0)
        self.log(node_log_name(rank), text)
        self.last_line[rank] = time.monotonic()
        self.send(protocol.Line(self.spec.node, rank - offset, text))

    def tail_rank_logs(self, directory: str) -> None:
        """Until ``tail_done``: stream DeepSpeed's per-rank log files as rank lines."""
        tail = RankLogTail(directory, self._my_ranks())
        try:
            while not self.tail_done.wait(0.2):
                for rank, text in tail.poll():
                    self.handle_rank_line(rank, text)
            for rank, text in tail.poll(final=True):
                self.handle_rank_line(rank, text)
        finally:
            tail.close()

    def _my_ranks(self) -> Any:
        """On a shared job dir every node's rank files meet in one directory: keep ours."""
        first = self.spec.rank_offsets.get(self.spec.node, 0)
        later = [o for o in self.spec.rank_offsets.values() if o > first]
        end = min(later) if later else None
        return lambda rank: rank >= first and (end is None or rank < end)

    def classify(self, line: str) -> tuple[str, int | None, str]:
        """(node, local rank or None, text) of a launcher's output line."""
        node, text = self.spec.node, line
        if self.spec.prefix == "pdsh":
            m = _PDSH_LINE.match(text)
            if m and m.group(1) in self.spec.rank_offsets:
                node, text = m.group(1), m.group(2)
        if self.spec.prefix == "single":
            return node, 0, text
        m = _TORCHRUN_LINE.match(text)
        if m:
            # torchrun's tee (tail_logfile) reads a rank's log with readline(): a line
            # caught half-written comes out in two parts, the second with the header again.
            return node, int(m.group(1)), m.group(2).replace(text[:m.start(2)], "")
        return node, None, text

    def watch_failure(self, node: str, text: str) -> None:
        """Name the first rank that failed, from the launchers' own reports."""
        if self.failure_sent:
            return
        m = _TORCHRUN_FAIL.search(text)
        if m:
            self.rank_failed(node, int(m.group(2)), int(m.group(1)))
            return
        m = _DS_FAIL.search(text)
        if m:
            self.rank_failed(node, int(m.group(1)), int(m.group(2)))
            return
        m = _PDSH_FAIL.match(text)
        if m:
            self.rank_failed(m.group(1), None, int(m.group(2)))
            # DeepSpeed's runner keeps waiting for the other nodes, which hang in their
            # collectives (DeepSpeed#1995): a failed node ends the job right here.
            self._on_stop("pdsh-node-failed")

    def rank_failed(self, node: str, lrank: int | None, code: int) -> None:
        self.failure_sent = True
        offset = self.spec.rank_offsets.get(node)
        rank = offset + lrank if (offset is not None and lrank is not None) else None
        self.send(protocol.RankFailed(self.spec.node, failed_node=node, local_rank=lrank,
                                      rank=rank, code=code))
