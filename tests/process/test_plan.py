"""plan_job: rank mapping, ports, environment, storage and the errors users hit."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from clusterkit.cli.main import main
from clusterkit.errors import ClusterkitError, RenderError, SelectionError
from clusterkit.render.artifacts import FILE_MARK
from clusterkit.spec.job import JobPlan
from clusterkit.spec.ports import master_port
from tests.render_cases import ROOT, plan_for


def test_rank_mapping_and_world_size() -> None:
    plan = plan_for("a800-7x2", "torchrun", nodes=3, gpus_per_node=1)
    assert [(n.name, n.node_rank, list(n.ranks)) for n in plan.nodes] == [
        ("node1", 0, [0]), ("node2", 1, [1]), ("node3", 2, [2])]
    assert plan.world_size == 3 and plan.master_addr == "192.168.10.11"
    assert plan.ds_config["train_batch_size"] == 3


def test_port_is_deterministic_and_matches_bash() -> None:
    assert master_port("a") == master_port("a") and 20000 <= master_port("a") <= 32767
    # Below the ephemeral range, for any id (sampled).
    assert all(20000 <= master_port(f"job-{i}") <= 32767 for i in range(200))
    for job in ("0", "1", "12767", "12768", "40001", "123456789"):
        out = subprocess.run(["bash", "-c", f"SLURM_JOB_ID={job}; echo $(( 20000 + SLURM_JOB_ID % 12768 ))"],
                             capture_output=True, text=True, check=True).stdout
        assert int(out) == master_port(job)


def test_environment_allowlist_never_takes_secrets_by_glob() -> None:
    env = plan_for("h100-2x8-ib", "torchrun", env_allowlist=("HF_*", "WANDB_API_KEY")).nodes[0].env
    assert "HF_TOKEN" not in env and "NCCL_SECRET_KEY" not in env
    assert env["WANDB_API_KEY"] == "wandb-secret"  # listed by exact name: the user asked
    assert env["PATH"].startswith("/home/train/venv/bin:")  # ninja next to the interpreter
    assert env["NCCL_SOCKET_IFNAME"] == "=bond0" and env["WANDB_PROJECT"] == "lm"


@pytest.mark.parametrize(("kwargs", "error", "key"), [
    ({"storage": "shared"}, RenderError, "checkpoint.shared_dir"),
    ({"job_id": "a b"}, RenderError, "--job-id"),
    ({"rdzv": "c10d"}, RenderError, "--rdzv"),
    ({"ckpt_dir": "~/ck", "storage": "node-local"}, RenderError, "--ckpt-dir"),
    ({"ckpt_dir": "/ck"}, RenderError, "--ckpt-dir"),
    ({"set_env": (("X", "a\nb"),)}, RenderError, "X"),
    ({"set_env": (("X", "$(id)"),)}, RenderError, "X"),
    ({"nodes": 9}, SelectionError, "--nodes"),
    ({"offload_param": "cpu"}, RenderError, "offload_param"),
    ({"backend": "deepspeed", "script_args": ("a;b",)}, RenderError, "script argument"),
    ({"backend": "slurm", "partition": "gpu;rm"}, RenderError, "--partition"),
])
def test_errors_name_the_cause(kwargs: dict[str, object], error: type[ClusterkitError],
                               key: str) -> None:
    job = kwargs.pop("job_id", "t")
    with pytest.raises(error) as info:
        plan_for("a800-7x2", "torchrun" if "backend" not in kwargs else str(kwargs.pop("backend")),
                 **kwargs) if job == "t" else _plan_with_job(str(job))
    assert info.value.key == key
    assert "\n" not in info.value.one_line()


def _plan_with_job(job: str) -> object:
    from clusterkit.plan.build import plan_job
    from clusterkit.spec.job import JobOptions
    from tests.render_cases import FACTS, inventory

    return plan_job(inventory("a800-7x2"), JobOptions(job_id=job), FACTS)


def test_unsafe_value_skips_only_the_backends_that_cannot_carry_it() -> None:
    plan = plan_for("a800-7x2", "torchrun", script_args=("--name", "it's; $(x)"))
    assert "deepspeed" in plan.skipped and "deepspeed" not in plan.commands
    assert plan.commands["torchrun"][0].argv[-1] == "it's; $(x)"


def _split_dry_run(text: str) -> dict[str, str]:
    files: dict[str, str] = {}
    chunks = text.split("\n" + FILE_MARK)[1:]
    for chunk in chunks:
        header, _, body = chunk.partition("\n")
        files[header.split(" (")[0]] = body
    return files


def test_dry_run_prints_exactly_what_render_writes(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["render", "-i", str(ROOT / "hostfiles" / "a800-7x2.yaml"), "--job-id", "same",
            "--launcher", "deepspeed", "--zero-stage", "3"]
    script = ["--", "--log-every", "5"]
    assert main([*argv, "--dry-run", *script]) == 0
    printed = _split_dry_run(capsys.readouterr().out)
    assert main([*argv, "--out", str(tmp_path / "out"), *script]) == 0
    written = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert printed == written
    assert "--log-every 5" in written["commands.sh"]
    assert (tmp_path / "out" / "sbatch.sh").stat().st_mode & 0o111


def test_render_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["render", "-i", str(ROOT / "hostfiles" / "a800-7x2.yaml"), "--storage", "shared",
               "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "checkpoint.shared_dir" in err
    assert main(["render"]) == 2 and "--out" in capsys.readouterr().err


def test_write_user_deepspeed_env_replaces_atomically(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".deepspeed_env").write_text("OLD=1\n")
    assert main(["render", "-i", str(ROOT / "hostfiles" / "a800-7x2.yaml"), "--job-id", "u",
                 "--out", str(tmp_path / "o"), "--write-user-deepspeed-env"]) == 0
    assert (tmp_path / ".deepspeed_env").read_text() == (tmp_path / "o" / "deepspeed_env").read_text()
    assert "OLD" not in (tmp_path / ".deepspeed_env").read_text()


def test_checkpoint_dir_is_per_job_under_the_configured_root() -> None:
    # A new job must never resume another job's checkpoint: <root>/<job_id>.
    plan = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=2)
    assert {n.ckpt_dir for n in plan.nodes} == {"/scratch/ckpt/golden-a800-7x2"}
    assert plan.program[plan.program.index("--ckpt-dir") + 1] == "/scratch/ckpt/golden-a800-7x2"
    other = plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=2, storage="shared",
                     ckpt_dir="/mnt/ck/")
    assert other.nodes[0].ckpt_dir == "/mnt/ck/golden-a800-7x2"
    # Slurm: the id is fixed when the script is rendered, so a requeued job resumes.
    assert "/scratch/ckpt/golden-a800-7x2" in plan_for("a800-7x2", "slurm").artifacts["sbatch.sh"]


_GPU_INV = """
schema_version: 1
cluster: {name: mixed}
defaults: {python: /opt/py/bin/python3, workdir: /w, checkpoint: {shared_dir: /ck}}
hosts:
  g1: {address: 10.0.0.1, gpus: 2, slots: 4}
  c1: {address: 10.0.0.2, gpus: 0, slots: 2}
