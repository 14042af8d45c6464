"""The local job registry: ``<clusterkit_home>/jobs/<job_id>/job.json``.

Written by ``clusterkit launch`` when a job starts and again when it ends; read by
``clusterkit status``, ``clusterkit stop`` and ``clusterkit collect-ckpt``. It holds
enough to reach every node again (the SSH target, interpreter and per-node job
directory), so no verb needs the inventory the job was started from.

``clusterkit sbatch --submit`` records its job too (``transport: slurm``): the Slurm
job ids it was submitted as, its job dir, the checkpoint root, slots and site
options. Its nodes are Slurm's choice, known once it runs (``slurm_nodes`` in the job
dir, or ``scontrol``), so ``nodes`` stays empty; ``collect-ckpt`` finds the record by
clusterkit's id or by any of its Slurm ids (:meth:`Registry.resolve`).

Every field is typed (``spec/jobrecord.py``: the state, the checkpoints' storage, dirs,
slots and rank map). Records written before that kept the checkpoint facts, the launcher
and a batch job's interpreter/site options in one ``extra`` dict: :meth:`JobRecord.from_dict`
reads them into the fields (the next save writes the new form).
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
from clusterkit.launch.jobspec import JobSpec
from clusterkit.node.contract import StorageKind, with_job_id
from clusterkit.remote.base import SSHTarget
from clusterkit.slurm.steps import site_args
from clusterkit.spec.job import WORKLOAD_MODULE
from clusterkit.spec.jobrecord import JobCheckpoints, JobState

SBATCH_SCRIPT = "sbatch.sh"  # what `clusterkit sbatch` writes into a job dir
SLURM_ID_FILE = "slurm_job_id"
PLAN_FILE = "plan.json"


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
    state: JobState = JobState.RUNNING
    exit_code: int | None = None
    attempts: int = 1
    failure: str | None = None
    transport: str = "ssh"  # ssh: launch's agents; slurm: a batch job (nodes via srun)
    slurm_job_ids: list[str] = field(default_factory=list)  # oldest first
    job_dir: str | None = None  # a batch job's dir (plan.json, sbatch.sh, logs)
    ckpt: JobCheckpoints = field(default_factory=JobCheckpoints)
    launcher: str | None = None  # the --launcher chosen (issue 25); None: the backend's
    python: str | None = None  # a batch job's interpreter (its nodes are Slurm's choice)
    slurm_site: list[str] = field(default_factory=list)  # a batch job's site options

    def __post_init__(self) -> None:
        self.state = JobState(self.state)  # a caller's plain value ("running") too

    @classmethod
    def for_job(cls, job: JobSpec, backend: str) -> JobRecord:
        nodes = [NodeRecord(t.node, t.python, with_job_id(t.job_dir, job.job_id), t.target)
                 for t in job.tasks]
        return cls(job_id=job.job_id, backend=backend, nodes=nodes, created=time.time(),
                   launcher_pid=os.getpid())

    @classmethod
    def for_sbatch(cls, job_dir: str | Path, slurm_job_id: str | None = None) -> JobRecord:
        """A batch job from its job dir (plan.json and sbatch.sh, as `clusterkit sbatch`
        wrote them); ``slurm_job_id`` defaults to the dir's ``slurm_job_id`` file."""
        d = Path(job_dir).resolve()
        try:
            plan = json.loads((d / PLAN_FILE).read_text(encoding="utf-8"))
            script = (d / SBATCH_SCRIPT).read_text(encoding="utf-8")
            first = plan["nodes"][0]
            ckpt = JobCheckpoints(storage=StorageKind(plan["storage"]),
                                  dir=str(first["ckpt_dir"]),
                                  slots=[len(n["slots"]) for n in plan["nodes"]],
                                  markers=plan.get("program", [])[:2] == ["-m", WORKLOAD_MODULE])
            job_id, backend = str(plan["job_id"]), str(plan["backend"])
        except FileNotFoundError as exc:
            missing = Path(str(exc.filename)).name
            raise LaunchError(f"not the job dir of a `clusterkit sbatch` job: no {missing}",
                              path=str(d), hint="pass the directory `clusterkit sbatch` printed "
                              "(<workdir>/.clusterkit/jobs/<job id>)") from None
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise LaunchError(f"unreadable job dir ({exc})", path=str(d)) from None
        if slurm_job_id is None:
            slurm_job_id = _read_word(d / SLURM_ID_FILE)
        return cls(job_id=job_id, backend=backend, nodes=[], created=time.time(),
                   launcher_pid=os.getpid(), state=JobState.SUBMITTED, transport="slurm",
                   slurm_job_ids=[slurm_job_id] if slurm_job_id else [], job_dir=str(d),
                   ckpt=ckpt, python=str(first["python"]), slurm_site=list(site_args(script)))

    @property
    def slurm_job_id(self) -> str | None:
        """The newest Slurm job id of a batch job."""
        return self.slurm_job_ids[-1] if self.slurm_job_ids else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        """A record as saved; one from before the typed fields (``extra``) too."""
        nodes = [NodeRecord(n["node"], n["python"], n["job_dir"], SSHTarget(**n["target"]))
                 for n in data["nodes"]]
        # A record from before the typed fields: its one dict of them (same values).
        legacy = data.get("extra") or {}
        if not isinstance(legacy, dict):
            raise TypeError("extra is not an object")
        old = {**legacy, **data}
        typed = {"ckpt", "state", "nodes", "launcher", "python", "slurm_site"}
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k not in typed}
        return cls(nodes=nodes, **known, state=JobState(data.get("state", JobState.RUNNING)),
                   ckpt=JobCheckpoints.from_dict(data.get("ckpt", legacy)),
                   launcher=str(old["launcher"]) if old.get("launcher") else None,
                   python=str(old["python"]) if old.get("python") else None,
                   slurm_site=[str(a) for a in old.get("slurm_site") or ()])

    @property
    def launcher_shown(self) -> str:
        """The ``--launcher`` the job was started with (records before issue 25: the backend)."""
        return self.launcher or self.backend

    @property
    def state_shown(self) -> str:
        """The state as `clusterkit status` lists it: a running job's launcher may be gone."""
        if self.state is JobState.RUNNING and not self.launcher_alive:
            return "running? (launcher gone)"
        return self.state.value

    @property
    def launcher_alive(self) -> bool:
        return self.state is JobState.RUNNING and os.path.exists(f"/proc/{self.launcher_pid}")


