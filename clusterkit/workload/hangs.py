"""The workload's side of the hang contract (docs/launch.md, "Hangs").

* **Heartbeat**: after its first step, then at most once a second, the rank writes its step number to
  ``$CLUSTERKIT_HEARTBEAT`` (the node agent gives each rank its own path; under
  torchrun/DeepSpeed/accelerate the path is ``$CLUSTERKIT_HEARTBEAT_DIR/rank<RANK>.heartbeat``).
  The agent reads the file's mtime as progress and its content as the step.
* **Stacks**: ``faulthandler`` is registered on SIGWINCH, writing every thread's
  Python stack to ``$CLUSTERKIT_STACKS`` (same per-rank rule, ``.stacks``). SIGWINCH,
  because its default action is to ignore: a program without the handler is not
  killed by a stack request. Works without py-spy, and needs no ptrace permission.

Standard library only; does nothing when the variables are absent (a run outside
clusterkit).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Mapping
from typing import IO

from clusterkit.node.contract import (
    ENV_HEARTBEAT,
    ENV_STACKS,
    HEARTBEAT_SUFFIX,
    STACKS_SUFFIX,
    rank_file,
)

DUMP_SIGNAL = signal.SIGWINCH


# The per-rank file: ``$var`` itself, else ``$CLUSTERKIT_HEARTBEAT_DIR/rank<R><suffix>``.
contract_path = rank_file


_dump_file: IO[str] | None = None  # kept open: faulthandler writes to its descriptor


def install_stack_dump(rank: int, env: Mapping[str, str] | None = None) -> str | None:
    """Register faulthandler on SIGWINCH; returns the file it writes to (None: not under clusterkit)."""
    global _dump_file
    path = contract_path(os.environ if env is None else env, ENV_STACKS, rank, STACKS_SUFFIX)
    if path is None:
        return None
    try:
        _dump_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - must stay open
    except OSError:
        return None
    faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True, chain=False)
    return path


class Heartbeat:
    """Writes the step to the rank's heartbeat file (atomically: the agent may read it).

    At most one write per ``min_interval_s``: the watchdog's timeouts are tens of
    seconds, while a write per step costs a create + rename on the job dir, which may
    be a network file system (milliseconds per step there). The first beat is written
    at once: it ends the watchdog's doubled start-up allowance."""

    def __init__(self, rank: int, env: Mapping[str, str] | None = None,
                 min_interval_s: float = 1.0) -> None:
        self.path = contract_path(os.environ if env is None else env, ENV_HEARTBEAT,
                                  rank, HEARTBEAT_SUFFIX)
        self.min_interval_s = min_interval_s
        self._last: float | None = None

    def beat(self, step: int) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if self._last is not None and now - self._last < self.min_interval_s:
            return
        self._last = now
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(f"{step}\n")
            os.replace(tmp, self.path)
        except OSError:
            self.path = None  # a gone job dir must not stop training
