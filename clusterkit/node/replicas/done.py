"""When a node's checkpoint is finished: the replica agents' completion rule (issue 22).

Part of the node agent (node program ``agent.core``, ``ship.py``). The source node's
agent polls its checkpoint dir every ~1.5 s (``listdir`` + ``stat``, cheap) and asks
:class:`CompletionWatch` which tag dirs are finished on this node:

* the bundled workload (``markers``): this node's completion marker
  ``clusterkit-complete.node<N>.json`` exists (written after the save's barrier);
* a user's own DeepSpeed script (no markers): by node/replicas/rules.part_problem, the
  tag dir holds, for every global rank
  on this node, its files (ZeRO stage inferred from the names present: per-rank
  optimizer shards if any shard exists; ZeRO-3's per-rank model states if any exists,
  else ``mp_rank_00_model_states.pt``), every ``.pt`` is a whole zip archive, no process
  of this job has a file in the tag dir open, and every file's size and mtime were the
  same at two polls at least :data:`STABLE_S` apart. A tag dir a reshard converted
  inside itself (HF's ``checkpoint-N``, accelerate's ``step_N`` after fewer nodes) owes
  its conversion's files instead (rules.conversion_problem): its rank files are the old
  world's.

docs/lost-a-node.md ("How completion is recognised") says the same for users.
Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from clusterkit.node.agent.procs import job_processes
from clusterkit.node.ckpt.listing import whole_zip as _whole_zip
from clusterkit.node.contract import UNIVERSAL_MARKER, marker_name
from clusterkit.node.replicas.rules import (
    conversion_dirs,
    conversion_problem,
    oldest_first,
    part_problem,
)

if TYPE_CHECKING:  # a runtime alias would need typing.Dict on Python 3.8
    Snapshot = dict[str, tuple[int, int]]  # rel path -> (size, mtime_ns)

STABLE_S = 2.0  # sizes and mtimes unchanged for this long (no-marker rule)


def tag_files(tag_dir: str) -> Snapshot:
    """Every regular file under a tag dir (walked in a stable order): size and mtime."""
    out: Snapshot = {}
    for d, dirs, names in os.walk(tag_dir):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(d, n)
            try:
                s = os.stat(p)
            except OSError:
                continue  # removed while we looked: the next poll sees the new state
            if os.path.isfile(p):
                out[os.path.relpath(p, tag_dir)] = (s.st_size, s.st_mtime_ns)
    return out


def open_in(tag_dir: str, job_id: str) -> list[int]:
    """Pids of this job's processes that hold a file under ``tag_dir`` open."""
    prefix = os.path.realpath(tag_dir) + os.sep
    pids = []
    for pid in job_processes(job_id):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith(prefix):
                pids.append(pid)
                break
    return pids


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


def broken_zips(tag_dir: str, files: Snapshot) -> list[str]:
    """``.pt`` files that are zip archives without their end record (a save cut short)."""
    return [rel for rel, (size, _) in files.items()
            if rel.endswith(".pt") and _whole_zip(os.path.join(tag_dir, rel), size) is False]


class CompletionWatch:
    """Which tag dirs of one node's checkpoint dir are finished (see the module doc).

    ``markers``: the job writes clusterkit's completion markers (the bundled workload);
    ``ranks``: this node's global ranks; ``index``: its node index (the marker's N)."""

    def __init__(self, ckpt_dir: str, index: int, ranks: Sequence[int], job_id: str,
                 markers: bool) -> None:
        self.ckpt_dir = ckpt_dir
        self.index = index
        self.ranks = list(ranks)
        self.job_id = job_id
        self.markers = markers
        # tag -> (first time this exact snapshot was seen, the snapshot)
        self._seen: dict[str, tuple[float, Snapshot]] = {}

    def tags(self) -> list[str]:
        """The tag dirs in the checkpoint dir now (hidden names left out), oldest first
        (by the step each names: global_step100 after global_step20)."""
        try:
            names = os.listdir(self.ckpt_dir)
        except OSError:
            return []
        return oldest_first(n for n in names if not n.startswith(".")
                            and os.path.isdir(os.path.join(self.ckpt_dir, n)))

    def complete(self, tag: str, now: float | None = None) -> bool:
        """Whether ``tag`` is finished on this node (call it every poll)."""
        tag_dir = os.path.join(self.ckpt_dir, tag)
        if self.markers:
            return os.path.isfile(os.path.join(tag_dir, marker_name(self.index)))
        return self.why_not(tag, now) is None and not open_in(tag_dir, self.job_id)

    def why_not(self, tag: str, now: float | None = None) -> str | None:
        """The no-marker rule's cheap checks: None when they hold (files present, whole,
        unchanged for STABLE_S), else what is still missing."""
        now = time.monotonic() if now is None else now
        tag_dir = os.path.join(self.ckpt_dir, tag)
        files = tag_files(tag_dir)
        missing = self._problem(tag_dir, files)
        if missing:
            self._seen.pop(tag, None)
            return missing
        first, snap = self._seen.get(tag, (now, {}))
        if snap != files:
            self._seen[tag] = (now, files)
            return "changed since the last poll"
        if now - first < STABLE_S:
            return "unchanged for less than %.0f s" % STABLE_S  # noqa: UP031
        return self._problem(tag_dir, files, broken_zips(tag_dir, files))

    def _problem(self, tag_dir: str, files: Snapshot, cut_short: Sequence[str] = ()
                 ) -> str | None:
        """The files the tag dir owes: this node's ranks' DeepSpeed files, or, a tag dir
        a reshard converted inside itself (HF's, accelerate's after fewer nodes), every
        file of its conversion's marker (its rank files are another world's)."""
        conv = conversion_dirs(files)
        if not conv:
            return part_problem(list(files), self.ranks, cut_short)
        why = conversion_problem({rel: size for rel, (size, _) in files.items()},
                                 {d: _read(os.path.join(tag_dir, d, UNIVERSAL_MARKER))
                                  for d in conv})
        cut = [rel for rel in cut_short if any(rel.startswith(d + "/") for d in conv)]
        return why or ("not a whole zip: " + ", ".join(sorted(cut)[:3]) if cut else None)
