"""Every rendered artifact read back by its real consumer.

DeepSpeed's hostfile parser and config validator, accelerate's config loader,
DeepSpeed's own .deepspeed_env export logic, ``bash -n``, ``ssh -G`` and real pdsh.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from clusterkit.render.dsenv import parse_deepspeed_env
from clusterkit.spec.job import LaunchPlan
from tests.render_cases import BACKENDS, INVENTORIES, plan_for

PLANS = {(inv, b): plan_for(inv, b) for inv in INVENTORIES for b in BACKENDS}


def _write_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("inv", INVENTORIES)
def test_deepspeed_parses_every_hostfile(inv: str, tmp_path: Path) -> None:
    from deepspeed.launcher.runner import _parse_hostfile

    plan = PLANS[(inv, "torchrun")]
    lines = plan.artifacts["hostfile"].splitlines()
    pool = _parse_hostfile(lines)
    assert list(pool.items()) == [(n.name, n.nproc) for n in plan.nodes]


def test_deepspeed_parses_a_partial_selection() -> None:
    from deepspeed.launcher.runner import _parse_hostfile

    plan = plan_for("a800-7x2", "torchrun", include="node3:1@node5")
    assert dict(_parse_hostfile(plan.artifacts["hostfile"].splitlines())) == {"node3": 1, "node5": 2}
    assert [(n.name, n.slots, n.first_rank) for n in plan.nodes] == [("node3", (1,), 0),
                                                                      ("node5", (0, 1), 1)]


def _validate_ds_config(config: dict[str, Any], world: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    import deepspeed.runtime.config as ds_config_mod

    # Outside a process group DeepSpeedConfig assumes world size 1; give it the job's.
    monkeypatch.setattr(ds_config_mod.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config_mod.dist, "get_world_size", lambda *a, **k: world)
    return ds_config_mod.DeepSpeedConfig(json.loads(json.dumps(config)))


VARIANTS = [
    (stage, opt, param, precision)
    for stage, opt, param, precision in itertools.product(
        (0, 1, 2, 3), ("none", "cpu", "nvme"), ("none", "cpu", "nvme"), ("bf16", "fp16", "fp32"))
    if not (stage == 0 and opt != "none") and not (stage != 3 and param != "none")
    and not (opt == "nvme" and stage != 3)
]


@pytest.mark.parametrize(("stage", "opt", "param", "precision"), VARIANTS)
def test_deepspeed_config_accepts_every_variant(stage: int, opt: str, param: str, precision: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_for("a800-7x2", "deepspeed", zero_stage=stage, offload_optimizer=opt,
                    offload_param=param, precision=precision, micro_batch=2, grad_accum=3,
                    save_16bit=stage == 3, tensorboard=True)
    config = json.loads(plan.artifacts["ds_config.json"])
    ds = _validate_ds_config(config, plan.world_size, monkeypatch)
    assert ds.zero_optimization_stage == stage
    assert ds.train_batch_size == 2 * 3 * 14 == config["train_batch_size"]
    assert ds.gradient_accumulation_steps == 3
    assert ds.bfloat16_config.enabled is (precision == "bf16")
    assert ds.float16_config.enabled is (precision == "fp16")
    assert ds.use_node_local_storage is True
    if opt != "none":
        assert ds.zero_config.offload_optimizer.device == opt
    if param != "none":
        assert ds.zero_config.offload_param.device == param
        assert ds.zero_config.offload_param.nvme_path is None or \
            str(ds.zero_config.offload_param.nvme_path).startswith("/scratch/ckpt")


@pytest.mark.parametrize("inv", INVENTORIES)
def test_accelerate_loads_every_yaml(inv: str, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    plan = PLANS[(inv, "accelerate")]
    for node in plan.nodes:
        name = f"accelerate_config.rank{node.node_rank}.yaml"
        cfg = load_config_from_file(str(_write_file(tmp_path, name, plan.artifacts[name])))
        assert cfg.distributed_type.value == "DEEPSPEED"
        assert cfg.machine_rank == node.node_rank
        assert cfg.num_machines == len(plan.nodes)
        assert cfg.num_processes == plan.world_size
        assert cfg.main_process_ip == plan.master_addr
        assert cfg.main_process_port == plan.master_port
        assert cfg.rdzv_backend == "static" and cfg.same_network is True
        assert cfg.deepspeed_config["deepspeed_config_file"] == f"{node.job_dir}/ds_config.json"
        # precision lives only in ds_config.json: accelerate raises if the YAML sets it too
        assert cfg.mixed_precision is None
        ignored = {"zero_stage", "offload_optimizer_device", "offload_param_device",
                   "gradient_accumulation_steps", "gradient_clipping", "zero3_save_16bit_model"}
        assert not ignored & set(cfg.deepspeed_config)


def test_accelerate_without_deepspeed_sets_precision_once(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    plan = plan_for("h100-2x8-ib", "accelerate", accelerate_use_deepspeed=False, precision="bf16")
    cfg = load_config_from_file(str(_write_file(tmp_path, "a.yaml",
                                           plan.artifacts["accelerate_config.rank0.yaml"])))
    assert cfg.distributed_type.value == "MULTI_GPU" and cfg.mixed_precision == "bf16"
    assert cfg.deepspeed_config == {} or cfg.deepspeed_config is None
    cpu = plan_for("local", "accelerate", accelerate_use_deepspeed=False)
    cfg = load_config_from_file(str(_write_file(tmp_path, "b.yaml",
                                           cpu.artifacts["accelerate_config.rank0.yaml"])))
    assert cfg.distributed_type.value == "MULTI_CPU" and cfg.use_cpu is True


@pytest.mark.parametrize(("inv", "backend"), list(PLANS))
def test_bash_n_accepts_every_script(inv: str, backend: str, tmp_path: Path) -> None:
    plan = PLANS[(inv, backend)]
    for name in ("sbatch.sh", "commands.sh"):
        path = _write_file(tmp_path, name, plan.artifacts[name])
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"


def test_deepspeed_env_reads_back_through_deepspeeds_export_logic() -> None:
    """DeepSpeed's own add_export quoting, then a real shell: values arrive verbatim."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    plan = plan_for("h100-2x8-ib", "deepspeed", set_env=(("MY_LIST", "a b,c;d|e&f'g"),))
    text = plan.artifacts["deepspeed_env"]
    assert "" not in text.splitlines() and not any(x.startswith("#") for x in text.splitlines())
    runner = PDSHRunner.__new__(PDSHRunner)
    runner.exports = {}
    for line in text.splitlines(keepends=True):  # runner.py main(): exactly this loop
        key, val = line.split("=", maxsplit=1)
        runner.add_export(key, val)
    exports = "".join(f"export {k}={v}; " for k, v in runner.exports.items())
    printer = 'python3 -c "import os,json,sys; print(json.dumps({k: os.environ[k] for k in sys.argv[1:]}))"'
    script = f"{exports}{printer} {' '.join(runner.exports)}"
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == parse_deepspeed_env(text) == dict(plan.nodes[0].env)


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client")
@pytest.mark.parametrize("inv", ["a800-7x2", "h100-2x8-ib"])
def test_ssh_reads_the_ssh_config(inv: str, tmp_path: Path) -> None:
    plan = PLANS[(inv, "deepspeed")]
    path = _write_file(tmp_path, "ssh_config", plan.artifacts["ssh_config"])
    for node in plan.nodes:
        out = subprocess.run(["ssh", "-F", str(path), "-G", node.name], capture_output=True,
                             text=True, check=True, env={**os.environ, "HOME": str(tmp_path)}).stdout
        opts = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
        assert opts["hostname"] == node.host.address
        assert opts["user"] == node.host.ssh.user
        assert opts["batchmode"] == "yes"
        if node.host.ssh.proxy_jump:
            assert opts["proxyjump"] == node.host.ssh.proxy_jump


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="no pdsh")
def test_pdsh_node_rank_follows_hostfile_order(tmp_path: Path) -> None:
    """pdsh's %n (what DeepSpeed's runner and our fan-out use) is the -w order, not sorted."""
    from clusterkit.inventory import parse_inventory
    from clusterkit.plan.build import plan_job
    from clusterkit.render.artifacts import render_all
    from clusterkit.spec.job import JobOptions
    from tests.render_cases import FACTS

    inv = parse_inventory("schema_version: 1\nhosts:\n  zeta: {slots: 1}\n  alpha: {slots: 1}\n"
                          "  node10: {slots: 1}\n  node2: {slots: 1}\n"
                          "defaults: {checkpoint: {shared_dir: /ck}}\n")
    plan: LaunchPlan = render_all(plan_job(inv, JobOptions(job_id="order"), FACTS))
    (cmd,) = plan.commands["torchrun-pdsh"]
    hosts = cmd.argv[cmd.argv.index("-w") + 1]
    out = subprocess.run(["pdsh", "-R", "exec", "-w", hosts, "echo", "%h", "%n"],
                         capture_output=True, text=True, check=True).stdout
    ranks = {h: int(n) for _, h, n in (line.split() for line in out.splitlines())}
    assert ranks == {n.name: n.node_rank for n in plan.nodes}
