"""What one attempt of a job runs: :class:`JobSpec` with one :class:`NodeTask` per node.

Split out of the orchestrator (issue 23 item 1) so that the launch runtime
(:mod:`clusterkit.launch.runtime`, pure) and the I/O loop that drives it
(:mod:`clusterkit.launch.orchestrator`) read one definition, and the job's
builders (``fromplan``, ``jobs``) import it from here, not from the I/O loop.
:meth:`JobSpec.agent_spec` is the one place a task becomes the
:class:`~clusterkit.node.protocol.AgentSpec` its node's agent gets.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterkit.node import protocol
from clusterkit.node.contract import ENV_ZYGOTE, ENV_ZYGOTE_IMPORTS, JOB_ID_TOKEN, with_job_id
from clusterkit.remote.base import SSHTarget

# Native launches (issue 15): each node's agent starts a fork server that imports
# these once, then forks the ranks. CLUSTERKIT_ZYGOTE=0 switches it off (each rank
# is its own `python -u ...` again); CLUSTERKIT_ZYGOTE_IMPORTS=a,b names the modules.
ZYGOTE_ENV, ZYGOTE_IMPORTS_ENV = ENV_ZYGOTE, ENV_ZYGOTE_IMPORTS
ZYGOTE_IMPORTS = ("torch", "torch.distributed")
# The bundled workload's own modules (deepspeed stays with the ranks: on a GPU node
# its accelerator probe opens the driver, after which forking is not safe), and
# torch._dynamo: every torch optimizer imports it when it is built (2.1 s of CPU per
# rank, measured on torch 2.13 CPU; no thread, no device). Not for a user's script,
# which may never build an optimizer (the launch bench's does not).
WORKLOAD_IMPORTS = ("torch._dynamo", "clusterkit.workload.main")
_OFF = ("0", "off", "no", "false")


def zygote_imports(task: NodeTask, environ: Mapping[str, str] | None = None) -> list[str]:
    """What the task's fork server imports before forking (empty: no fork server)."""
    env = os.environ if environ is None else environ
    if task.native is None or env.get(ZYGOTE_ENV, "").strip().lower() in _OFF:
        return []
    named = env.get(ZYGOTE_IMPORTS_ENV, "").strip()
    if named:
        return [m.strip() for m in named.split(",") if m.strip()]
    workload = "clusterkit.workload" in task.argv
    return [*ZYGOTE_IMPORTS, *(WORKLOAD_IMPORTS if workload else ())]


@dataclass(frozen=True)
class NodeTask:
    """What one node runs. ``argv`` empty: the agent only watches (pdsh peers)."""

    node: str
    target: SSHTarget
    python: str
    argv: tuple[str, ...]
    rank_offset: int
    nprocs: int
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    files: Mapping[str, str] = field(default_factory=dict, hash=False)
    cwd: str | None = None
    prefix: str = "torchrun"  # torchrun | pdsh | single (see agent.Spec.prefix)
    job_dir: str = f"~/.cache/clusterkit/jobs/{JOB_ID_TOKEN}"  # on the node; ~ is the node's home
    rank_log_dir: str | None = None  # per-rank log files to stream (DeepSpeed's launcher)
    native: Mapping[str, Any] | None = None  # the agent starts the ranks (see agent.Spec)
    needs: tuple[str, ...] = ()  # files the gate checks on the node (the user's script)
    # Checkpoint replication (issue 22): AgentSpec.replica for this node, None: off. It
    # holds the per-run secret, so it stays out of the repr (tracebacks, debug prints).
    replica: Mapping[str, Any] | None = field(default=None, hash=False, repr=False)


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    tasks: tuple[NodeTask, ...]
    attempt: int = 0
    grace_s: float = protocol.DEFAULT_GRACE_S
    # The pre-launch gate folded into the agents (None: no gate): packages every node
    # must have; agents report their facts and start nothing until the launcher's GO.
    gate_need: tuple[str, ...] | None = None
    gate_same_python: bool = True  # the backend's Backend.same_python: see gate.judge
    gate_script_here: bool = True  # gate.script_is_here: how a missing script is named
    # Hangs (issue 14): the agents' dead-man switch (0: off) and the progress
    # watchdog (0: off); see clusterkit.launch.watchdog.
    keepalive_s: float = 0.0
    hang_timeout_s: float = 0.0

    def rank_offsets(self) -> dict[str, int]:
        return {t.node: t.rank_offset for t in self.tasks}

    def agent_spec(self, task: NodeTask) -> protocol.AgentSpec:
        return protocol.AgentSpec(
            job_id=self.job_id, node=task.node,
            job_dir=with_job_id(task.job_dir, self.job_id),
            argv=list(task.argv), env=dict(task.env), files=dict(task.files),
            cwd=task.cwd, attempt=self.attempt, prefix=task.prefix,
            rank_offsets=self.rank_offsets(), grace_s=self.grace_s,
            rank_log_dir=task.rank_log_dir,
            native=dict(task.native) if task.native is not None else None,
            hold=self.gate_need is not None, keepalive_s=self.keepalive_s,
            local_ranks=task.nprocs, zygote=zygote_imports(task), needs=list(task.needs),
            replica=dict(task.replica) if task.replica is not None else None,
        )
