"""How a sync looks on the console: the progress line, the notes, one folded line per
outcome (``clusterkit sync``, ``launch --sync``, ``nodes env``; docs/sync.md). Printing
only: the sync itself is ``clusterkit.jobs.sync`` (and ``clusterkit.api.sync``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from clusterkit.hostrange import folded_lines
from clusterkit.sync.plan import fmt_bytes, progress_line

if TYPE_CHECKING:
    from clusterkit.inventory import Host
    from clusterkit.jobs.sync import SyncHooks
    from clusterkit.sync.types import Progress, SyncResult


class Shower:
    """Progress on stderr: one line rewritten in place on a terminal, else every 10 s."""

    def __init__(self, as_json: bool, src: str = ".") -> None:
        self.as_json = as_json
        self.src = src  # the directory start's line names
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.width = 0
        self.shown: list[str] = []  # notes said as they happened (not again at the end)

    def start(self, where: str, count: int) -> None:
        if not self.as_json:
            print(f"sync {self.src} -> {where} on {count} node(s)", file=sys.stderr)

    def hooks(self) -> SyncHooks:
        from clusterkit.jobs.sync import SyncHooks

        return SyncHooks(on_start=self.start, on_progress=self, on_note=self.note)

    def note(self, text: str) -> None:
        """A note as it happens (e.g. a node fed over SSH): said once, on stderr."""
        if self.as_json:
            return
        self.close()
        self.width = 0
        print(f"  note: {text}", file=sys.stderr, flush=True)
        self.shown.append(text)

    def __call__(self, p: Progress) -> None:
        if self.as_json:
            print(json.dumps({"event": "progress", "elapsed_s": round(p.elapsed_s, 1),
                              "sent": p.sent, "nodes": {v.name: [v.got, v.need, v.state]
                                                        for v in p.views}}), flush=True)
            return
        line = progress_line(p.views, p.elapsed_s, p.sent)
        if self.tty:
            sys.stderr.write("\r" + line[:200].ljust(self.width))
            self.width = min(200, len(line))
            sys.stderr.flush()
        elif p.elapsed_s - self.last >= 10:
            self.last = p.elapsed_s
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and self.width and not self.as_json:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


def report(result: SyncResult, as_json: bool, shown: Sequence[str] = ()) -> None:
    """The end: one folded line per outcome (or one JSON object); then exit 2 unless
    every node holds the source (``jobs.sync.require_complete``)."""
    from clusterkit.jobs.sync import require_complete

    if as_json:
        print(json.dumps({"event": "done", "ok": result.ok, "digest": result.digest,
                          "files": result.files, "bytes": result.total_bytes,
                          "sent_from_here": result.sent_bytes, "seconds": round(result.seconds, 2),
                          "chains": result.chains, "notes": result.notes,
                          "changed": result.changed, "links": result.links,
                          "nodes": {n: vars(r) for n, r in result.nodes.items()}}), flush=True)
    else:
        _print_lines(result, shown)
    require_complete(result)


def _print_lines(result: SyncResult, shown: Sequence[str]) -> None:
    for note in result.notes:
        if note not in shown:
            print(f"  note: {note}")
    for line in folded_lines(((n, r.summary()) for n, r in result.nodes.items()),
                             list(result.nodes)):
        print(f"  {line}")
    if result.links:
        print(f"  note: {len(result.links)} symbolic link(s) not copied: "
              + ", ".join(result.links[:3]) + (" ..." if len(result.links) > 3 else ""))
    rate = result.sent_bytes / result.seconds if result.seconds else 0.0
    print(f"  {result.files} file(s), {fmt_bytes(result.total_bytes)}, digest "
          f"{result.digest[:12]}; {fmt_bytes(result.sent_bytes)} sent from here in "
          f"{result.seconds:.1f} s ({fmt_bytes(rate)}/s)", file=sys.stderr)


def sync_and_show(src: str, hosts: Sequence[Host], as_json: bool = False) -> SyncResult:
    """``launch --sync DIR``: the sync to ``hosts``, shown as ``clusterkit sync`` shows it;
    raises unless every node then holds DIR's digest."""
    from clusterkit.jobs.sync import sync_hosts

    show = Shower(as_json, src)
    result = sync_hosts(src, hosts, hooks=show.hooks())
    show.close()
    report(result, as_json, shown=show.shown)
    return result
