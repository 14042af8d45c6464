"""launch, render and sbatch take the same job flags with the same defaults (issue 11)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from clusterkit.cli.jobflags import SLURM_GROUP, flag_name, job_fields, job_options
from clusterkit.cli.main import build_parser
from clusterkit.launchers import BACKENDS, DEFAULT_LAUNCHER
from clusterkit.spec.job import JobOptions
from clusterkit.spec.zero import DEFAULT_LR, DEFAULT_MICRO_BATCH, DEFAULT_STEPS, ZeroSpec

VERBS = ("launch", "render", "sbatch")
SHARED = ("--launcher", "--job-id", "--master-addr",
          *(flag_name(f) for f in job_fields() if f.metadata["group"] != SLURM_GROUP))
# The Slurm group: sbatch's, and render's (it writes sbatch.sh); launch refuses them.
SLURM = tuple(flag_name(f) for f in job_fields() if f.metadata["group"] == SLURM_GROUP)


def _verb(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _signature(parser: argparse.ArgumentParser, flag: str) -> tuple[Any, ...]:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return (tuple(action.option_strings), action.dest, action.default, action.choices,
            action.type, action.nargs, action.help, action.metavar, type(action).__name__)


@pytest.mark.parametrize("flag", SHARED)
def test_every_verb_has_the_same_job_flag(flag: str) -> None:
    sigs = {verb: _signature(_verb(verb), flag) for verb in VERBS}
    assert len({repr(s) for s in sigs.values()}) == 1, sigs


@pytest.mark.parametrize("flag", SLURM)
def test_slurm_flags_are_sbatch_and_render_only(flag: str) -> None:
    from clusterkit.errors import ClusterkitError

    assert _signature(_verb("render"), flag) == _signature(_verb("sbatch"), flag)
    with pytest.raises(ClusterkitError) as info:
        _verb("launch").parse_args([flag, "1"])
    assert info.value.key == flag and "only for clusterkit sbatch" in info.value.message
    # not launch's to refuse after the script either: launch does not use them
    assert _program_options("launch", ["train.py", flag, "1"]).script_args == (flag, "1")


def test_defaults_come_from_the_spec() -> None:
    ns = _verb("render").parse_args([])
    o = job_options(ns, job_id="j")
    for f in job_fields():
        assert getattr(o, f.name) == f.metadata["cli_default"], f.name
        # A field's own default is the CLI's, except where "absent" must differ in code.
        assert f.metadata["cli_default"] == f.default or f.name == "hang_timeout_s"
    assert o.hang_timeout_s == 900.0
    assert (o.steps, o.micro_batch, o.lr) == (DEFAULT_STEPS, DEFAULT_MICRO_BATCH, DEFAULT_LR)
    assert (ZeroSpec().lr, ZeroSpec().micro_batch) == (DEFAULT_LR, DEFAULT_MICRO_BATCH)
    assert ns.launcher == DEFAULT_LAUNCHER
    assert o.backend == BACKENDS[DEFAULT_LAUNCHER].plan_backend


def test_workload_defaults_are_the_job_defaults() -> None:
    from clusterkit.workload.args import parse_args

    w = parse_args([])
    assert (w.steps, w.micro_batch, w.lr, w.zero_stage, w.warmup_steps, w.model) == \
        (DEFAULT_STEPS, DEFAULT_MICRO_BATCH, DEFAULT_LR, JobOptions("j").zero_stage,
         JobOptions("j").warmup_steps, JobOptions("j").model)


def test_launcher_choices_are_the_registry() -> None:
    for verb in VERBS:
        (action,) = [a for a in _verb(verb)._actions if "--launcher" in a.option_strings]
        assert tuple(action.choices) == tuple(BACKENDS)
    (doctor,) = [a for a in _verb("doctor")._actions if "--launcher" in a.option_strings]
    assert tuple(doctor.choices) == tuple(BACKENDS) and doctor.default == DEFAULT_LAUNCHER


def test_launch_expresses_what_plan_recommends() -> None:
    # `clusterkit plan` can say "ZeRO-2 + CPU offload": launch takes it now.
    ns = _verb("launch").parse_args(["--zero-stage", "2", "--offload-optimizer", "cpu",
                                     "--precision", "bf16", "--micro-batch", "2"])
    assert (ns.zero_stage, ns.offload_optimizer, ns.precision, ns.micro_batch) == (2, "cpu",
                                                                                  "bf16", 2)


def test_unknown_model_fails_at_parse_time() -> None:
    from clusterkit.errors import UsageError

    with pytest.raises(UsageError) as exc:
        _verb("launch").parse_args(["--model", "llama-7b", "--dry-run"])
    assert exc.value.exit_code == 2 and exc.value.key == "--model"


def test_doctor_tests_the_port_launch_uses() -> None:
    from clusterkit.jobs.doctor import doctor_master_port
    from clusterkit.spec.ports import master_port

    def port(argv: list[str]) -> int | None:
        ns = _verb("doctor").parse_args(argv)
        return doctor_master_port(ns.master_port, ns.job_id, "c")

    assert port(["--job-id", "run7"]) == master_port("run7")
    assert port([]) == master_port("c")
    assert port(["--master-port", "0"]) is None


def test_model_names_are_the_workload_presets() -> None:
    from clusterkit.spec.job import MODEL_NAMES
    from clusterkit.workload.presets import PRESETS

    assert tuple(PRESETS) == MODEL_NAMES


def test_the_same_flags_make_the_same_job_in_every_verb() -> None:
    from clusterkit.cli.cmd_launch import launch_job_options
    from clusterkit.cli.cmd_render import job_options as render_options
    from clusterkit.jobs.launch import launch_options

    def _options(ns: argparse.Namespace, cluster: str) -> JobOptions:  # as api.launch takes it
        return launch_options(launch_job_options(ns), cluster, launcher=ns.launcher)

    argv = ["--job-id", "j", "--zero-stage", "3", "--offload-optimizer", "cpu", "--micro-batch",
            "2", "--storage", "node-local", "--precision", "bf16", "--set-env", "A=1",
            "--env", "HF_*", "--launcher", "deepspeed", "--strict"]
    launch = _options(_verb("launch").parse_args(argv), "c")
    render = render_options(_verb("render").parse_args(argv), "c")
    sbatch = render_options(_verb("sbatch").parse_args(argv), "c")
    assert launch == render == sbatch
    assert (launch.backend, launch.set_env, launch.env_allowlist) == ("deepspeed", (("A", "1"),),
                                                                      ("HF_*",))


def _by_dest(parser: argparse.ArgumentParser, dest: str) -> tuple[Any, ...]:
    (action,) = [a for a in parser._actions if a.dest == dest]
    return (tuple(action.option_strings), action.default, action.type, action.nargs,
            action.help, action.metavar, type(action).__name__)


def _program_options(verb: str, argv: list[str]) -> JobOptions:
    from clusterkit.cli.safety import check_args

    ns = _verb(verb).parse_args(argv)
    check_args(ns)  # as main does: clusterkit flags after the script refused, `--` dropped
    return job_options(ns, job_id="j")


@pytest.mark.parametrize("dest", ("module", "script_option", "program"))
def test_every_verb_has_the_same_program_syntax(dest: str) -> None:
    sigs = {verb: _by_dest(_verb(verb), dest) for verb in VERBS}
    assert len({repr(s) for s in sigs.values()}) == 1, sigs


@pytest.mark.parametrize(("argv", "program"), [
    (["--zero-stage", "3", "train.py", "-x", "1"], ("train.py", None, ("-x", "1"))),
    (["train.py", "--", "--lr", "3e-4", "--nodes", "2"],
     ("train.py", None, ("--lr", "3e-4", "--nodes", "2"))),
    (["--", "train.py", "--steps", "3"], ("train.py", None, ("--steps", "3"))),
    (["-m", "pkg.train", "--", "--steps", "3"], (None, "pkg.train", ("--steps", "3"))),
    (["--", "--log-every", "5"], (None, None, ("--log-every", "5"))),  # the bundled workload
    (["--script", "train.py", "--", "--lr", "3"], ("train.py", None, ("--lr", "3"))),  # deprecated
    ([], (None, None, ())),
])
def test_the_same_program_words_make_the_same_program(argv: list[str],
                                                      program: tuple[Any, ...]) -> None:
    got = {verb: _program_options(verb, argv) for verb in VERBS}
    for verb, o in got.items():
        assert (o.script, o.module, o.script_args) == program, verb


def test_every_verb_refuses_its_launch_flags_after_the_script() -> None:
    from clusterkit.errors import ClusterkitError

    for verb in VERBS:
        with pytest.raises(ClusterkitError) as info:
            _program_options(verb, ["train.py", "--nodes", "2"])
        assert info.value.key == "--nodes", verb
        assert "put it before train.py, or after `--`" in info.value.one_line(), verb
        # the workload group's flags are the script's (jobflags.SCRIPT_GROUPS)
        o = _program_options(verb, ["train.py", "--steps", "5", "--lr=1", "--micro-batch", "2"])
        assert o.script_args == ("--steps", "5", "--lr=1", "--micro-batch", "2"), verb
        assert o.steps == JobOptions("j").steps, verb  # clusterkit's own --steps untouched


def test_the_script_group_is_the_spec_group() -> None:
    from clusterkit.cli.jobflags import SCRIPT_GROUPS, script_dests

    groups = {f.metadata["group"] for f in job_fields()}
    assert set(SCRIPT_GROUPS) <= groups
    assert {"steps", "lr", "micro_batch", "save_every", "zero_stage"} <= script_dests()
    assert not {"nodes", "job_id", "hang_timeout_s", "storage"} & script_dests()


def test_a_bad_script_path_is_named_as_the_program_word() -> None:
    from clusterkit.errors import RenderError
    from tests.render_cases import plan_for

    with pytest.raises(RenderError) as err:
        plan_for("a800-7x2", "torchrun", nodes=2, gpus_per_node=1, script="-x.py")
    assert err.value.key == "SCRIPT" and "SCRIPT '-x.py' is not a script path" in str(err.value)
