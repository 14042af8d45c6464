"""The user-script contract in every plan (clusterkit/node/contract.py, docs/launch.md "Your
own training script"): every node of a plan carries the contract variables in its rank
env, whatever the backend, and ``--deepspeed-config-arg`` appends DeepSpeed's own
argument. The documented example trained, killed and resumed on the test bed:
tests/bed/test_contract_train.py."""

from __future__ import annotations

import pytest

from clusterkit.node.contract import CONTRACT_NAMES, DEEPSPEED_CONFIG_ARG
from tests.render_cases import plan_for


@pytest.mark.parametrize("backend", ["torchrun", "deepspeed", "accelerate", "slurm"])
def test_every_backend_carries_the_contract(backend: str) -> None:
    plan = plan_for("a800-7x2", backend, nodes=2, gpus_per_node=1, storage="node-local",
                    script="train.py")
    for node in plan.nodes:
        env = node.env
        assert set(CONTRACT_NAMES) <= set(env), env
        assert env["CLUSTERKIT_JOB_DIR"] == node.job_dir
        assert env["CLUSTERKIT_DS_CONFIG"] == f"{node.job_dir}/ds_config.json"
        assert env["CLUSTERKIT_CKPT_DIR"] == node.ckpt_dir
        assert env["CLUSTERKIT_STORAGE"] == "node-local"
        assert env["CLUSTERKIT_JOB_ID"] == plan.job_id
    if backend == "deepspeed":  # remote ranks read it from .deepspeed_env
        assert "CLUSTERKIT_CKPT_DIR=" in plan.artifacts["deepspeed_env"]


def test_deepspeed_config_arg_follows_the_script_args() -> None:
    plan = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=1, script="train.py",
                    script_args=("--lr", "3e-4"), deepspeed_config_arg=True)
    for node, program in zip(plan.nodes, plan.programs, strict=True):
        assert program == ("train.py", "--lr", "3e-4", DEEPSPEED_CONFIG_ARG,
                           f"{node.job_dir}/ds_config.json")
    plain = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=1, script="train.py")
    assert DEEPSPEED_CONFIG_ARG not in plain.program
