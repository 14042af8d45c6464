"""What follows one attempt of a launch: the attempt table, pure (no I/O).

``decide(end, rules, state) -> Next`` is every choice :func:`clusterkit.launch.run.launch`
makes between two attempts: stop, refuse, restart the same plan, or (with
``--drop-failed-nodes``) find the nodes that fail the gate now and restart without
them: on free spares (node-local checkpoints: the same node index and ranks, the
part restored there), else on fewer nodes (shared checkpoints; node-local ones when
their checkpoint continues on another world size, launch/continuation.other_world:
resharded for the bundled workload with ``--resume auto``, a script of clusterkit's
contract, HF's Trainer and accelerate's save_state (inside their own folders), the
conversion refusing what it cannot convert; a torch snapshot as it is,
copied to every node), else refused. ``run.py``
performs each step (the gate round, the planner) and asks again with what it
learned in ``state``. The table is docs/architecture.md's "The attempt table", tested
row by row in tests/unit/test_attempts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Next(Enum):
    """What the launch does next."""

    REFUSE_GATE = "refuse-gate"  # the gate refused: record "not-started", exit 2
    STOP = "stop"  # the job's result is this attempt's
    RESTART = "restart"  # run the same plan again
    CHECK = "check"  # run the gate on its own: which nodes fail it now?
    TRY_SPARES = "try-spares"  # plan with each failing node replaced by a spare
    SPARES = "spares"  # restart on that plan (its parts restored onto the spares)
    FEWER = "fewer"  # restart on the other nodes
    REFUSE = "refuse"  # node-local, no spare, the workload with an explicit --resume


@dataclass(frozen=True)
class AttemptEnd:
    """How the attempt ended (from its ``JobOutcome``)."""

    gate_refused: bool = False
    exit_code: int = 0
    interrupted: bool = False


@dataclass(frozen=True)
class RestartRules:
    """The launch's options that the table reads."""

    relaunches: int = 0  # --max-restarts
    drop_failed_nodes: bool = False
    node_local: bool = False  # checkpoints tied to the rank->node mapping
    # its checkpoint continues on fewer nodes: resharded (the bundled workload with
    # --resume auto, clusterkit's contract, HF's Trainer, accelerate) or as it is (a
    # torch snapshot):
    # launch/continuation.py reshardable, from spec/programs.Profile.other_world
    resumes_itself: bool = False


@dataclass(frozen=True)
class RestartState:
    """What the launch knows so far; None: not found out yet."""

    attempt: int = 0
    bad: tuple[str, ...] | None = None  # the nodes that fail the gate now
    spares_ok: bool | None = None  # a plan with spares for them could be made


def decide(end: AttemptEnd, rules: RestartRules, state: RestartState) -> Next:
    """The next step after an attempt (the attempt table, top row first)."""
    if end.gate_refused:
        return Next.REFUSE_GATE
    if end.exit_code == 0 or end.interrupted or state.attempt >= rules.relaunches:
        return Next.STOP
    if not rules.drop_failed_nodes:
        return Next.RESTART
    if state.bad is None:
        return Next.CHECK
    if not state.bad:
        return Next.RESTART
    if not rules.node_local:
        return Next.FEWER
    if state.spares_ok is None:
        return Next.TRY_SPARES
    if state.spares_ok:
        return Next.SPARES
    return Next.FEWER if rules.resumes_itself else Next.REFUSE
