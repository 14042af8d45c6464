"""Follow a Slurm job: show its output files as they grow, folded, until the job ends.

The files are read where the submit host sees them (the job directory must be on
a filesystem the nodes share, as for any batch job). clusterkit's script opens its
files with ``--open-mode=append``, so a requeued run continues the same file after a
``===== clusterkit: ... run N`` line; a script that truncates instead (a site template
without it) makes the file shrink, which we notice and start over instead of going silent.

What the watch shows is the console of ``clusterkit launch`` (:mod:`clusterkit.fold`):
a line that several ranks print alike appears once as ``[r0-13] text``, known
third-party noise once per job, only the ``--ranks`` selected ranks' lines, and rank
0's summary line once at the end. Who wrote a line comes from the labels the batch
script puts there (:mod:`clusterkit.slurm.ranklines`). The files keep every line.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

from clusterkit.fold import Folded, LineFolder, fold_key, rank_label
from clusterkit.hostrange import HostRangeError, expand_list
from clusterkit.node.contract import SUMMARY_PREFIX, JobDir
from clusterkit.slurm.client import SlurmClient
from clusterkit.slurm.jobinfo import JobInfo
from clusterkit.slurm.ranklines import (
    JobShape,
    LabelJoiner,
    RankLine,
    node_of_rank,
    parse_labelled,
    parse_shape,
    rank_of_file,
)

CHUNK = 1 << 16
# How long a rank line waits for the other ranks' copies. Longer than the launch
# console's FOLD_WINDOW_S: measured on the Slurm test bed (2 x 2, CPU), the ranks print
# the same start-up warning up to 3.7 s apart, and a batch job's watch can afford the
# wait. A line every rank said leaves as soon as the last one said it.
WATCH_WINDOW_S = 5.0
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def line_shape(text: str) -> str:
    """A line with its numbers blanked: ``step 3 loss 0.41`` and ``step 4 loss 0.40`` alike."""
    return _NUMBER.sub("#", fold_key(text))


# Lines the batch script (and its watchdog) write to both the .out and the .err file.
BOTH_FILES = ("===== clusterkit: ", "clusterkit: ")
# A summary line that never parses (not ours after all) is shown as it is past this size.
MAX_SUMMARY_CHARS = 1 << 20


@dataclass
class _Follower:
    path: str
    offset: int = 0
    pending: bytes = field(default=b"")
    joiner: LabelJoiner = field(default_factory=LabelJoiner)  # srun --label's cut lines

    def pump(self, final: bool = False) -> list[str]:
        """The new whole lines, each with its newline (at the end also an unfinished one)."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []  # not created yet (pending job) or not visible here yet
        if size < self.offset:  # shrank: a requeued run truncated it
            self.offset, self.pending = 0, b""
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            while chunk := fh.read(CHUNK):
                self.offset += len(chunk)
                self.pending += chunk
        # Whole lines only (a rank's line is not split across two polls), the rest at the end.
        cut = len(self.pending) if final else self.pending.rfind(b"\n") + 1
        text, self.pending = self.pending[:cut].decode(errors="replace"), self.pending[cut:]
        return text.splitlines(keepends=True)


class _Stream:
    """One console stream (stdout or stderr): rank lines through a folder, the rest as is."""

    def __init__(self, sink: TextIO, folder: LineFolder) -> None:
        self.sink = sink
        self.folder = folder
        # (rank, line shape) of lines only that rank printed (rank 0's progress lines):
        # learned from the first one, which waited out the fold window; the next ones
        # leave at once instead of a window late (numbers do not change a shape).
        self.solo: set[tuple[int, str]] = set()

    def rank(self, line: RankLine, now: float) -> None:
        assert line.node is not None and line.rank is not None
        wanted = self.folder.ranks is None or line.rank in self.folder.ranks
        if wanted and (line.rank, line_shape(line.text)) in self.solo:
            self._show(self.folder.release(now, final=True))  # what came before it, first
            self.write(Folded(label=rank_label((line.rank,), (line.node,)), text=line.text,
                              nodes=(line.node,), ranks=(line.rank,)).render() + "\n")
            return
        self._show(self.folder.feed(line.node, line.rank, line.text, now))

    def node(self, node: str, text: str) -> None:
        """A launcher's own line (torchrun on one node): not folded, but noise once per job."""
        if self.folder.show_once(text):
            self.write(f"[{node}] {text}\n")

    def script(self, raw: str, now: float) -> None:
        # The batch script speaks between the ranks' lines (start, USR1, requeue): after
        # what the ranks said before it.
        self.release(now, final=True)
        self.write(raw)

    def release(self, now: float, final: bool = False) -> None:
        self._show(self.folder.release(now, final=final))

    def _show(self, items: list[Folded]) -> None:
        for item in items:
            if len(item.ranks) == 1:
                self.solo.add((item.ranks[0], line_shape(item.text)))
            self.write(item.render() + "\n")

    def write(self, text: str) -> None:
        self.sink.write(text)
        self.sink.flush()


