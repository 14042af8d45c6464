"""A launch's agent streams on file, and their replay (issue 36 item 6, issue 37 item 6).

With ``CLUSTERKIT_RECORD_AGENTS=<file>`` in the launcher's environment, the I/O loop
(:class:`~clusterkit.launch.orchestrator.Orchestrator`) appends one JSON object a line
to ``<file>``: per attempt a header with the :class:`JobSpec` fields the runtime reads,
then every input it feeds :class:`~clusterkit.launch.runtime.Runtime` except the ticks
(each agent's stdout line exactly as it came, ends, start results, signals), and the
``[clusterkit]`` lines the launch says between attempts (restart, spare, restore), each
with its second since the recording began. :func:`replay` feeds such a file through the
same runtime and console code again, with no node, no SSH and no rank: the console
budget of a real run is checked from its recording (tests/unit/test_console_replay.py).
Nothing reads the variable but this module; unset (always, outside tests) it costs one
``os.environ`` look-up per attempt.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterkit.launch.console import ForwardingSink, Sink
from clusterkit.launch.jobspec import JobSpec, NodeTask
from clusterkit.launch.runtime import Runtime
from clusterkit.launch.runtime_io import (
    AgentEnded,
    AgentOutput,
    Drained,
    Event,
    Received,
    Signalled,
    Spawned,
    Starting,
    Tick,
    Unreadable,
    read_line,
)
from clusterkit.launch.runtime_state import Stage
from clusterkit.node import protocol
from clusterkit.node.contract import ENV_RECORD_AGENTS
from clusterkit.remote.base import SSHTarget

TICK_S = 0.1  # the I/O loop's longest wait between ticks (orchestrator.TICK_S)


class Recorder:
    """Appends records to one file; ``inside``: an attempt's I/O loop runs (its console
    lines are the runtime's, replayed from the events, so they are not recorded)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.inside = False
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({"t": round(time.monotonic() - self._t0, 3), **record})
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def attempt(self, job: JobSpec, fork_import: str) -> None:
        self.inside = True
        self.write({"job": _job_fields(job), "fork_import": fork_import})

    def event(self, event: Event) -> None:
        record = _event_fields(event)
        if record is not None:
            self.write(record)

    def end_attempt(self) -> None:
        self.inside = False
        self.write({"ev": "end_attempt"})

    def info(self, text: str) -> None:
        if not self.inside:
            self.write({"ev": "info", "text": text})


_RECORDER: list[Recorder] = []  # one per launcher process and file, made on first use


def recorder() -> Recorder | None:
    """This process's recorder (None: ``CLUSTERKIT_RECORD_AGENTS`` is not set)."""
    path = os.environ.get(ENV_RECORD_AGENTS, "")
    if not path:
        return None
    if not _RECORDER or _RECORDER[0].path != path:
        _RECORDER[:] = [Recorder(path)]
    return _RECORDER[0]


class RecordingSink(ForwardingSink):
    """A sink that records the ``[clusterkit]`` lines said outside an attempt, then passes
    every call on (the launch's own sink, wrapped where it is made)."""

    def __init__(self, inner: Sink, rec: Recorder) -> None:
        super().__init__(inner)
        self.rec = rec

    def info(self, text: str) -> None:
        self.rec.info(text)
        self.inner.info(text)


def recording(sink: Sink) -> Sink:
    """``sink``, recorded when ``CLUSTERKIT_RECORD_AGENTS`` is set."""
    rec = recorder()
    return sink if rec is None else RecordingSink(sink, rec)


def _job_fields(job: JobSpec) -> dict[str, Any]:
    return {"job_id": job.job_id, "attempt": job.attempt, "grace_s": job.grace_s,
            "gate_need": None if job.gate_need is None else list(job.gate_need),
            "gate_same_python": job.gate_same_python, "keepalive_s": job.keepalive_s,
            "hang_timeout_s": job.hang_timeout_s,
            "tasks": [{"node": t.node, "argv": list(t.argv), "rank_offset": t.rank_offset,
                       "nprocs": t.nprocs, "prefix": t.prefix, "job_dir": t.job_dir}
                      for t in job.tasks]}


