"""build_ds_config: pure spec -> dict, validated against DeepSpeed's own config parser."""

from __future__ import annotations

import json

import pytest

from clusterkit.errors import RenderError
from clusterkit.spec.zero import ZeroSpec, build_ds_config, resolve_precision


def test_train_batch_size_is_micro_times_accum_times_world() -> None:
    spec = ZeroSpec(stage=2, micro_batch=3, grad_accum=5, world_size=14)
    cfg = build_ds_config(spec)
    assert cfg["train_batch_size"] == 3 * 5 * 14 == spec.train_batch_size
    assert cfg["train_micro_batch_size_per_gpu"] == 3
    assert cfg["gradient_accumulation_steps"] == 5


def test_defaults_render_bf16_zero2_adamw_warmup_cosine() -> None:
    cfg = build_ds_config(ZeroSpec())
    assert cfg["bf16"] == {"enabled": True}
    assert "fp16" not in cfg
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["optimizer"]["type"] == "AdamW"
    assert "torch_adam" not in cfg["optimizer"]["params"]
    sched = cfg["scheduler"]
    assert sched["type"] == "WarmupCosineLR"
    assert sched["params"]["warmup_num_steps"] == 10
    assert cfg["checkpoint"] == {"tag_validation": "FAIL", "use_node_local_storage": False}
    json.dumps(cfg)  # JSON-able


def test_fp32_has_no_precision_block_and_fp16_uses_dynamic_scaling() -> None:
    assert "bf16" not in build_ds_config(ZeroSpec(precision="fp32"))
    fp16 = build_ds_config(ZeroSpec(precision="fp16"))["fp16"]
    assert fp16["enabled"] is True and fp16["loss_scale"] == 0


def test_zero3_offload_and_16bit_gather() -> None:
    cfg = build_ds_config(ZeroSpec(stage=3, offload_optimizer="cpu", offload_param="cpu",
                                   gather_16bit_on_save=True, torch_adam=True))
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    # DeepSpeedCPUAdam is used with optimizer offload, so torch_adam must not be set.
    assert "torch_adam" not in cfg["optimizer"]["params"]


def test_nvme_offload_carries_path() -> None:
    cfg = build_ds_config(ZeroSpec(stage=3, offload_param="nvme", nvme_path="/local_nvme"))
    assert cfg["zero_optimization"]["offload_param"]["nvme_path"] == "/local_nvme"


def test_node_local_and_monitors() -> None:
    cfg = build_ds_config(ZeroSpec(node_local_checkpoints=True, csv_monitor_dir="/run/m",
                                   tensorboard_dir="/run/tb", monitor_job_name="j"))
    assert cfg["checkpoint"]["use_node_local_storage"] is True
    assert cfg["csv_monitor"] == {"enabled": True, "output_path": "/run/m", "job_name": "j"}
    assert cfg["tensorboard"]["output_path"] == "/run/tb"
    assert "csv_monitor" not in build_ds_config(ZeroSpec())


def test_builder_is_pure_and_returns_fresh_dicts() -> None:
    spec = ZeroSpec(stage=1)
    a, b = build_ds_config(spec), build_ds_config(spec)
    assert a == b and a is not b
    a["zero_optimization"]["stage"] = 3
    assert build_ds_config(spec)["zero_optimization"]["stage"] == 1


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"stage": 4}, "stage"),
    ({"offload_param": "cpu", "stage": 2}, "offload_param"),
    ({"offload_optimizer": "cpu", "stage": 0}, "offload_optimizer"),
    ({"offload_optimizer": "nvme", "stage": 2}, "offload_optimizer"),
    ({"stage": 3, "offload_param": "nvme"}, "nvme_path"),
    ({"gather_16bit_on_save": True, "stage": 2}, "gather_16bit_on_save"),
    ({"micro_batch": 0}, "micro_batch"),
    ({"warmup_steps": 0}, "warmup_steps"),
    ({"precision": "fp8"}, "precision"),
    ({"clip": -1.0}, "clip"),
])
def test_invalid_specs_raise_render_error_naming_the_key(kwargs: dict[str, object],
                                                          key: str) -> None:
    with pytest.raises(RenderError) as info:
        ZeroSpec(**kwargs)  # type: ignore[arg-type]
    assert info.value.key == key


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_accepts_rendered_config(stage: int) -> None:
    """DeepSpeed's own parser (no engine, no GPU) accepts every stage we render. Without
    an initialised process group it assumes world size 1, so the spec says so too."""
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    spec = ZeroSpec(stage=stage, precision="bf16", micro_batch=2, grad_accum=4, world_size=1,
                    node_local_checkpoints=True, csv_monitor_dir="/tmp/m")
    parsed = ds_config.DeepSpeedConfig(build_ds_config(spec))
    assert parsed.train_batch_size == 8
    assert parsed.zero_optimization_stage == stage
    assert parsed.use_node_local_storage is True


def test_the_one_precision_rule() -> None:
    """auto: bf16 on GPUs, fp32 on CPU; an explicit fp16 without a GPU is refused (issue 25:
    it reached ds_config.json while the ranks ran fp32); bf16 on CPU stands (it trains)."""
    assert (resolve_precision("auto", True), resolve_precision("auto", False)) == ("bf16", "fp32")
    assert resolve_precision("fp16", True) == "fp16"
    assert resolve_precision("fp32", False) == "fp32"
    assert resolve_precision("bf16", False) == "bf16"
    with pytest.raises(RenderError) as exc:
        resolve_precision("fp16", False, "node[1-2]'s ranks")
    assert exc.value.key == "--precision"
    assert "fp16 needs a GPU for every rank, but node[1-2]'s ranks run on the CPU" in str(exc.value)
    with pytest.raises(RenderError, match="must be one of auto"):
        resolve_precision("fp8", True)
