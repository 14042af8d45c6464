"""Checkpoint replicas in the plan (issue 22): --replicas, the inventory default, the ring
placement and its warnings, and the per-run secret that reaches only the agents' spec."""

from __future__ import annotations

import json
from typing import Any

import pytest

from clusterkit.errors import RenderError
from clusterkit.inventory import parse_inventory
from clusterkit.launch.fromplan import job_from_plan
from clusterkit.plan.build import plan_job
from clusterkit.render.artifacts import render_all, summary
from clusterkit.spec.job import JobOptions, LaunchPlan
from tests.render_cases import FACTS, plan_for


def _inv(addresses: list[str], names: list[str] | None = None, extra: str = "") -> str:
    names = names or [f"n{i + 1}" for i in range(len(addresses))]
    # Hosts on one address are one machine reached on different ssh ports.
    hosts = "".join(f"  {n}: {{address: {a}, ssh: {{port: {22 + i}}}}}\n"
                    for i, (n, a) in enumerate(zip(names, addresses, strict=True)))
    return ("schema_version: 1\ncluster: {name: t}\ndefaults:\n  python: /usr/bin/python3\n"
            "  workdir: /w\n  checkpoint: {local_dir: /scratch/ck" + extra + "}\nhosts:\n" + hosts)


def _rendered_plan(text: str, **kw: object) -> LaunchPlan:
    return render_all(plan_job(parse_inventory(text), JobOptions(job_id="j", **kw),  # type: ignore[arg-type]
                               FACTS))


def test_the_default_is_one_copy_on_the_ring_successor_with_node_local_storage() -> None:
    plan = plan_for("a800-7x2", "torchrun")
    assert plan.replica_targets == ((1,), (2,), (3,), (4,), (5,), (6,), (0,))
    assert plan.replica_sources(0) == (6,)
    assert "  replicas: node1 -> node2; node2 -> node3;" in summary(plan)
    assert json.loads(plan.artifacts["plan.json"])["replicas"]["node7"] == ["node1"]
    assert not plan.warnings


def test_k_two_and_zero() -> None:
    plan = plan_for("a800-7x2", "torchrun", nodes=3, replicas=2)
    assert plan.replica_targets == ((1, 2), (2, 0), (0, 1))
    off = plan_for("a800-7x2", "torchrun", replicas=0)
    assert off.replica_targets == () and "replicas" not in json.loads(off.artifacts["plan.json"])


def test_shared_storage_and_one_node_replicate_nothing() -> None:
    assert plan_for("h100-2x8-ib", "torchrun").replica_targets == ()  # shared by default
    plan = plan_for("h100-2x8-ib", "torchrun", replicas=1)
    assert plan.replica_targets == () and "no checkpoint replicas with shared storage" \
        in plan.warnings[0]
    one = plan_for("a800-7x2", "torchrun", nodes=1, replicas=1)
    assert one.replica_targets == () and "one node" in one.warnings[0]


def test_nodes_on_one_address_are_skipped() -> None:
    # n1 and n2 share a machine: n1's copy goes past n2 to n3; n3's to n1 (not n2 too).
    plan = _rendered_plan(_inv(["10.0.0.1", "10.0.0.1", "10.0.0.3"]), replicas=2)
    assert plan.replica_targets == ((2,), (2,), (0,))
    assert len(plan.warnings) == 1 and "1 of 2 checkpoint replicas placed" in plan.warnings[0]
    # The default K places what it can, silently; local virtual nodes share 127.0.0.1.
    same = _rendered_plan(_inv(["10.0.0.1", "10.0.0.1"]))
    assert same.replica_targets == () and not same.warnings
    assert plan_for("local", "torchrun").replica_targets == ()


def test_the_inventory_default() -> None:
    plan = _rendered_plan(_inv(["10.0.0.1", "10.0.0.2", "10.0.0.3"], extra=", replicas: 2"))
    assert plan.replica_targets == ((1, 2), (2, 0), (0, 1))
    assert _rendered_plan(_inv(["10.0.0.1", "10.0.0.2"], extra=", replicas: 0")).replica_targets == ()
    assert _rendered_plan(_inv(["10.0.0.1", "10.0.0.2"], extra=", replicas: 0"),
                 replicas=1).replica_targets == ((1,), (0,))  # the flag wins
    with pytest.raises(Exception, match="replicas"):
        parse_inventory(_inv(["10.0.0.1"], extra=", replicas: -1"))


