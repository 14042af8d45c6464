"""The local job registry: ``<clusterkit_home>/jobs/<job_id>/job.json``.

Written by ``clusterkit launch`` when a job starts and again when it ends; read by
``clusterkit status`` and ``clusterkit stop``. It holds enough to reach every node
again (the SSH target, interpreter and per-node job directory), so neither verb
needs the inventory the job was started from.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clusterkit.errors import LaunchError
from clusterkit.fsutil import atomic_write_text
from clusterkit.launch.orchestrator import JobSpec
from clusterkit.remote.base import SSHTarget


@dataclass(frozen=True)
class NodeRecord:
    node: str
    python: str
    job_dir: str
    target: SSHTarget


@dataclass
class JobRecord:
    job_id: str
    backend: str
    nodes: list[NodeRecord]
    created: float
    launcher_pid: int
    state: str = "running"  # running | succeeded | failed | interrupted
    exit_code: int | None = None
    attempts: int = 1
    failure: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_job(cls, job: JobSpec, backend: str) -> JobRecord:
        nodes = [NodeRecord(t.node, t.python, t.job_dir.replace("@JOB@", job.job_id), t.target)
                 for t in job.tasks]
        return cls(job_id=job.job_id, backend=backend, nodes=nodes, created=time.time(),
                   launcher_pid=os.getpid())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        nodes = [NodeRecord(n["node"], n["python"], n["job_dir"], SSHTarget(**n["target"]))
                 for n in data["nodes"]]
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "nodes"}
        return cls(nodes=nodes, **known)

    @property
    def launcher_alive(self) -> bool:
        return self.state == "running" and os.path.exists(f"/proc/{self.launcher_pid}")


class Registry:
    def __init__(self, home: Path) -> None:
        self.root = home / "jobs"

    def path(self, job_id: str) -> Path:
        return self.root / job_id / "job.json"

    def save(self, record: JobRecord) -> None:
        self.path(record.job_id).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path(record.job_id), record.to_json() + "\n")

    def load(self, job_id: str) -> JobRecord:
        path = self.path(job_id)
        try:
            return JobRecord.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            known = [r.job_id for r in self.all()][-5:]
            raise LaunchError(f"no job {job_id!r} in the registry", path=str(self.root),
                              hint=("known jobs: " + ", ".join(known)) if known
                              else "no jobs were launched from this machine") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise LaunchError(f"unreadable job record ({exc})", path=str(path)) from None

    def find(self, job_id: str) -> JobRecord | None:
        """The record, or None when there is none (an unreadable one counts as none)."""
        if not self.path(job_id).is_file():
            return None
        try:
            return self.load(job_id)
        except LaunchError:
            return None

    def all(self) -> list[JobRecord]:
        if not self.root.is_dir():
            return []
        out = []
        for entry in sorted(self.root.iterdir()):
            if (entry / "job.json").is_file():
                try:
                    out.append(self.load(entry.name))
                except LaunchError:
                    continue  # one corrupt record must not hide the others
        return out