class _Console:
    """Lines of every followed file -> the two folded streams; the summary kept for last."""

    def __init__(self, out: TextIO, err: TextIO, window_s: float,
                 ranks: frozenset[int] | None) -> None:
        self.out = _Stream(out, LineFolder(window_s, ranks=ranks))
        self.err = _Stream(err, LineFolder(window_s, ranks=ranks))
        self.shape: JobShape | None = None
        self.summary: str | None = None
        # Rank 0's summary line that does not parse yet, and who writes its rest: srun
        # cuts a long line at its own message boundaries (not only at 1024 bytes), and the
        # rest comes on that task's next lines, without the [rank0]: header.
        self._cut: tuple[_Stream, str | None, str] | None = None
        self._said: dict[str, _Stream] = {}  # script lines shown, awaiting their other copy

    def line(self, raw: str, stream: _Stream, nodes: list[str], file_rank: int | None,
             now: float) -> None:
        text = raw.rstrip("\r\n")
        if file_rank is not None:  # one file per rank: the file names the rank
            parsed = RankLine(node_of_rank(file_rank, nodes, self.shape), file_rank, text)
        else:
            parsed = parse_labelled(text, nodes, self.shape)
        if self._cut is not None and self._cut[:2] == (stream, parsed.node):
            self._summary_piece(self._cut[2] + parsed.text)
        elif parsed.node is None:
            self._script_line(raw, text, stream, now)
        elif parsed.rank is None:
            stream.node(parsed.node, parsed.text)
        elif parsed.text.startswith(SUMMARY_PREFIX):
            if parsed.rank == 0:  # the bundled workload's rank 0 ends with it: shown once, last
                self._cut = (stream, parsed.node, "")
                self._summary_piece(parsed.text)
        else:
            stream.rank(parsed, now)

    def _summary_piece(self, text: str) -> None:
        if _parses(text[len(SUMMARY_PREFIX):]) or len(text) > MAX_SUMMARY_CHARS:
            self.summary, self._cut = text, None
        else:
            assert self._cut is not None
            self._cut = (*self._cut[:2], text)

    def _script_line(self, raw: str, text: str, stream: _Stream, now: float) -> None:
        if text.startswith(BOTH_FILES):
            # The script writes its run headers and verdicts (requeue, hang, nothing saved)
            # to both files, each of which must say it; the console shows each once.
            other = self._said.pop(text, None)
            if other is not None and other is not stream:
                return
            self._said[text] = stream
        shape = parse_shape(text)
        if shape is not None:
            self.shape = shape
            # A line all ranks said leaves at once instead of after the window.
            self.out.folder.world_size = self.err.folder.world_size = shape.world_size
        stream.script(raw, now)

    def release(self, now: float, final: bool = False, saved: str | None = None) -> None:
        """``saved``: the summary file's object, when the run wrote one (it beats the line)."""
        self.out.release(now, final)
        self.err.release(now, final)
        if final and self._cut is not None:
            self.summary, self._cut = self._cut[2], None
        if final and saved is not None:
            self.summary = SUMMARY_PREFIX + saved
        if final and self.summary is not None:
            self.out.write(self.summary + "\n")
            self.summary = None


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def summary_file(info: JobInfo) -> str | None:
    """Where the bundled workload saved its summary: ``<job dir>/run/summary.json``,
    the job dir being the parent of clusterkit's ``<job dir>/logs/`` output files."""
    logs = os.path.dirname(info.stdout) if info.stdout else ""
    if os.path.basename(logs) != JobDir.LOGS:
        return None  # not a script clusterkit wrote
    return os.path.join(os.path.dirname(logs), JobDir.RUN, JobDir.SUMMARY)