def test_negative_and_sbatch_only_backends_are_refused() -> None:
    with pytest.raises(RenderError, match=r"^--replicas: must be >= 0, got -1$") as neg:
        plan_for("a800-7x2", "torchrun", replicas=-1)
    assert neg.value.key == "--replicas"
    # One bound for the flag and the inventory's checkpoint.replicas (inventory.MAX_REPLICAS).
    with pytest.raises(RenderError, match=r"^--replicas: must be <= 16, got 17$"):
        plan_for("a800-7x2", "torchrun", replicas=17)
    with pytest.raises(RenderError, match="node agents") as err:
        plan_for("a800-7x2", "slurm", replicas=1)
    assert err.value.key == "--replicas"
    assert plan_for("a800-7x2", "slurm").replica_targets == ()


def test_the_secret_reaches_only_the_agent_spec() -> None:
    plan = plan_for("a800-7x2", "torchrun", nodes=3)
    job = job_from_plan(plan)
    secrets = {t.replica["secret"] for t in job.tasks if t.replica}
    assert len(secrets) == 1 and len(next(iter(secrets))) == 64
    assert job_from_plan(plan).tasks[0].replica["secret"] not in secrets  # per run
    secret = next(iter(secrets))
    r0 = job.tasks[0].replica
    assert r0 is not None
    assert r0["targets"] == [{"node": "node2", "index": 1, "address": "192.168.10.12"}]
    assert r0["sources"] == [2] and r0["ranks"] == [0, 1] and r0["markers"] is True
    assert r0["ckpt_dir"] == plan.nodes[0].ckpt_dir
    for t in job.tasks:
        assert secret not in json.dumps([list(t.argv), dict(t.env), dict(t.files)])
    assert all(secret not in text for text in plan.artifacts.values())
    spec = job.agent_spec(job.tasks[0])
    assert spec.replica is not None and spec.replica["secret"] == secret
    # A user's own script writes no completion markers.
    own = job_from_plan(plan_for("a800-7x2", "torchrun", nodes=2, script="train.py"))
    assert own.tasks[0].replica is not None and own.tasks[0].replica["markers"] is False


def test_doctor_counts_the_replicas_a_node_local_dir_holds() -> None:
    from dataclasses import replace

    from clusterkit.checks.facts import StorageFacts
    from clusterkit.checks.findings import Status
    from clusterkit.checks.rules_base import GiB
    from clusterkit.checks.rules_host import check_storage
    from tests.helpers import CTX, HOSTS, cluster, only_node7

    def node7(findings: list[Any]) -> Any:
        return next(f for f in findings if f.host == "node7")

    roomy = (StorageFacts("/ckpt", True, True, 250 * GiB, 1000 * GiB),)
    assert node7(check_storage(cluster(storage=roomy), CTX)).status is Status.PASS  # 2.5 x 100 GiB
    ctx = replace(CTX, replicas=1, local_dirs={h: "/ckpt" for h in HOSTS})
    f = only_node7(check_storage(cluster(storage=roomy), ctx), "storage:/ckpt")
    assert f.status is Status.WARN and "one checkpoint + 1 replica(s)" in f.detail
    tight = (StorageFacts("/ckpt", True, True, 150 * GiB, 1000 * GiB),)
    f = only_node7(check_storage(cluster(storage=tight), ctx), "storage:/ckpt")
    assert f.status is Status.FAIL and "< 200.0 GiB" in f.detail
    # A shared dir holds no replicas.
    shared = replace(ctx, local_dirs={h: "/local" for h in HOSTS})
    assert node7(check_storage(cluster(storage=roomy), shared)).status is Status.PASS


def test_no_agent_waits_for_a_watch_only_peers_bye() -> None:
    """DeepSpeed's runner starts the other nodes' ranks over pdsh: their agents only watch
    and are closed after node 0's ended, so node 0 must not wait for their BYE."""
    plan = plan_for("a800-7x2", "deepspeed", nodes=3)
    job = job_from_plan(plan)
    replicas = [t.replica for t in job.tasks]
    assert all(r is not None for r in replicas)
    # node 0 ran the runner: its holder (node 1) may wait for it; it waits for nobody
    assert [r["sources"] for r in replicas if r] == [[], [0], []]
    assert [[t["index"] for t in r["targets"]] for r in replicas if r] == [[1], [2], [0]]
