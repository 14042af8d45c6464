"""What the user sees while a job runs: ``[node3 r5] text`` lines plus, on a TTY, a
live status line (the phase, the time since the launch started, nodes up, step,
loss, tokens/s parsed from rank 0's progress).

Piped output stays plain lines (grep-able, no escape codes); rank 0 is highlighted
only on a terminal. The same line from several ranks or several nodes' launchers is
shown once (``[r0-13] text``, ``[node[1-4]] text (4 nodes)``). After the job's first
failure, the other ranks' output (their collateral tracebacks) is folded into one line
per attempt (:class:`FoldingSink`, :meth:`clusterkit.fold.LineFolder.fail`), and so is
what the launchers print while the job is torn down (torchrun's "Received 15 death
signal" and SignalException traceback, DeepSpeed's "Killing subprocess":
:meth:`clusterkit.fold.LineFolder.tear_down`); the node logs keep every line.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Protocol

from clusterkit.fold import FOLD_WINDOW_S, Folded, LineFolder
from clusterkit.launch.runtime_io import ConsolePhase
from clusterkit.node.hangrule import STEP_LINE

if TYPE_CHECKING:
    from rich.text import Text

# "loss 4.8", "loss=4.8", and HF Trainer's logged dict "{'loss': '2.65', ...}"
_LOSS = re.compile(r"""\bloss['"]?[ =:]+['"]?([0-9.]+(?:e[-+]?\d+)?)""", re.IGNORECASE)
# a tqdm bar's "| 15/60 [": the step of a program that prints no step lines (HF Trainer)
_BAR_STEP = re.compile(r"\|\s*(\d+)/(\d+) \[")
_TOKS = re.compile(r"([0-9][0-9,.]*[kMG]?)\s*tok(?:ens)?/s", re.IGNORECASE)


class Sink(Protocol):
    def line(self, node: str, rank: int | None, text: str, *, agent: bool = False) -> None: ...

    def show(self, item: Folded) -> None: ...

    def info(self, text: str) -> None: ...

    def node_up(self, node: str) -> None: ...

    def node_done(self, node: str, code: int) -> None: ...

    def phase(self, name: str, detail: str = "") -> None: ...  # a ConsolePhase

    def failed_first(self, rank: int, where: str, logs: str) -> None: ...

    def end_attempt(self) -> None: ...

    def close(self) -> None: ...


class ForwardingSink:
    """A :class:`Sink` that passes every call on to ``inner``: the base of the sinks that
    watch or record what goes by (launch/resumewatch.py, launch/recording.py) and
    override only what they read."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner

    def line(self, node: str, rank: int | None, text: str, *, agent: bool = False) -> None:
        self.inner.line(node, rank, text, agent=agent)

    def show(self, item: Folded) -> None:
        self.inner.show(item)

    def info(self, text: str) -> None:
        self.inner.info(text)

    def node_up(self, node: str) -> None:
        self.inner.node_up(node)

    def node_done(self, node: str, code: int) -> None:
        self.inner.node_done(node, code)

    def phase(self, name: str, detail: str = "") -> None:
        self.inner.phase(name, detail)

    def failed_first(self, rank: int, where: str, logs: str) -> None:
        self.inner.failed_first(rank, where, logs)

    def end_attempt(self) -> None:
        self.inner.end_attempt()

    def close(self) -> None:
        self.inner.close()


# Where a launch is, in order: the runtime's phases (a str enum; launch/runtime_io.py).
PHASES = tuple(ConsolePhase)


def prefix(node: str, rank: int | None) -> str:
    return f"[{node}]" if rank is None else f"[{node} r{rank}]"


@dataclass
class Progress:
    """The latest numbers from rank 0's progress lines."""

    step: str = "-"
    loss: str = "-"
    toks: str = "-"

    def update(self, text: str) -> bool:
        changed = False
        for regex, attr in ((STEP_LINE, "step"), (_BAR_STEP, "step"), (_LOSS, "loss"),
                            (_TOKS, "toks")):
            m = regex.search(text)
            if m:
                value = m.group(1)
                if attr == "step" and m.group(2):
                    value = f"{m.group(1)}/{m.group(2)}"
                setattr(self, attr, value)
                changed = True
        return changed