def _saved_summary(info: JobInfo, watch_started: float) -> str | None:
    """The summary file's object as one line, if this run of the job wrote it."""
    path = summary_file(info)
    started = info.started_at
    # A second of slack: StartTime has whole seconds; some filesystems' mtimes are coarse.
    since = (watch_started if started is None else started) - 1.0
    try:
        if path is None or os.path.getmtime(path) < since:
            return None  # none, or left by an earlier job in the same job dir
        with open(path, encoding="utf-8") as fh:
            return json.dumps(json.load(fh), sort_keys=True)
    except (OSError, ValueError):
        return None


def _node_names(info: JobInfo) -> list[str]:
    try:
        return expand_list(info.nodes) if info.nodes and info.nodes != "(null)" else []
    except HostRangeError:
        return []


def rank_logs(info: JobInfo) -> Iterator[tuple[int, str]]:
    """(rank, path) of each file a one-task-per-rank step writes (``srun
    --output=.../%x-%j-rank%t.out``, the deepspeed variant): next to StdOut, by rank."""
    if not info.stdout:
        return
    folder = os.path.dirname(info.stdout)
    prefix = f"{info.name}-{info.job_id}-rank"
    try:
        names = os.listdir(folder)
    except OSError:
        return
    found = ((rank_of_file(n), n) for n in names if n.startswith(prefix))
    yield from sorted((r, os.path.join(folder, n)) for r, n in found if r is not None)


def _state_lines(info: JobInfo, job_id: str, last: tuple[str, int], err: TextIO) -> tuple[str, int]:
    state, restarts = last
    if info.state != state:
        err.write(f"clusterkit: job {job_id} {info.state}"
                  + (f" on {info.nodes}" if info.state == "RUNNING" else "") + "\n")
        err.flush()
    if info.restarts != restarts:
        err.write(f"clusterkit: job {job_id} was requeued (restart {info.restarts})\n")
    return info.state, info.restarts


def watch(client: SlurmClient, job_id: str, out: TextIO, err: TextIO, *, poll_s: float = 1.0,
          ranks: frozenset[int] | None = None, sleep: Callable[[float], None] = time.sleep,
          clock: Callable[[], float] = time.monotonic) -> JobInfo:
    """Follow ``job_id`` until it reaches a terminal state; return its final record.

    Follows StdOut and StdErr, and every rank's own file when the ranks write per-rank
    files. ``ranks``: whose lines are shown (None: all)."""
    # A line reaches us up to one poll late: the window covers a poll on top.
    console = _Console(out, err, WATCH_WINDOW_S + poll_s, ranks)
    started = time.time()
    followers: dict[str, tuple[_Follower, _Stream, int | None]] = {}
    last = ("", 0)
    while True:
        info = client.show(job_id)
        last = _state_lines(info, job_id, last, err)
        wanted = [(info.stdout, console.out, None), (info.stderr, console.err, None),
                  *((path, console.out, rank) for rank, path in rank_logs(info))]
        for path, stream, rank in wanted:
            if path and path not in followers:
                followers[path] = (_Follower(path), stream, rank)
        nodes, now = _node_names(info), clock()
        for follower, stream, rank in followers.values():
            lines = [whole for raw in follower.pump(final=info.finished)
                     for whole in follower.joiner.feed(raw)]
            if info.finished:
                lines += follower.joiner.flush()
            for raw in lines:
                console.line(raw, stream, nodes, rank, now)
        saved = _saved_summary(info, started) if info.finished else None
        console.release(now, final=info.finished, saved=saved)
        if info.finished:
            return info
        sleep(poll_s)
