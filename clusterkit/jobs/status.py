"""What ``clusterkit status`` (and ``clusterkit.api.status``) knows about a job.

A job launched from this machine has a record in the registry (``<home>/jobs``); its
nodes answer ``agent.core --status`` (node/agent/procs.py ``job_status``) with the job's
processes there, and a node-local job's checkpoints are listed for replica health
(checkpoints/replicas/health.py), with collect-ckpt's answer for each
(checkpoints/collect/tags.py). A batch job's nodes are Slurm's: its status is its
record and the Slurm job ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterkit.checkpoints.collect.tags import answers
from clusterkit.checkpoints.collectplan import WithoutMarkers
from clusterkit.checkpoints.replicas.health import (
    JobHealth,
    TagHealth,
    health,
    job_nodes,
    list_all,
)
from clusterkit.launch.orchestrator import agent_control
from clusterkit.launch.registry import JobRecord, Registry
from clusterkit.node.protocol import ProtocolError, answer_of
from clusterkit.remote.base import Transport
from clusterkit.remote.dispatch import transport_for

STATUS_TIMEOUT_S = 20.0  # one node's `agent.core --status` (a process listing and a file read)


@dataclass(frozen=True)
class NodeStatus:
    """One node's answer to ``agent.core --status``, or why there is none (``error``)."""

    node: str
    error: str | None = None  # unreachable, or an answer that is not one
    agent_alive: bool = False
    processes: int = 0  # the job's processes on the node
    ranks: tuple[int, ...] = ()  # its live ranks
    pids: Mapping[int, int] = field(default_factory=dict)  # rank -> pid
    launcher_pid: int | None = None  # the launcher process the agent started, while it runs
    fork_server_pid: int | None = None
    step: int | None = None  # the newest progress: its step, and its age on the node's clock
    progress_age_s: float | None = None
    # The answer as the node sent it (``status --json`` prints it as it came).
    answer: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_answer(cls, node: str, answer: Mapping[str, Any]) -> NodeStatus:
        """From ``agent.core --status``'s JSON (an older agent's answer lacks some keys)."""
        if "error" in answer:
            return cls(node, error=str(answer["error"]), answer=answer)
        pids = _mapping(answer.get("pids"))
        progress = _mapping(answer.get("progress"))
        age = progress.get("age_s")
        step = progress.get("step")
        return cls(node, agent_alive=bool(answer.get("agent_alive")),
                   processes=int(answer.get("processes", 0)),
                   ranks=tuple(int(r) for r in answer.get("ranks", [])),
                   pids={int(r): int(p) for r, p in pids.items()},
                   launcher_pid=_int_or_none(answer.get("launcher_pid")),
                   fork_server_pid=_int_or_none(answer.get("fork_server_pid")),
                   step=step if isinstance(step, int) else None,
                   progress_age_s=float(age) if isinstance(age, (int, float)) else None,
                   answer=answer)


@dataclass(frozen=True)
class JobStatus:
    """One job: its record, each node's status (none for a batch job: Slurm's nodes),
    and a node-local job's replica health per checkpoint (None: not node-local)."""

    record: JobRecord
    nodes: tuple[NodeStatus, ...] = ()
    checkpoints: JobHealth | None = None

    @property
    def slurm(self) -> bool:
        return self.record.transport == "slurm"

    def to_json(self) -> dict[str, Any]:
        """What ``clusterkit status JOB --json`` prints."""
        out: dict[str, Any] = {"job": json.loads(self.record.to_json()),
                               "launcher": self.record.launcher_shown}
        if self.slurm:
            out["slurm_job_ids"] = self.record.slurm_job_ids
            out["checkpoints"] = self.checkpoints.to_json() if self.checkpoints else None
            return out
        out["nodes"] = {n.node: dict(n.answer) for n in self.nodes}
        out["checkpoints"] = self.checkpoints.to_json() if self.checkpoints else None
        return out


def list_jobs(home: Path) -> list[JobRecord]:
    """Every job launched (or submitted) from this machine, as the registry holds them."""
    return Registry(home).all()


def job_status(home: Path, job: str) -> JobStatus:
    """Job ``job``'s record, each node's processes and its checkpoints' replica health.
    Raises :class:`~clusterkit.errors.LaunchError` for a job the registry does not know."""
    record = Registry(home).load(job)
    if record.transport == "slurm":  # its nodes are Slurm's; its checkpoints listed through Slurm
        from clusterkit.jobs.sbatch_health import batch_job_health

        return JobStatus(record, (), batch_job_health(record, home))
    with transport_for() as transport:
        nodes = node_status(transport, record)
        health = checkpoint_answers(transport, record)
    return JobStatus(record, tuple(nodes), health)


def checkpoint_answers(transport: Transport, record: JobRecord) -> JobHealth | None:
    """A node-local job's newest tags, each with its replica health and collect-ckpt's
    answer (checkpoints/collect/tags.py: the one rule); None when it is not node-local
    or its record names no checkpoint dir."""
    ckpt = record.ckpt
    chosen = job_nodes(record.nodes, ckpt)
    if not ckpt.node_local or not chosen:
        return None
    listings = list_all(transport, chosen)
    slots = tuple(int(n) for _, _, n in ckpt.rank_map) if ckpt.rank_map else tuple(ckpt.slots)
    tags: list[TagHealth]
    if ckpt.markers or (slots and all(slots)):
        wm = None if ckpt.markers else WithoutMarkers(world_size=sum(slots), slots=slots)
        tags = list(answers(listings, without_markers=wm))
    else:  # a user's script whose ranks per node the record does not say: replicas' view
        tags = health(listings, markers=False)
    return JobHealth(tags, {ls.node: ls.error for ls in listings if ls.error}, ckpt.markers)


def node_status(transport: Transport, record: JobRecord) -> list[NodeStatus]:
    """Every node of the job asked at once; a node that cannot answer is one NodeStatus
    with its error (work across hosts never stops at the first failure)."""
    cmds = {n.node: agent_control(n.python, "--status", record.job_id, "--job-dir", n.job_dir,
                                  "--node", n.node) for n in record.nodes}
    if not cmds:
        return []
    results = transport.run_all([n.target for n in record.nodes],
                                {k: c.argv for k, c in cmds.items()}, timeout=STATUS_TIMEOUT_S,
                                stdin=next(iter(cmds.values())).stdin)
    answers = {r.host: NodeStatus.from_answer(r.host, last_json(r)) for r in results}
    return [answers[n.node] for n in record.nodes if n.node in answers]


def last_json(r: Any) -> dict[str, Any]:
    """A node program's answer: the JSON object on its last stdout line, else
    ``{"error": ...}`` (without the host's name, so equal errors fold into one line)."""
    if r.error is not None:
        return {"error": r.reason()}
    try:
        return answer_of(r.result.stdout)
    except ProtocolError:
        tail = (r.result.stderr or r.result.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {r.result.exit_code}: {tail[0]}"}


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
