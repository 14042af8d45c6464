"""Fold identical lines from many ranks into one line with a rank range.

At 7 x 2 ranks every rank prints the same start-up warnings; shown per rank they
bury the first useful line. :class:`LineFolder` holds each line for a short
window, merges the same text from other ranks into it (``[r0-13] text``, as
ClusterShell's ``clubak -b`` does for hosts), and releases groups in the order
they were first seen, so every rank's own lines keep their order.

Known third-party noise (DeepSpeed's "Setting accelerator to CPU", torch's
FutureWarnings, ...) is shown once per job: after its first group is released,
the same noise from later ranks is dropped. The per-rank log files on the nodes
keep every line; this only changes what the console shows.

After the job's first failure (:meth:`LineFolder.fail`), the other ranks' error
output is *collateral*: each rank's "Connection closed by peer" traceback, ~60 lines
apiece, says only that the failed rank is gone. From a rank's first error line on
(:data:`ERROR_START`) its lines are counted, not shown (what it prints before that,
say a checkpoint saved on the teardown's SIGTERM, is still shown), and
:meth:`LineFolder.collateral` turns them into one line
(``[r1-13] collateral: 13 ranks printed 812 lines after node1 rank 0 failed ...``);
the failed rank's own lines still show in full.

The nodes' launchers (torchrun's agent, DeepSpeed's runner, ``accelerate launch``)
print the same lines on every node, differing in a timestamp, a pid or an address:
:meth:`LineFolder.feed_node` folds them into ``[node[1-4]] text (4 nodes)``
(:func:`fold_key`). Once the job is torn down (:meth:`LineFolder.tear_down`) what they
print (torchrun's "Received 15 death signal" and ~30-line SignalException traceback
per node) is counted, and :meth:`LineFolder.teardown` turns it into one line
(``[node[1-3]] teardown: the launchers on 3 nodes printed 93 lines ...``). The
fixtures in tests/fixtures/launcher_teardown are the launchers' real texts.

Library-driven programs (Hugging Face's Trainer, accelerate) print more: tqdm progress
bars (carriage-return updates; torchrun's tee glues a bar to the next line), a settings
dump on every rank (``TrainingArguments(`` and 100 ``key=value,`` lines), and the same
library warning on every rank and at every save. A bar is shown when it enters a new
quarter (:data:`PROGRESS_STEPS`), the same bar state once per job; a dump is one line
(:data:`DUMP_MIN_LINES`); a library warning, or a library INFO record repeated word for
word, is shown once per job (:data:`LIBRARY_WARNING`, :data:`LIBRARY_INFO`; a save and a
resume, :data:`LIBRARY_EVENT`, every time). tests/fixtures/hf_trainer_console
holds a real HF Trainer console that tests/unit/test_console_library.py replays.

One file because: the folder is one state machine over every rank's lines (its groups,
the collateral, the teardown, the dumps and bars) whose parts all read and write the
same queue; apart, they would share its private state.

Pure: no threads, no clock, no I/O. The caller passes ``now`` and prints what
:meth:`LineFolder.feed` and :meth:`LineFolder.release` return. Two consoles use it:
``clusterkit launch`` (:mod:`clusterkit.launch.console`, lines from the node agents)
and ``clusterkit sbatch --watch`` (:mod:`clusterkit.slurm.watch`, lines from the
job's output files), so it sits below both layers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from clusterkit.errors import ClusterkitError
from clusterkit.hostrange import fold, fold_numbers
from clusterkit.node.contract import SUMMARY_PREFIX

# Leading timestamps differ per rank and say nothing the console's order does not
# (also run_clm.py's "11/28/2026 15:04:01 - " and torch's "[rank1]:" before a line).
_STAMP = re.compile(r"^(?:\[rank\d+\]:)?(?:\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\]?\s*"
                    r"|\d\d/\d\d/\d{4} \d\d:\d\d:\d\d - )?")
# transformers' explicit format puts its time after the record's source:
# "[WARNING|logging.py:340] 2026-11-28 15:04:01,457 >> text" -> "[WARNING|logging.py:340] >> text".
_HF_STAMP = re.compile(r"^(\[[A-Z]+\|[^\]]+\]) \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ >>")
# torch's C++ (glog) lines: "[W1123 12:50:40.891008724 Utils.hpp:137] ..." -> "[W Utils.hpp:137] ...";
# torch.distributed.elastic's Python log lines, with the process id after the time:
# "W1127 02:09:04.960000 14511 site-packages/torch/.../api.py:753] ..." -> "[W site-pa...".
_GLOG_STAMP = re.compile(r"^\[?([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ (?:\d+ )?")
# One torch log record's whole header (level, time, pid, file:line): the lines of a
# multi-line record (a traceback logged by torch.distributed.elastic) all carry it.
_GLOG_RECORD = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ (?:\d+ )?\S+:\d+\]")
# torch's C++ exception backtrace, printed under a glog line of a launcher (torchrun's
# store client when the master's agent has gone at a clean end: "Exception raised from
# recvBytes at ... (most recent call first):", "frame #3: <unknown function> + 0x...",
# "<omitting python frames>"): not shown, the node's launcher.log has it.
_CPP_BACKTRACE = re.compile(r"^(?:Exception raised from \S.* \(most recent call first\):$"
                            r"|frame #\d+: |<omitting python frames>$)")
# What else differs between nodes' copies of one line: an address (and its port), a port,
# a process id ("Sending process 226 closing signal SIGTERM" on every node).
_VARYING: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\[?\b(?:::ffff:)?\d{1,3}(?:\.\d{1,3}){3}\b\]?(?::\d+)?"), "<addr>"),
    (re.compile(r"\b((?:sub)?[Pp]rocess |[Pp][Ii][Dd][: =]+)\d+\b"), r"\1<pid>"),
    (re.compile(r"\b(port[: =]+)\d+\b"), r"\1<port>"),
)
# How long a rank line waits for the same line from other ranks (seconds).
FOLD_WINDOW_S = 1.0
# A failure reaches the launcher this long after its peers' first collateral lines at
# most (the agents poll their ranks every 0.1 s; a rank that raised closes its sockets
# before its exit is seen); their lines from before that are shown as usual.
COLLATERAL_LOOKBACK_S = 0.5
# Where a rank's error output begins (a Python traceback, an exception line, a glog
# error line "[E1123 12:50:40 ...]"): in the lookback, a rank's lines turn collateral
# from there on, so its last step or checkpoint line before it is still shown.
ERROR_START = re.compile(r"Traceback \(most recent call last\)|\b[A-Z]\w*(?:Error|Exception)\b"
                         r"|\[E\d{4} |\bERROR\b")
# Lines that say nothing to the user and repeat on every rank: shown once per job.
NOISE: tuple[re.Pattern[str], ...] = tuple(re.compile(p) for p in (
    r"Setting accelerator to \w+\. If you have GPU or other accelerator",
    r"Attempting to get learning rate from scheduler before it has started",
    r"FutureWarning: `torch\.distributed\.\w+` is deprecated",
    r"^\s+return func\(\*args, \*\*kwargs\)$",
    r"hostname of the client socket cannot be retrieved",
    r"deepspeed_shm_comm_op built successfully",
    r"Using /\S+ as PyTorch extensions root",
    r"Setting OMP_NUM_THREADS environment variable for each process",  # torchrun, per node
    r"^\*{20,}$",  # ... between two lines of asterisks
))


# --- library output (module docstring) ---
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # tqdm's cursor-up between nested bars
# A tqdm bar: "desc:  40%|████      | 4/10 [00:01<00:02,  2.50it/s]" (its timing part,
# then what torchrun's tee glued after it: the next line).
_BAR = re.compile(r"^(?P<desc>[^|]*?)\s*(?P<pct>\d{1,3})%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)"
                  r"(?P<timing>\s*\[[^\]]*\])?")
PROGRESS_STEPS = 4  # a bar is shown as it enters each quarter: 0, 25, 50, 75, 100 %
# A settings dump: a line ending in "Name(" or "Name {" (or "= {", "{"), then settings
# lines ("key=value,", '"key": value,', "  key ..... value") up to its closing bracket.
_DUMP_START = re.compile(r"(?:\w\(|\w \{|= \{|^\{)$")
_SETTING = re.compile(r"""^\s*(?:["']?[\w.\-/ ]+["']?\s*(?:[=:]|\.{3,})|[)}\]]+,?$)""")
_OPENS = re.compile(r"[({\[]$")
_CLOSES = re.compile(r"^\s*[)}\]]")
DUMP_MIN_LINES = 3  # settings lines: a dump this long or longer is one line
DUMP_MAX_LINES = 2000  # a dump never closed: shown as one line once this long
# Library records shown once per job: a warning (transformers', DeepSpeed's, Python's,
# torch's C++ "[W ...]"), and an INFO record repeated word for word (each evaluation's
# "***** Running Evaluation *****" block).
LIBRARY_WARNING = re.compile(r"^\[WARNING\||^\[WARNING\] |\b[A-Z]\w*Warning: |^\[W ")
LIBRARY_INFO = re.compile(r"^\[INFO\|")
# ... except the events a user follows, shown each time: a save, a resume.
LIBRARY_EVENT = re.compile(r">> (?:Saving model checkpoint|Continuing training|Loading model)")
_DIGITS = re.compile(r"\d+")
# What follows a record shown once and is part of it: an HF record's message on the next
# line (its ">>" ends the first), Python's warning source line ("  warnings.warn(").
_RECORD_REST = re.compile(r"^(?!\[)")
_PY_WARNING = re.compile(r":\d+: [A-Z]\w*Warning: ")
_SOURCE_LINE = re.compile(r"^\s+\S")
# transformers' record whose message starts with a line break ("[INFO|trainer.py:2957]
# 2026-... >> " then "***** Running Evaluation *****"): shown as one line
_HF_EMPTY = re.compile(r"^\[[A-Z]+\|[^\]]+\][^>]*>>\s*$")
_CLEARED = re.compile(r"^ {20,}")  # tqdm clears its bar with spaces before the next line


def _empty_record(text: str) -> bool:
    """A launcher's log record line with no message after its header."""
    m = _GLOG_RECORD.match(text)
    return m is not None and not text[m.end():].strip()


def library_pieces(text: str) -> list[str]:
    """One output line as the lines a terminal would show: carriage-return updates apart,
    a progress bar apart from what is glued after it, cursor codes and blank lines out."""
    out: list[str] = []
    for segment in _ANSI.sub("", text).split("\r"):
        segment = _CLEARED.sub("", segment)
        while segment.strip():
            m = _BAR.match(segment)
            if m is None or m.end() == len(segment.rstrip()):
                out.append(segment.rstrip())
                break
            out.append(segment[:m.end()].rstrip())
            segment = segment[m.end():]
    return out


def fold_key(text: str) -> str:
    """What makes two ranks' (or nodes') lines "the same": the text without its leading
    timestamp, with ``<addr>``, ``<pid>``, ``<port>`` for what differs between them."""
    key = _GLOG_STAMP.sub(r"[\1 ", _HF_STAMP.sub(r"\1 >>", _STAMP.sub("", text.rstrip())))
    for regex, repl in _VARYING:
        key = regex.sub(repl, key)
    return key


def is_noise(text: str) -> bool:
    return any(p.search(text) for p in NOISE)


def rank_label(ranks: Iterable[int], nodes: Iterable[str]) -> str:
    """``[node3 r5]`` for one rank, ``[node3 r4-5]`` for one node, else ``[r0-7,9]``."""
    rs = sorted(set(ranks))
    ns = sorted(set(nodes))
    body = "r" + fold_numbers(rs)
    return f"[{ns[0]} {body}]" if len(ns) == 1 else f"[{body}]"


@dataclass(frozen=True)
class Folded:
    """One line to print: ``label`` is ``[node r5]``, ``[r0-13]`` or ``[node]``."""

    label: str
    text: str
    nodes: tuple[str, ...]
    ranks: tuple[int, ...]

    @property
    def first_rank(self) -> int | None:
        return self.ranks[0] if self.ranks else None

    def render(self) -> str:
        return f"{self.label} {self.text}"


@dataclass
class _Group:
    key: str
    text: str
    first_seen: float
    noise: bool
    members: dict[int, str] = field(default_factory=dict)  # rank -> node
    arrived: dict[int, float] = field(default_factory=dict)  # rank -> when its line came
    hosts: list[str] = field(default_factory=list)  # a launcher line's group: its nodes

    @property
    def said(self) -> int:
        return len(self.hosts) if self.hosts else len(self.members)


@dataclass
class _Dump:
    """A settings dump a rank is printing: held back until its closing bracket."""

    node: str
    header: str
    since: float
    lines: list[str] = field(default_factory=list)
    depth: int = 1  # brackets open (the header's own)


def parse_ranks(spec: str) -> frozenset[int] | None:
    """``all`` → None (every rank); ``0``, ``0,3``, ``4-7`` → that set. ValueError otherwise."""
    spec = spec.strip()
    if spec == "all":
        return None
    out: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad rank selection {spec!r}: use all, N, N-M or a comma list of those")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad rank range {part!r}: {first} > {last}")
        out.update(range(first, last + 1))
    return frozenset(out)


def check_ranks(ranks: frozenset[int] | None, world_size: int) -> None:
    """``--ranks`` against the job's size, once it is known (the parser cannot know it):
    a selection naming no rank of the job would show nothing, silently."""
    beyond = sorted(r for r in ranks or () if r >= world_size)
    if beyond:
        raise ClusterkitError(f"rank {beyond[0]} is not in this job: it has ranks 0-"
                              f"{world_size - 1}", key="--ranks",
                              hint=f"choose ranks below {world_size}, or all")


class LineFolder:
    """Hold rank lines for ``window_s`` seconds and merge identical ones.

    A group is released when every rank of the job said it (``world_size``), or
    when its window has passed; groups leave in first-seen order, so one rank's
    lines never overtake each other.
    """

    def __init__(self, window_s: float = 1.0, world_size: int | None = None,
                 ranks: frozenset[int] | None = None, nodes: int | None = None) -> None:
        self.window_s = window_s
        self.world_size = world_size
        self.nodes = nodes  # how many nodes' launchers can say a line (None: wait the window)
        self.ranks = ranks  # None: every rank's lines are shown
        self._queue: list[_Group] = []
        self._open: dict[str, _Group] = {}
        self._noise_shown: set[str] = set()
        self.suppressed = 0  # noise lines dropped after their first showing
        self.failed: int | None = None  # the first failed rank: the others' lines are collateral
        self._collateral: dict[int, tuple[str, int]] = {}  # rank -> (node, lines held back)
        self._erring: set[int] = set()  # ranks whose error output began after the failure
        self.tearing = False  # the job is being stopped: launcher lines are teardown output
        self._node_groups: dict[str, list[_Group]] = {}  # key -> launcher-line groups waiting
        self._teardown: dict[str, int] = {}  # node -> launcher lines held back since then
        self._record: dict[str, str] = {}  # node -> header of its launcher's last log record
        self._bars: set[tuple[str, str, int]] = set()  # (desc, total, quarter) shown already
        self._dumps: dict[int, _Dump] = {}  # rank -> the settings dump it is printing
        self._once: set[str] = set()  # library warnings and INFO records shown already
        # rank -> the rest of a record not shown, its next line: HF's message after
        # ">>" (any line not a record), or Python's warning source line (indented)
        self._skip: dict[int, re.Pattern[str]] = {}
        self._heads: dict[int, tuple[str, str]] = {}  # rank -> (node, an HF record's first line)

    def feed(self, node: str, rank: int, text: str, now: float) -> list[Folded]:
        if text.startswith(SUMMARY_PREFIX):
            return self.release(now)  # the launcher prints the job's summary once
        if self.ranks is not None and rank not in self.ranks:
            return self.release(now)
        for piece in library_pieces(text):
            rest = self._skip.pop(rank, None)
            head = self._heads.pop(rank, None)
            if head is not None and _RECORD_REST.match(piece):
                piece = f"{head[1]} {piece.strip()}"  # the record's source and its message
            elif head is not None:
                self._route(head[0], rank, head[1], now)
            if self._is_collateral(rank, piece):
                self._hold_back(rank, node, 1)
            elif rest is not None and rest.match(piece):
                self.suppressed += 1  # the rest of a record shown once (on its own line)
            elif _HF_EMPTY.match(piece):  # its message is on the next line: one line for both
                self._heads[rank] = (node, piece)
            else:
                self._route(node, rank, piece, now)
        return self.release(now)

    def _route(self, node: str, rank: int, text: str, now: float) -> None:
        if not self._in_dump(node, rank, text, now):
            self._feed_one(node, rank, text, now)

    def _in_dump(self, node: str, rank: int, text: str, now: float) -> bool:
        """Whether ``text`` is (now) part of a settings dump of ``rank``, held back."""
        dump = self._dumps.get(rank)
        body = _STAMP.sub("", text.rstrip())
        if dump is None:
            if not _DUMP_START.search(body):
                return False
            self._dumps[rank] = _Dump(node, text.rstrip(), now)
            return True
        if not _SETTING.match(body):  # the dump ended without its bracket
            self._end_dump(rank, now)
            return False
        dump.lines.append(text.rstrip())
        dump.depth += bool(_OPENS.search(body)) - bool(_CLOSES.match(body))
        if dump.depth <= 0 or len(dump.lines) >= DUMP_MAX_LINES:
            self._end_dump(rank, now)
        return True

    def _end_dump(self, rank: int, now: float) -> None:
        """A finished dump: one line when long, else its lines as they were."""
        dump = self._dumps.pop(rank)
        if len(dump.lines) < DUMP_MIN_LINES:
            for line in (dump.header, *dump.lines):
                self._feed_one(dump.node, rank, line, now)
            return
        closer = dump.lines[-1].strip() if dump.depth <= 0 else ""
        text = (f"{dump.header} ... {closer} ({len(dump.lines)} lines of settings, not shown; "
                "the rank's log has them)")
        self._feed_one(dump.node, rank, text, now)  # when ranks' dumps end: they fold

    def _feed_one(self, node: str, rank: int, text: str, now: float) -> None:
        """One line of a rank (collateral and dumps dealt with) into its group."""
        bar = _BAR.match(text)
        key = fold_key(text if bar is None or bar.group("timing") is None
                       else text[:bar.start("timing")])
        if bar is not None:  # shown as it enters a new quarter, each state once per job
            state = (bar.group("desc"), bar.group("total"),
                     min(int(bar.group("pct")), 100) * PROGRESS_STEPS // 100)
            if state in self._bars:
                self.suppressed += 1
                return
            self._bars.add(state)
        elif LIBRARY_WARNING.search(key) or (LIBRARY_INFO.match(key)
                                             and not LIBRARY_EVENT.search(key)):
            head, sep, said = key.partition(">>")  # the numbers said vary, not the source
            once = head + sep + _DIGITS.sub("N", said)
            waiting = self._open.get(key)
            if once in self._once and (waiting is None or rank in waiting.members):
                self.suppressed += 1
                if key.endswith(">>"):
                    self._skip[rank] = _RECORD_REST
                elif _PY_WARNING.search(key):
                    self._skip[rank] = _SOURCE_LINE
                return
            self._once.add(once)
        self._group(node, rank, text, key, now)

    def _group(self, node: str, rank: int, text: str, key: str, now: float) -> None:
        noise = is_noise(key)
        if noise and key in self._noise_shown:
            self.suppressed += 1
            return
        group = self._open.get(key)
        if group is None or rank in group.members:
            # A rank repeating its own line starts a new group: its lines stay in order.
            group = _Group(key=key, text=text.rstrip(), first_seen=now, noise=noise)
            self._open[key] = group
            self._queue.append(group)
        group.members[rank] = node
        group.arrived[rank] = now

    def feed_node(self, node: str, text: str, now: float) -> list[Folded]:
        """A line of a node's launcher (torchrun's agent, DeepSpeed's runner, accelerate):
        the same line from several nodes folds into one (``[node[1-4]] text (4 nodes)``);
        once the job is being torn down (:meth:`tear_down`) it is counted, not shown."""
        if self.tearing:
            self._teardown[node] = self._teardown.get(node, 0) + 1
            return self.release(now)
        if _CPP_BACKTRACE.match(text):
            self.suppressed += 1
            return self.release(now)
        if self._continues_record(node, text) or _empty_record(text):
            # The rest of one multi-line record (torchrun's "Error waiting on exit
            # barrier" and its traceback, at a clean end): its first line is shown, the
            # rest is in the node's launcher.log. A record whose first line says nothing
            # (torchrun's OMP_NUM_THREADS banner) is not shown at all.
            self.suppressed += 1
            return self.release(now)
        key = fold_key(text)
        noise = is_noise(key)
        if not key or (noise and key in self._noise_shown):  # an empty line: the log has it
            self.suppressed += bool(key)
            return self.release(now)
        # The oldest waiting group of this line that this node has not said yet: the
        # nodes' launchers print the same lines in the same order, at their own pace.
        waiting = self._node_groups.setdefault(key, [])
        group = next((g for g in waiting if node not in g.hosts), None)
        if group is None:
            group = _Group(key=key, text=text.rstrip(), first_seen=now, noise=noise)
            waiting.append(group)
            self._queue.append(group)
        group.hosts.append(node)
        return self.release(now)

    def _continues_record(self, node: str, text: str) -> bool:
        m = _GLOG_RECORD.match(text)
        if m is None:
            self._record.pop(node, None)
            return False
        header, previous = m.group(0), self._record.get(node)
        self._record[node] = header
        return header == previous

    def tear_down(self) -> None:
        """The job is being stopped: from now on what the launchers print (torchrun's
        "Received 15 death signal", its SignalException traceback, DeepSpeed's "Killing
        subprocess") is teardown output. The failure's cause is on the console already:
        the launcher's verdict, the failed rank's own lines, the failed node's last lines
        in the job's end report."""
        self.tearing = True

    def teardown(self, logs: str) -> Folded | None:
        """The one line for the launcher lines held back since :meth:`tear_down` (None:
        none), and a fresh start for the next attempt."""
        held, self._teardown, self.tearing = self._teardown, {}, False
        if not held:
            return None
        nodes = tuple(held)
        lines = sum(held.values())
        kept = f"; each node's log has them: {logs}" if logs else ""
        where = f"{len(nodes)} node{'s' * (len(nodes) > 1)}"
        text = (f"teardown: the launchers on {where} printed {lines} line{'s' * (lines > 1)} "
                f"while they were stopped (not shown{kept})")
        return Folded(label=f"[{fold(nodes)}]", text=text, nodes=nodes, ranks=())

    def fail(self, rank: int, now: float) -> bool:
        """The job's first failure is ``rank``'s: from now on the other ranks' lines are
        collateral. Their lines still waiting in a window that came in the last
        ``COLLATERAL_LOOKBACK_S`` count too (a killed rank's peers print before its node
        reports it), from their first error line on (:data:`ERROR_START`). False when a
        failure was set already."""
        if self.failed is not None:
            return False
        self.failed = rank
        erring = self._erring  # ranks whose error output began in the lookback (or later)
        for group in self._queue:  # first-seen order: each rank's lines in their order
            for other, t in list(group.arrived.items()):
                if other == rank or now - t > COLLATERAL_LOOKBACK_S:
                    continue
                if other not in erring and ERROR_START.search(group.key):
                    erring.add(other)
                if other in erring:
                    del group.arrived[other]
                    self._hold_back(other, group.members.pop(other), 1)
        self._queue = [g for g in self._queue if g.said]
        self._open = {k: g for k, g in self._open.items() if g.said}
        return True

    def _is_collateral(self, rank: int, text: str) -> bool:
        """After the failure: another rank's line from its first error line on."""
        if self.failed is None or rank == self.failed:
            return False
        if rank not in self._erring and not ERROR_START.search(text):
            return False
        self._erring.add(rank)
        return True

    def _hold_back(self, rank: int, node: str, lines: int) -> None:
        _node, held = self._collateral.get(rank, (node, 0))
        self._collateral[rank] = (node, held + lines)

    def collateral(self, where: str, logs: str) -> Folded | None:
        """The one line for the lines held back since :meth:`fail` (None: nothing held),
        and a fresh start (the next attempt's first failure is its own)."""
        held, failed = self._collateral, self.failed
        self._collateral, self.failed, self._erring = {}, None, set()
        if not held or failed is None:
            return None
        ranks = tuple(sorted(held))
        nodes = tuple(held[r][0] for r in ranks)
        lines = sum(n for _node, n in held.values())
        kept = f"; each rank's log has them: {logs}" if logs else ""
        text = (f"collateral: {len(ranks)} rank{'s' * (len(ranks) > 1)} printed {lines} "
                f"line{'s' * (lines > 1)} after {where or f'rank {failed}'} failed "
                f"(not shown{kept})")
        return Folded(label=rank_label(ranks, nodes), text=text, nodes=nodes, ranks=ranks)

    def show_once(self, text: str) -> bool:
        """For a line shown outside the groups (a node's launcher speaking for itself):
        False if it is noise this job has shown already, else True (noise: now shown)."""
        key = fold_key(text)
        if not is_noise(key):
            return True
        if key in self._noise_shown:
            self.suppressed += 1
            return False
        self._noise_shown.add(key)
        return True

    def release(self, now: float, final: bool = False) -> list[Folded]:
        out: list[Folded] = []
        for rank, (node, head) in list(self._heads.items()) if final else ():
            del self._heads[rank]
            self._route(node, rank, head, now)
        for rank in list(self._dumps) if final else ():  # the run ended inside a dump
            self._end_dump(rank, now)
        while self._queue and (final or self._ready(self._queue[0], now)):
            group = self._queue.pop(0)
            if group.noise and group.key in self._noise_shown:  # its twin went first
                self._forget(group)
                self.suppressed += group.said
                continue
            out.append(self._emit(group))
        return out

    def _ready(self, group: _Group, now: float) -> bool:
        expected = self.nodes if group.hosts else self._expected()
        complete = expected is not None and group.said >= expected
        return complete or now - group.first_seen >= self.window_s

    def _expected(self) -> int | None:
        """How many ranks can say a line: the selected ones (``--ranks 0``: one, no wait)."""
        if self.world_size is None:
            return None
        if self.ranks is None:
            return self.world_size
        return max(1, sum(1 for r in self.ranks if r < self.world_size))

    def _forget(self, group: _Group) -> None:
        """``group`` leaves the queue: later lines of its text start a new one."""
        if self._open.get(group.key) is group:
            del self._open[group.key]
        if group.hosts:
            self._node_groups[group.key] = [g for g in self._node_groups[group.key]
                                            if g is not group]

    def _emit(self, group: _Group) -> Folded:
        self._forget(group)
        if group.noise:
            self._noise_shown.add(group.key)
        if group.hosts:
            nodes = tuple(group.hosts)
            if len(nodes) == 1:
                return Folded(label=f"[{nodes[0]}]", text=group.text, nodes=nodes, ranks=())
            return Folded(label=f"[{fold(nodes)}]", text=f"{group.key} ({len(nodes)} nodes)",
                          nodes=nodes, ranks=())
        ranks = tuple(sorted(group.members))
        nodes = tuple(group.members[r] for r in ranks)
        label = rank_label(ranks, nodes)
        text = group.key if len(ranks) > 1 else group.text
        return Folded(label=label, text=text, nodes=nodes, ranks=ranks)