def clock(seconds: float) -> str:
    """``42 s``, ``3:07``, ``1:02:03``: the elapsed time on the status line."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


@dataclass
class StatusLine:
    """The live status line's state; :meth:`text` renders it at ``now`` (pure)."""

    total: int
    started_at: float  # the launch's start (monotonic): elapsed counts the whole job
    phase: str = "connecting"
    detail: str = ""
    phase_at: float | None = None
    up: set[str] = field(default_factory=set)
    done: dict[str, int] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)

    def set_phase(self, name: str, detail: str, now: float) -> None:
        if name != self.phase:
            self.phase_at = now
        self.phase, self.detail = name, detail

    def text(self, now: float) -> str:
        failed = sum(1 for c in self.done.values() if c != 0)
        phase = f"{self.phase} {self.detail}" if self.detail else self.phase
        if self.phase_at is not None and self.phase != "training":
            phase += f" {clock(now - self.phase_at)}"  # how long this phase has lasted
        parts = [phase, f"{clock(now - self.started_at)} since launch",
                 f"nodes up {len(self.up) - len(self.done)}/{self.total}"]
        if failed:
            parts.append(f"failed {failed}")
        parts += [f"step {self.progress.step}", f"loss {self.progress.loss}",
                  f"tokens/s {self.progress.toks}"]
        return " " + " | ".join(parts)


class PlainSink:
    """Plain lines; ``[clusterkit]`` lines for the launcher's own messages."""

    def __init__(self, out: IO[str] | None = None, quiet_ranks: bool = False) -> None:
        self.out = out or sys.stdout
        self.quiet_ranks = quiet_ranks
        self._lock = threading.Lock()

    def _write(self, text: str) -> None:
        with self._lock:
            self.out.write(text + "\n")
            self.out.flush()

    def line(self, node: str, rank: int | None, text: str, *, agent: bool = False) -> None:
        if not self.quiet_ranks:
            self._write(f"{prefix(node, rank)} {text}")

    def show(self, item: Folded) -> None:
        if not self.quiet_ranks:
            self._write(item.render())

    def info(self, text: str) -> None:
        self._write(f"[clusterkit] {text}")

    def node_up(self, node: str) -> None:
        pass

    def node_done(self, node: str, code: int) -> None:
        pass

    def phase(self, name: str, detail: str = "") -> None:
        pass  # piped output: no status line

    def failed_first(self, rank: int, where: str, logs: str) -> None:
        pass  # unfolded output shows every line

    def end_attempt(self) -> None:
        pass

    def close(self) -> None:
        pass


class RichSink:
    """A terminal: rank-0 lines highlighted, a live status line kept at the bottom."""

    def __init__(self, total_nodes: int, started_at: float | None = None) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        self._text = Text
        self.console = Console(highlight=False)
        self.state = StatusLine(total_nodes, time.monotonic() if started_at is None
                                else started_at)
        self.progress = self.state.progress
        # get_renderable: the line is rendered at every refresh, so the clock runs.
        self._live = Live(console=self.console, refresh_per_second=4, transient=True,
                          get_renderable=self._status)
        self._live.start()

    def _status(self) -> Text:
        t = self._text(self.state.text(time.monotonic()), style="bold")
        if any(c != 0 for c in self.state.done.values()):
            t.stylize("bold red")
        return t

    def line(self, node: str, rank: int | None, text: str, *, agent: bool = False) -> None:
        self._print(prefix(node, rank), text, rank == 0, agent)

    def show(self, item: Folded) -> None:
        self._print(item.label, item.text, item.ranks == (0,), False)

    def _print(self, label: str, text: str, rank0: bool, agent: bool) -> None:
        style = "bold cyan" if rank0 else ("yellow" if agent else "dim")
        out = self._text(label + " ", style=style)
        out.append(text, style="bold" if rank0 else "")
        self.console.print(out, soft_wrap=True)
        if rank0:
            self.progress.update(text)

    def info(self, text: str) -> None:
        self.console.print(self._text(f"[clusterkit] {text}", style="bold magenta"), soft_wrap=True)

    def node_up(self, node: str) -> None:
        self.state.up.add(node)

    def node_done(self, node: str, code: int) -> None:
        self.state.done[node] = code

    def phase(self, name: str, detail: str = "") -> None:
        if name == "connecting":  # a new attempt: its nodes come up again
            self.state.up.clear()
            self.state.done.clear()
        self.state.set_phase(name, detail, time.monotonic())

    def failed_first(self, rank: int, where: str, logs: str) -> None:
        pass

    def end_attempt(self) -> None:
        pass

    def close(self) -> None:
        self._live.stop()


