"""The value types of a job record (``launch/registry.py``'s ``JobRecord``) that verbs above
``launch`` read: its state, and what it says about its checkpoints (status, collect-ckpt
and recovery, in ``checkpoints/`` and ``cli/``, which do not import ``launch``).

Storage kinds are ``node.contract.StorageKind`` (node code spells them too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from clusterkit.node.contract import StorageKind


class JobState(str, Enum):  # noqa: UP042 (a str: the record's JSON keeps its spelling)
    """A job record's ``state``: who writes each (write ``.value`` in text)."""

    RUNNING = "running"  # launch, from the start; status asks whether its launcher lives
    SUCCEEDED = "succeeded"  # launch: every rank exited 0
    FAILED = "failed"  # launch: a rank failed and no restart was left
    INTERRUPTED = "interrupted"  # launch: SIGINT/SIGTERM tore it down
    NOT_STARTED = "not-started"  # launch: the gate or a start refused it, no rank ran
    STOPPED = "stopped"  # `clusterkit stop` of a running job whose launcher was gone
    SUBMITTED = "submitted"  # `clusterkit sbatch --submit`: Slurm's to run (squeue says more)


class RankSpan(NamedTuple):
    """One node of a launched job: its global ranks ``first .. first + nproc - 1``
    (node-local checkpoints are tied to these). JSON: ``[node, first, nproc]``."""

    node: str
    first: int
    nproc: int


RankMap = list[RankSpan]  # node index order


@dataclass
class JobCheckpoints:
    """Where a job's checkpoints are and how they were written."""

    storage: StorageKind | None = None  # None: the record names none
    dir: str | None = None  # node 0's dir (a batch job's: every node's, {host}/{node} patterns)
    dirs: dict[str, str] = field(default_factory=dict)  # node -> its dir, where they differ
    slots: list[int] = field(default_factory=list)  # ranks per node, node index order
    rank_map: RankMap | None = None  # None: a batch job, or a record from before it
    markers: bool = True  # the program writes completion markers (a user's script: no)

    @property
    def node_local(self) -> bool:
        return self.storage is StorageKind.NODE_LOCAL

    def dir_of(self, node: str) -> str | None:
        """``node``'s checkpoint dir (None: the record names none)."""
        return self.dirs.get(node) or self.dir

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobCheckpoints:
        """From this type's JSON, or from an old record's ``extra`` (same values, its
        keys ``ckpt_dir``/``ckpt_dirs``)."""
        storage = data.get("storage")
        rank_map = data.get("rank_map")
        return cls(storage=StorageKind(storage) if storage else None,
                   dir=_str_or_none(data.get("dir", data.get("ckpt_dir"))),
                   dirs={str(k): str(v) for k, v in
                         dict(data.get("dirs", data.get("ckpt_dirs")) or {}).items()},
                   slots=[int(s) for s in data.get("slots") or ()],
                   rank_map=None if rank_map is None else rank_spans(rank_map),
                   markers=bool(data.get("markers", True)))


def rank_spans(rows: Sequence[Sequence[Any]]) -> RankMap:
    return [RankSpan(str(node), int(first), int(nproc)) for node, first, nproc in rows]


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