def _event_fields(event: Event) -> dict[str, Any] | None:
    """The record of one input (None: a tick, which the replay makes itself)."""
    if isinstance(event, Received):
        return {"ev": "line", "node": event.node, "text": protocol.encode(event.msg)}
    if isinstance(event, AgentOutput):
        return {"ev": "line", "node": event.node, "text": event.text}
    if isinstance(event, Unreadable):
        return {"ev": "unreadable", "node": event.node, "error": event.error}
    if isinstance(event, AgentEnded):
        return {"ev": "ended", "node": event.node, "code": event.code, "dropped": event.dropped}
    if isinstance(event, Spawned):
        return {"ev": "spawned", "failed": dict(event.failed)}
    if isinstance(event, Signalled):
        return {"ev": "signal", "sig": int(event.sig)}
    if isinstance(event, Starting | Drained):
        return {"ev": type(event).__name__.lower()}
    return None


# ---------------------------------------------------------------------- replay


@dataclass(frozen=True)
class Record:
    t: float
    fields: dict[str, Any]


def read_records(path: Path) -> list[Record]:
    rows = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return [Record(float(r.pop("t")), r) for r in rows]


def _job(fields: dict[str, Any]) -> JobSpec:
    tasks = tuple(NodeTask(node=t["node"], target=SSHTarget(t["node"], t["node"]),
                           python="python3", argv=tuple(t["argv"]), rank_offset=t["rank_offset"],
                           nprocs=t["nprocs"], prefix=t["prefix"], job_dir=t["job_dir"])
                  for t in fields["tasks"])
    need = fields["gate_need"]
    return JobSpec(job_id=fields["job_id"], tasks=tasks, attempt=fields["attempt"],
                   grace_s=fields["grace_s"], gate_need=None if need is None else tuple(need),
                   gate_same_python=fields["gate_same_python"],
                   keepalive_s=fields["keepalive_s"], hang_timeout_s=fields["hang_timeout_s"])


def _event(f: dict[str, Any]) -> Event:
    ev = f["ev"]
    if ev == "line":
        return read_line(f["node"], f["text"])
    if ev == "unreadable":
        return Unreadable(f["node"], f["error"])
    if ev == "ended":
        return AgentEnded(f["node"], f["code"], f["dropped"])
    if ev == "spawned":
        return Spawned(f["failed"])
    if ev == "signal":
        return Signalled(signal.Signals(f["sig"]))
    return Starting() if ev == "starting" else Drained()


@dataclass(frozen=True)
class Step:
    """One moment of a replay: the clock is at ``t``; then ``event`` is fed to ``runtime``
    (None: the clock moved only), or ``info`` is said, or the attempt ended."""

    t: float
    runtime: Runtime | None
    event: Event | None = None
    info: str | None = None
    end_attempt: bool = False


def replay(records: Iterable[Record]) -> Iterator[Step]:
    """The recorded launch again, in order, with the ticks the I/O loop fed between its
    inputs (one after each input and every ``TICK_S`` while none came); the caller feeds
    each step's event to its runtime, at its time, and performs the actions."""
    runtime: Runtime | None = None
    last = 0.0
    for rec in records:
        f = rec.fields
        if runtime is not None and runtime.stage is not Stage.FINISHED:
            while last + TICK_S < rec.t:
                last += TICK_S
                yield Step(last, runtime, Tick())
        last = max(last, rec.t)
        if "job" in f:
            runtime = Runtime(_job(f["job"]), rec.t, fork_import=f["fork_import"])
        elif f["ev"] == "info":
            yield Step(rec.t, None, info=f["text"])
        elif f["ev"] == "end_attempt":
            yield Step(rec.t, runtime, end_attempt=True)
            runtime = None
        elif runtime is not None:
            yield Step(rec.t, runtime, _event(f))
            if runtime.stage is not Stage.FINISHED:
                yield Step(rec.t, runtime, Tick())