class FoldingSink:
    """Rank lines through a :class:`LineFolder` into another sink.

    A timer thread releases groups whose window has passed, so a line never waits
    longer than the window for ranks that do not print it. The node launchers' lines
    fold across nodes; the agents' own lines and clusterkit's (``info``) pass straight
    through. ``launcher_logs``: where each node's launcher lines are kept
    (``<job dir>/nodes/<node>/launcher.log``), named by the teardown line.
    """

    def __init__(self, inner: Sink, folder: LineFolder, tick_s: float = 0.2,
                 launcher_logs: str = "") -> None:
        self.inner = inner
        self.folder = folder
        self.launcher_logs = launcher_logs
        self._failure: tuple[str, str] = ("", "")  # (where, logs) of this attempt's first failure
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._tick, args=(tick_s,), daemon=True,
                                       name="clusterkit-fold")
        self._timer.start()

    def _tick(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            self._release(final=False)

    def _release(self, final: bool) -> None:
        with self._lock:
            items = self.folder.release(time.monotonic(), final=final)
            for item in items:
                self.inner.show(item)

    def line(self, node: str, rank: int | None, text: str, *, agent: bool = False) -> None:
        if agent:
            self.inner.line(node, rank, text, agent=agent)
            return
        with self._lock:
            now = time.monotonic()
            items = (self.folder.feed_node(node, text, now) if rank is None
                     else self.folder.feed(node, rank, text, now))
            for item in items:
                self.inner.show(item)

    def show(self, item: Folded) -> None:
        self.inner.show(item)

    def info(self, text: str) -> None:
        self._release(final=True)  # the launcher's verdict comes after the ranks' lines
        self.inner.info(text)

    def node_up(self, node: str) -> None:
        self.inner.node_up(node)

    def node_done(self, node: str, code: int) -> None:
        self.inner.node_done(node, code)

    def phase(self, name: str, detail: str = "") -> None:
        if name == ConsolePhase.TEARING_DOWN:  # what the launchers print now is teardown
            with self._lock:
                self.folder.tear_down()
        self.inner.phase(name, detail)

    def failed_first(self, rank: int, where: str, logs: str) -> None:
        with self._lock:
            if self.folder.fail(rank, time.monotonic()):
                self._failure = (where, logs)

    def end_attempt(self) -> None:
        """The attempt is over: its collateral and teardown lines, then a fresh start for
        the next one."""
        self._release(final=True)
        with self._lock:
            items = (self.folder.collateral(*self._failure),
                     self.folder.teardown(self.launcher_logs))
            self._failure = ("", "")
        for item in items:
            if item is not None:
                self.inner.show(item)
        self.inner.end_attempt()

    def close(self) -> None:
        self._stop.set()
        self._timer.join(timeout=2.0)
        self._release(final=True)
        self.inner.close()


def make_sink(total_nodes: int, *, quiet_ranks: bool = False, world_size: int | None = None,
              ranks: frozenset[int] | None = None, fold: bool = True,
              launcher_logs: str = "") -> Sink:
    """The console for one launch: folded rank lines (``--ranks`` selects whose) on a
    live terminal or as plain lines; ``launcher_logs`` as :class:`FoldingSink`'s."""
    inner: Sink
    if sys.stdout.isatty() and not quiet_ranks:
        inner = RichSink(total_nodes)
    else:
        inner = PlainSink(quiet_ranks=quiet_ranks)
    if quiet_ranks or not fold:
        return inner
    return FoldingSink(inner, LineFolder(FOLD_WINDOW_S, world_size=world_size, ranks=ranks,
                                         nodes=total_nodes), launcher_logs=launcher_logs)
