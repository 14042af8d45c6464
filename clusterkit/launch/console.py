"""What the user sees while a job runs: ``[node3 r5] text`` lines plus, on a TTY, a
live status line (nodes up, step, loss, tokens/s parsed from rank 0's progress).

Piped output stays plain lines (grep-able, no escape codes); rank 0 is highlighted
only on a terminal.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Protocol

from clusterkit.fold import FOLD_WINDOW_S, Folded, LineFolder

if TYPE_CHECKING:
    from rich.text import Text

_STEP = re.compile(r"\bstep[ =:]+(\d+)(?:\s*/\s*(\d+))?", re.IGNORECASE)
_LOSS = re.compile(r"\bloss[ =:]+([0-9.]+(?:e[-+]?\d+)?)", re.IGNORECASE)
_TOKS = re.compile(r"([0-9][0-9,.]*[kMG]?)\s*tok(?:ens)?/s", re.IGNORECASE)


class Sink(Protocol):
    def line(self, node: str, rank: int | None, text: str, *, agent: bool = False) -> None: ...

    def show(self, item: Folded) -> None: ...

    def info(self, text: str) -> None: ...

    def node_up(self, node: str) -> None: ...

    def node_done(self, node: str, code: int) -> None: ...

    def close(self) -> None: ...


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
        for regex, attr in ((_STEP, "step"), (_LOSS, "loss"), (_TOKS, "toks")):
            m = regex.search(text)
            if m:
                value = m.group(1)
                if attr == "step" and m.group(2):
                    value = f"{m.group(1)}/{m.group(2)}"
                setattr(self, attr, value)
                changed = True
        return changed


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

    def close(self) -> None:
        pass


class RichSink:
    """A terminal: rank-0 lines highlighted, a live status line kept at the bottom."""

    def __init__(self, total_nodes: int) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        self._text = Text
        self.console = Console(highlight=False)
        self.total = total_nodes
        self.up: set[str] = set()
        self.done: dict[str, int] = {}
        self.progress = Progress()
        self._live = Live(self._status(), console=self.console, refresh_per_second=4,
                          transient=True)
        self._live.start()

    def _status(self) -> Text:
        failed = sum(1 for c in self.done.values() if c != 0)
        t = self._text()
        t.append(f" nodes up {len(self.up) - len(self.done)}/{self.total}", style="bold")
        if failed:
            t.append(f"  failed {failed}", style="bold red")
        t.append(f"  step {self.progress.step}  loss {self.progress.loss}"
                 f"  tokens/s {self.progress.toks}")
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
        if rank0 and self.progress.update(text):
            self._live.update(self._status())

    def info(self, text: str) -> None:
        self.console.print(self._text(f"[clusterkit] {text}", style="bold magenta"), soft_wrap=True)

    def node_up(self, node: str) -> None:
        self.up.add(node)
        self._live.update(self._status())

    def node_done(self, node: str, code: int) -> None:
        self.done[node] = code
        self._live.update(self._status())

    def close(self) -> None:
        self._live.stop()


class FoldingSink:
    """Rank lines through a :class:`LineFolder` into another sink.

    A timer thread releases groups whose window has passed, so a line never waits
    longer than the window for ranks that do not print it. The launcher's own
    lines (agent lines, ``info``) pass straight through.
    """

    def __init__(self, inner: Sink, folder: LineFolder, tick_s: float = 0.2) -> None:
        self.inner = inner
        self.folder = folder
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
        if rank is None or agent:
            self.inner.line(node, rank, text, agent=agent)
            return
        with self._lock:
            for item in self.folder.feed(node, rank, text, time.monotonic()):
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

    def close(self) -> None:
        self._stop.set()
        self._timer.join(timeout=2.0)
        self._release(final=True)
        self.inner.close()


def make_sink(total_nodes: int, *, quiet_ranks: bool = False, world_size: int | None = None,
              ranks: frozenset[int] | None = None, fold: bool = True) -> Sink:
    """The console for one launch: folded rank lines (``--ranks`` selects whose) on a
    live terminal or as plain lines."""
    inner: Sink
    if sys.stdout.isatty() and not quiet_ranks:
        inner = RichSink(total_nodes)
    else:
        inner = PlainSink(quiet_ranks=quiet_ranks)
    if quiet_ranks or not fold:
        return inner
    return FoldingSink(inner, LineFolder(FOLD_WINDOW_S, world_size=world_size, ranks=ranks))
