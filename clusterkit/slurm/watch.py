"""Follow a Slurm job: copy its output files as they grow, until the job ends.

The files are read where the submit host sees them (the job directory must be on
a filesystem the nodes share, as for any batch job). clusterkit's script opens its
files with ``--open-mode=append``, so a requeued run continues the same file after a
``===== clusterkit: ... run N`` line; a script that truncates instead (a site template
without it) makes the file shrink, which we notice and start over instead of going silent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from clusterkit.slurm.client import SlurmClient
from clusterkit.slurm.jobinfo import JobInfo

CHUNK = 1 << 16


@dataclass
class _Follower:
    path: str
    sink: TextIO
    offset: int = 0
    pending: bytes = field(default=b"")

    def pump(self, final: bool = False) -> bool:
        """Copy whatever is new; True if the file shrank (the job was requeued)."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return False  # not created yet (pending job) or not visible here yet
        restarted = size < self.offset
        if restarted:
            self.offset, self.pending = 0, b""
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            while chunk := fh.read(CHUNK):
                self.offset += len(chunk)
                self.pending += chunk
        # Whole lines only (a rank's line is not split across two prints), the rest at the end.
        cut = len(self.pending) if final else self.pending.rfind(b"\n") + 1
        if cut:
            self.sink.write(self.pending[:cut].decode(errors="replace"))
            self.sink.flush()
            self.pending = self.pending[cut:]
        return restarted


def rank0_log(info: JobInfo) -> str | None:
    """Where a one-task-per-rank step (``srun --output=.../%x-%j-rank%t.out``, the
    deepspeed variant of the batch script) writes rank 0's output: next to StdOut."""
    if not info.stdout:
        return None
    return os.path.join(os.path.dirname(info.stdout), f"{info.name}-{info.job_id}-rank0.out")


def watch(client: SlurmClient, job_id: str, out: TextIO, err: TextIO, *, poll_s: float = 1.0,
          sleep: Callable[[float], None] = time.sleep) -> JobInfo:
    """Follow ``job_id`` until it reaches a terminal state; return its final record.

    Follows StdOut and StdErr, and rank 0's own log when the ranks write per-rank files."""
    followers: dict[str, _Follower] = {}
    last_state = ""
    restarts = 0
    while True:
        info = client.show(job_id)
        if info.state != last_state:
            err.write(f"clusterkit: job {job_id} {info.state}"
                      + (f" on {info.nodes}" if info.state == "RUNNING" else "") + "\n")
            err.flush()
            last_state = info.state
        if info.restarts != restarts:
            err.write(f"clusterkit: job {job_id} was requeued (restart {info.restarts})\n")
            restarts = info.restarts
        for path, sink in ((info.stdout, out), (info.stderr, err), (rank0_log(info), out)):
            if path and path not in followers:
                followers[path] = _Follower(path, sink)
        for f in followers.values():
            f.pump(final=info.finished)
        if info.finished:
            return info
        sleep(poll_s)
