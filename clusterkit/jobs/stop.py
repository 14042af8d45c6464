"""Stopping a job launched from here on every node: ``clusterkit stop`` and
``clusterkit.api.stop``.

The job's launcher, while it runs, gets SIGTERM and tears the job down itself (and
records it); every node's agent is also asked to sweep the job's processes
(``agent.core --stop``: SIGTERM, the grace, SIGKILL; its answer is the protocol's
``StopReply``), in case a node is beyond the launcher's reach.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from clusterkit.errors import LaunchError
from clusterkit.jobs.status import last_json
from clusterkit.launch.orchestrator import agent_control
from clusterkit.launch.registry import JobRecord, Registry
from clusterkit.node.protocol import DEFAULT_GRACE_S, ProtocolError, StopReply
from clusterkit.remote.dispatch import transport_for
from clusterkit.spec.jobrecord import JobState

STOP_SLACK_S = 20.0  # beyond the grace: the SSH round and the sweep itself


@dataclass(frozen=True)
class NodeStop:
    """One node's part of a stop: the agent's reply, or why there is none."""

    node: str
    reply: StopReply | None = None
    error: str | None = None

    @property
    def stopped(self) -> bool:
        """No process of the job is left on the node."""
        return self.reply is not None and not self.reply.left


@dataclass(frozen=True)
class StopResult:
    job_id: str
    nodes: tuple[NodeStop, ...]

    @property
    def failed(self) -> tuple[NodeStop, ...]:
        """The nodes that could not be reached or still hold a process of the job."""
        return tuple(n for n in self.nodes if not n.stopped)


@dataclass
class StopIncomplete(LaunchError):
    """The stop did not finish on every node; ``result`` says how each node fared."""

    result: StopResult | None = field(default=None, repr=False)


def stop_job(home: Path, job: str, grace_s: float = DEFAULT_GRACE_S) -> StopResult:
    """Stop job ``job`` on every node. Raises :class:`LaunchError` for a job the registry
    does not know and for a batch job (Slurm stops it), and :class:`StopIncomplete`
    (carrying the per-node result) when a node could not be reached or keeps a process
    of the job."""
    registry = Registry(home)
    record = registry.load(job)
    if record.transport == "slurm":
        raise LaunchError(f"job {record.job_id} is Slurm job "
                          f"{','.join(record.slurm_job_ids) or '?'}: Slurm stops it, not "
                          "clusterkit's agents", key="JOB",
                          hint=f"run `{slurm_command(record, 'cancel')}`")
    if record.launcher_alive:
        # The launcher tears the job down itself (and records it); the sweep below
        # still runs in case a node is beyond its reach.
        os.kill(record.launcher_pid, signal.SIGTERM)
    result = StopResult(record.job_id, tuple(_sweep(record, grace_s)))
    if record.state is JobState.RUNNING and not record.launcher_alive:
        record.state = JobState.STOPPED
        registry.save(record)
    if result.failed:
        raise StopIncomplete(f"could not stop job {record.job_id} on {len(result.failed)} "
                             "node(s)", hint="check the nodes above; run `clusterkit stop` again",
                             result=result)
    return result


def _sweep(record: JobRecord, grace_s: float) -> list[NodeStop]:
    cmds = {n.node: agent_control(n.python, "--stop", record.job_id, "--grace", f"{grace_s:g}")
            for n in record.nodes}
    if not cmds:
        return []
    with transport_for() as transport:
        results = transport.run_all([n.target for n in record.nodes],
                                    {k: c.argv for k, c in cmds.items()},
                                    timeout=grace_s + STOP_SLACK_S,
                                    stdin=next(iter(cmds.values())).stdin)
    out: dict[str, NodeStop] = {}
    for r in results:
        answer = last_json(r)  # `agent.core --stop`'s reply (node/protocol.py), or an error
        if "error" in answer:
            out[r.host] = NodeStop(r.host, error=str(answer["error"]))
            continue
        try:
            out[r.host] = NodeStop(r.host, reply=StopReply.from_dict(answer))
        except ProtocolError as exc:
            out[r.host] = NodeStop(r.host, error=str(exc))
    return [out[n.node] for n in record.nodes if n.node in out]


def slurm_command(record: JobRecord, action: str) -> str:
    """``clusterkit sbatch ACTION SLURM_ID``: what to run for a batch job instead."""
    return f"clusterkit sbatch {action} {record.slurm_job_id or 'JOBID'}"
