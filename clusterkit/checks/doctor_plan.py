"""``clusterkit doctor``'s plan (pure): which probe runs on each node and what the rules
compare its facts against.

:func:`plan_doctor` takes inventory hosts and the launching machine's facts and returns a
:class:`DoctorPlan`; :func:`clusterkit.checks.doctor.run_doctor` executes it and the
master-port phase (``checks/doctor_port.py``) reads it. Its own module so that both
import the plan from here and neither imports the other (no import circle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from clusterkit.checks.invoke import FACTS_TIMEOUT_S, facts_argv
from clusterkit.checks.rules_base import DoctorContext, one_machine
from clusterkit.inventory import Host
from clusterkit.launchers import backend as backend_of
from clusterkit.remote.base import DEFAULT_CONNECT_TIMEOUT_S, SSHTarget, target_for

DEFAULT_MASTER_PORT = 29500
# Probes connect to the master's listener at the end of their run; the listener is
# started at the same time, so a probe that is first retries "refused" this long.
# 8 s was too short under load: at 128 nodes (load ~120) the master's login took longer,
# 14 probes gave up, and asking them again (a second SSH round) cost 10.5 s.
MASTER_WAIT_S = 15.0


@dataclass(frozen=True)
class NodeProbe:
    """What runs on one node: the facts probe argv and the env the launch will give it."""

    host: str
    target: SSHTarget
    address: str
    python: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class DoctorPlan:
    nodes: tuple[NodeProbe, ...]
    ctx: DoctorContext
    master_port: int | None = DEFAULT_MASTER_PORT
    probe_timeout_s: float = FACTS_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    max_parallel: int = 128

    @property
    def master(self) -> NodeProbe | None:
        return self.nodes[0] if self.nodes else None


def plan_doctor(
    hosts: Sequence[Host],
    *,
    head_python: str,
    head_cwd: str,
    head_tools: Mapping[str, str | None],
    backend: str = "torchrun",
    master_port: int | None = DEFAULT_MASTER_PORT,
    checkpoint_bytes: int | None = None,
    replicas: int = 0,
    storage: str | None = None,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    accept_new_host_keys: bool = False,
    max_parallel: int = 128,
    spares: Sequence[str] = (),
) -> DoctorPlan:
    """The probes for ``hosts`` (rank order), judged for the launcher ``backend`` (a name
    of the backend registry). Host fields left unset fall back to the launching machine's
    interpreter and cwd, exactly as the launch does."""
    peers = [h.address for h in hosts]
    master = f"{hosts[0].address}:{master_port}" if hosts and master_port else None
    nodes = []
    for h in hosts:
        python = h.python or head_python
        ckpt = [d for d in (h.checkpoint.local_dir, h.checkpoint.shared_dir) if d]
        argv = facts_argv(python, workdir=h.workdir or head_cwd, ckpt_dirs=ckpt, peers=peers,
                          master=master, master_wait=MASTER_WAIT_S)
        nodes.append(NodeProbe(h.name, target_for(h, accept_new_host_keys=accept_new_host_keys),
                               h.address, python, tuple(argv), dict(h.env)))
    # How doctor judges the nodes is the launcher's (the registry's Backend.doctor): DeepSpeed's
    # runner on the first node over pdsh, or one launcher per node with its own interpreter.
    ctx = DoctorContext(
        hosts=tuple(h.name for h in hosts),
        slots={h.name: h.slots for h in hosts},
        gpus={h.name: h.gpus for h in hosts},
        backend=backend_of(backend).doctor,
        head_tools=dict(head_tools),
        head_python=None,  # clusterkit launch never runs the launcher's own interpreter remotely
        checkpoint_bytes=checkpoint_bytes, replicas=replicas,
        local_dirs={h.name: h.checkpoint.local_dir for h in hosts if h.checkpoint.local_dir},
        storage=storage,
        one_machine=one_machine((h.transport, h.address) for h in hosts),
        spares=tuple(spares),
    )
    return DoctorPlan(tuple(nodes), ctx, master_port, connect_timeout_s=connect_timeout_s,
                      max_parallel=max_parallel)