"""


def _mixed_plan(**kw: Any) -> JobPlan:
    from clusterkit.inventory import parse_inventory
    from clusterkit.plan.build import plan_job
    from clusterkit.spec.job import JobOptions
    from tests.render_cases import FACTS

    return plan_job(parse_inventory(_GPU_INV), JobOptions(job_id="w", **kw), FACTS)


def test_fp16_on_cpu_ranks_is_refused_bf16_stands() -> None:
    """Issue 25: --precision fp16 on CPU ranks wrote fp16 into ds_config.json while the
    ranks trained fp32 and the summary said fp32. Asked for explicitly: refused, naming
    the CPU hosts; bf16 stands (DeepSpeed's CPU accelerator trains it); auto stays quiet
    (fp32 on CPU, bf16 on GPUs)."""
    with pytest.raises(RenderError) as exc:
        _mixed_plan(precision="fp16")
    line = exc.value.one_line()
    assert line.startswith("--precision: fp16 needs a GPU for every rank, but c1's ranks "
                           "(gpus: 0) run on the CPU, which trains fp32 or bf16 only — use "
                           "--precision auto"), line
    assert _mixed_plan(precision="fp16", include="g1").ds_config["fp16"]["enabled"]
    assert _mixed_plan(precision="bf16").ds_config["bf16"]["enabled"]
    cpu = _mixed_plan(precision="auto", include="c1")
    assert cpu.zero.precision == "fp32" and "bf16" not in cpu.ds_config
    assert _mixed_plan(precision="auto").zero.precision == "fp32"  # one CPU node: fp32
    assert _mixed_plan(precision="fp32").zero.precision == "fp32"


def test_launch_dry_run_refuses_fp16_on_the_local_cpu_nodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    assert main(["launch", "--dry-run", "--precision", "fp16"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "fp16 needs a GPU for every rank, but local[1-4]'s ranks (gpus: 0) run" in err


def test_plan_warns_on_ranks_without_a_gpu_and_strict_refuses() -> None:
    # issue 12 D6: more ranks than the inventory's GPUs; --gpus-per-node > 0 on gpus: 0.
    plan = _mixed_plan(include="g1")
    assert plan.warnings == ("g1: 4 ranks but gpus: 2 in the inventory; ranks would share GPUs "
                             "(set slots/--gpus-per-node to at most gpus)",)
    plan = _mixed_plan(gpus_per_node=2)
    assert [w.split(":")[0] for w in plan.warnings] == ["c1"]
    assert "--gpus-per-node 2 but gpus: 0" in plan.warnings[0]
    assert _mixed_plan(include="c1").warnings == ()  # a CPU job
    # hosts with the same case fold into one line (32 CPU hosts asked for GPUs: one line)
    from clusterkit.inventory import parse_inventory
    from clusterkit.plan.build import plan_job
    from clusterkit.spec.job import JobOptions
    from tests.render_cases import FACTS

    inv = parse_inventory(_GPU_INV.split("hosts:")[0] + "hosts:\n"
                          "  node[1-32]:\n    address: 10.9.0.[1-32]\n    gpus: 0\n    slots: 1\n")
    warnings = plan_job(inv, JobOptions(job_id="w", gpus_per_node=1), FACTS).warnings
    assert len(warnings) == 1 and warnings[0].startswith("node[1-32]: --gpus-per-node 1 but")
    assert _mixed_plan(nodes=1, gpus_per_node=1).warnings == ()


def test_embedded_default_gives_no_gpu_warning() -> None:
    """`clusterkit launch --nodes 2 --gpus-per-node 2` on the virtual nodes (the README's
    first command): CPU ranks by design, nothing to warn about."""
    from clusterkit.inventory import local_inventory
    from clusterkit.plan.build import plan_job
    from clusterkit.spec.job import JobOptions
    from tests.render_cases import FACTS

    options = JobOptions(job_id="j", nodes=2, gpus_per_node=2)
    assert plan_job(local_inventory("/tmp/ck-local"), options, FACTS).warnings == ()
    with pytest.raises(RenderError) as info:
        _mixed_plan(gpus_per_node=2, strict=True)
    assert info.value.key == "--strict" and "c1: --gpus-per-node 2" in info.value.one_line()


DS_HABIT = """import argparse, deepspeed
p = argparse.ArgumentParser()
p = deepspeed.add_config_arguments(p)
args = p.parse_args()
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
"""


@pytest.mark.parametrize(("text", "kw", "warned"), [
    (DS_HABIT, {}, True),  # DeepSpeed's helper, no config given: every rank would fail
    (DS_HABIT.replace("deepspeed.add_config_arguments(p)",
                      'p.add_argument("--deepspeed_config")'), {}, True),
    (DS_HABIT, {"deepspeed_config_arg": True}, False),  # --deepspeed-config-arg
    (DS_HABIT, {"script_args": ("--deepspeed_config=mine.json",)}, False),  # their own
    (DS_HABIT, {"script_args": ("--deepspeed_config", "mine.json")}, False),
    # docs/examples/train.py: the argument defaults to $CLUSTERKIT_DS_CONFIG
    ('p.add_argument("--deepspeed_config", default=os.environ.get("CLUSTERKIT_DS_CONFIG"))',
     {}, False),
    ("import torch\n", {}, False),  # takes its config some other way
    (None, {}, False),  # not readable on the launching machine
])
def test_a_script_that_takes_deepspeed_config_the_deepspeed_way_is_warned(
        text: str | None, kw: dict[str, Any], warned: bool) -> None:
    """Seen as a user: a script with deepspeed.add_config_arguments launched without
    --deepspeed-config-arg failed on every rank ("DeepSpeed requires --deepspeed_config")."""
    import dataclasses

    from clusterkit.inventory import local_inventory
    from clusterkit.plan.build import plan_job
    from clusterkit.spec.job import JobOptions
    from tests.render_cases import FACTS

    facts = dataclasses.replace(FACTS, script_text=text)
    options = JobOptions(job_id="j", nodes=2, script="train.py", **kw)
    warnings = plan_job(local_inventory("/tmp/ck-local"), options, facts).warnings
    assert warnings == ((
        "train.py takes --deepspeed_config (DeepSpeed's convention) but would get none: add "
        "--deepspeed-config-arg, or read $CLUSTERKIT_DS_CONFIG in the script",) if warned else ())


def test_the_cli_reads_the_script_and_strict_refuses(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text(DS_HABIT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    assert main(["launch", "--nodes", "2", "--dry-run", "train.py"]) == 0
    assert ("clusterkit: warning: train.py takes --deepspeed_config (DeepSpeed's convention) "
            "but would get none") in capsys.readouterr().err
    assert main(["launch", "--nodes", "2", "--dry-run", "--deepspeed-config-arg", "train.py"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["render", "--nodes", "2", "--strict", "--out", str(tmp_path / "out"),
                 "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--strict: train.py takes --deepspeed_config" in err, err
    assert "do what the warning says" in err
