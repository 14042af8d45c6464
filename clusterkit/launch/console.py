"""What the user sees while a job runs: ``[node3 r5] text`` lines plus, on a TTY, a
live status line (nodes up, step, loss, tokens/s parsed from rank 0's progress).

Piped output stays plain lines (grep-able, no escape codes); rank 0 is highlighted
only on a terminal.
"""

from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rich.text import Text

_STEP = re.compile(r"\bstep[ =:]+(\d+)(?:\s*/\s*(\d+))?", re.IGNORECASE)
_LOSS = re.compile(r"\bloss[ =:]+([0-9.]+(?:e[-+]?\d+)?)", re.IGNORECASE)
_TOKS = re.compile(r"([0-9][0-9,.]*[kMG]?)\s*tok(?:ens)?/s", re.IGNORECASE)


class Sink(Protocol):
    def line(self, node: str, rank: int | None, text: str, *, agent: bool = False) -> None: ...

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
        style = "bold cyan" if rank == 0 else ("yellow" if agent else "dim")
        out = self._text(prefix(node, rank) + " ", style=style)
        out.append(text, style="bold" if rank == 0 else "")
        self.console.print(out, soft_wrap=True)
        if rank == 0 and self.progress.update(text):
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


def make_sink(total_nodes: int, *, quiet_ranks: bool = False) -> Sink:
    if sys.stdout.isatty() and not quiet_ranks:
        return RichSink(total_nodes)
    return PlainSink(quiet_ranks=quiet_ranks)
