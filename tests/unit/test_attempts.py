"""The attempt table (clusterkit.launch.attempts.decide) row by row, as docs/architecture.md
has it ("The attempt table"), and run.restart_plan performing its steps."""

from __future__ import annotations

import dataclasses

import pytest

from clusterkit.errors import LaunchError
from clusterkit.launch.attempts import AttemptEnd, Next, RestartRules, RestartState, decide
from clusterkit.launch.continuation import reshardable
from clusterkit.launch.run import restart_plan
from clusterkit.spec.job import JobOptions, JobPlan
from tests.paths import REPO

FAILED = AttemptEnd(exit_code=1)
DROP = RestartRules(relaunches=2, drop_failed_nodes=True)
LOCAL = dataclasses.replace(DROP, node_local=True)
BAD = RestartState(bad=("node2",))

# (row id of the doc table, end of the attempt, rules, state) -> next
TABLE: list[tuple[str, AttemptEnd, RestartRules, RestartState, Next]] = [
    ("gate-refused", AttemptEnd(gate_refused=True, exit_code=2), DROP, RestartState(), Next.REFUSE_GATE),
    ("stop", AttemptEnd(exit_code=0), DROP, RestartState(), Next.STOP),
    ("stop", AttemptEnd(exit_code=130, interrupted=True), DROP, RestartState(), Next.STOP),
    ("stop", FAILED, DROP, RestartState(attempt=2), Next.STOP),
    ("stop", FAILED, RestartRules(), RestartState(), Next.STOP),  # no --max-restarts
    ("restart", FAILED, RestartRules(relaunches=1), RestartState(), Next.RESTART),
    ("check", FAILED, DROP, RestartState(attempt=1), Next.CHECK),
    ("none-bad", FAILED, DROP, RestartState(bad=()), Next.RESTART),
    ("fewer-shared", FAILED, DROP, BAD, Next.FEWER),
    ("try-spares", FAILED, LOCAL, BAD, Next.TRY_SPARES),
    ("spares", FAILED, LOCAL, dataclasses.replace(BAD, spares_ok=True), Next.SPARES),
    ("reshard", FAILED, dataclasses.replace(LOCAL, resumes_itself=True),
     dataclasses.replace(BAD, spares_ok=False), Next.FEWER),
    ("refuse", FAILED, LOCAL, dataclasses.replace(BAD, spares_ok=False), Next.REFUSE),
]


@pytest.mark.parametrize(("row", "end", "rules", "state", "want"), TABLE,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(TABLE)])
def test_row(row: str, end: AttemptEnd, rules: RestartRules, state: RestartState,
             want: Next) -> None:
    assert decide(end, rules, state) is want


def test_every_row_of_the_doc_table_has_a_test_row() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    header = "| row | the attempt | options | found out | next |"
    assert header in text, "the attempt table lost its row column"
    table = text.split(header, 1)[1].split("\n\n", 1)[0]
    doc = [ln.split("|")[1].strip().strip("`") for ln in table.strip().splitlines()[1:]]
    assert len(doc) == len(set(doc))
    assert sorted(set(doc) ^ {r[0] for r in TABLE}) == []
    assert {want for *_, want in TABLE} == set(Next)  # every step is some row's


def _planner(spares: tuple[str, ...]):  # type: ignore[no-untyped-def]
    from clusterkit.plan.build import plan_job
    from tests.render_cases import FACTS, inventory
    inv = dataclasses.replace(inventory("a800-7x2"), spares=spares)
    return lambda o: plan_job(inv, o, FACTS)


class _Sink:
    def __init__(self) -> None:
        self.said: list[str] = []

    def info(self, text: str) -> None:
        self.said.append(text)


def _restart(opts: JobOptions, spares: tuple[str, ...], rules: RestartRules,
             bad: list[str]) -> tuple[JobPlan, JobPlan, JobOptions, list[str]]:
    sink = _Sink()
    first = _planner(spares)(opts)
    new, o = restart_plan(opts, first, _planner(spares), sink, FAILED,  # type: ignore[arg-type]
                          rules, RestartState(), check=lambda: bad)
    return first, new, o, sink.said


def test_restart_plan_performs_the_rows() -> None:
    """--drop-failed-nodes (issue 22): shared: the others; node-local: a free spare (same
    node index and ranks), else fewer nodes (resharded: the workload with --resume auto,
    or a user's program), the workload with an explicit --resume refused."""
    shared = JobOptions(job_id="j", backend="torchrun", nodes=3, gpus_per_node=2)
    first, new, o, said = _restart(shared, (), DROP, ["node2"])
    assert [n.name for n in new.nodes] == ["node1", "node3"] and o.include == "node1:0,1@node3:0,1"
    assert said == ["dropping node2 (they fail the pre-launch check now)"]
    first, new, o, said = _restart(shared, (), DROP, [])
    assert new is first and o is shared and said == []
    local = dataclasses.replace(shared, storage="node-local")
    first, new, o, said = _restart(local, ("node7",), LOCAL, ["node2"])
    assert [n.name for n in new.nodes] == ["node1", "node7", "node3"] and o.replace == ("node2",)
    assert [n.first_rank for n in new.nodes] == [n.first_rank for n in first.nodes]
    assert "node2 -> node7 (node index 1)" in said[1]
    resharded = dataclasses.replace(LOCAL, resumes_itself=True)
    first, new, o, said = _restart(local, (), resharded, ["node2"])
    assert [n.name for n in new.nodes] == ["node1", "node3"] and o.include == "node1:0,1@node3:0,1"
    assert "going on with fewer nodes" in said[-1]
    explicit = dataclasses.replace(local, script_args=("--resume", "global_step8"))
    with pytest.raises(LaunchError, match="no spare can take their place"):
        _restart(explicit, (), LOCAL, ["node2"])
    # What restart_rules reads: a user's program is resharded (issue 31), --resume TAG not.
    assert reshardable(_planner(())(dataclasses.replace(local, script="train.py")))
    assert not reshardable(_planner(())(explicit))
    # By the program's profile (spec/programs.Profile.other_world): a torch snapshot goes
    # on as it is, an accelerate script's is resharded inside its folders, DeepSpeed's
    # `latest` of the program's own choosing is refused (issue 38).
    snap = dataclasses.replace(local, script="ddp.py", program_profile="torch-snapshot")
    assert reshardable(_planner(())(snap))
    first, new, o, said = _restart(snap, (), dataclasses.replace(
        LOCAL, resumes_itself=reshardable(_planner(())(snap))), ["node2"])
    assert [n.name for n in new.nodes] == ["node1", "node3"], said
    acc = dataclasses.replace(local, script="train.py", program_profile="accelerate")
    assert reshardable(_planner(())(acc))
    ds = dataclasses.replace(local, script="train.py", program_profile="deepspeed")
    assert not reshardable(_planner(())(ds))