class Registry:
    def __init__(self, home: Path) -> None:
        self.root = home / "jobs"

    def path(self, job_id: str) -> Path:
        return self.root / job_id / "job.json"

    def save(self, record: JobRecord) -> None:
        path = self.path(record.job_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, record.to_json() + "\n")
        except OSError as exc:  # e.g. HOME still root's after su/sudo: one line, not a traceback
            raise LaunchError(
                f"cannot write the job record ({exc.strerror or exc})", path=str(path),
                hint=f"make {self.root} writable for you, or point the clusterkit home at a "
                     "directory you can write (docs/launch.md, the error table)") from None

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
            why = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise LaunchError(
                f"unreadable job record ({why})", path=str(path),
                hint=f"written by another clusterkit version, or damaged: move {path.parent} "
                     "aside to go on (the nodes and their checkpoints are untouched: "
                     "`clusterkit collect-ckpt -i INVENTORY --dir CKPT_DIR` gathers them), "
                     "or read it with the clusterkit that wrote it") from None

    def resolve(self, job: str) -> JobRecord:
        """``job`` as clusterkit's job id, else as a Slurm job id of a recorded batch job
        (the newest record naming it)."""
        if self.path(job).is_file() or not job.isdigit():
            return self.load(job)
        named = [r for r in self.all() if job in r.slurm_job_ids]
        if named:
            return max(named, key=lambda r: r.created)
        try:
            return self.load(job)
        except LaunchError as exc:
            raise LaunchError(f"no job {job!r} in the registry: neither a clusterkit job id nor "
                              "the Slurm id of a job `clusterkit sbatch --submit` submitted "
                              "from this machine", path=str(self.root),
                              hint="pass its job dir instead (collect-ckpt --dir JOBDIR); "
                              + (exc.hint or "")) from None

    def record_sbatch(self, job_dir: str | Path, slurm_job_id: str) -> JobRecord:
        """Record a submitted batch job; a resubmission of the same clusterkit job keeps
        the Slurm ids it had (collect-ckpt finds the job by any of them)."""
        record = JobRecord.for_sbatch(job_dir, slurm_job_id)
        prior = self.find(record.job_id)
        if prior is not None and prior.transport == "slurm":
            record.slurm_job_ids = [*(i for i in prior.slurm_job_ids if i != slurm_job_id),
                                    slurm_job_id]
        self.save(record)
        return record

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


def is_sbatch_dir(path: str | None) -> bool:
    """``path`` is the job dir of a `clusterkit sbatch` job (it holds sbatch.sh and plan.json)."""
    return bool(path) and all((Path(str(path)) / f).is_file() for f in (SBATCH_SCRIPT, PLAN_FILE))


def _read_word(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
