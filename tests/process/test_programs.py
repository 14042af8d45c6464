"""Program profiles (issue 38, docs/programs.md): the pure decisions as tables first
(detection, the layout on disk, the resume argument, what node-local adds, the step-0
rule), then the plan's, the agent's and the restart's use of them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clusterkit.checkpoints.replicas.assemble import Assembly
from clusterkit.errors import LaunchError, RenderError
from clusterkit.fold import Folded
from clusterkit.inventory import load_inventory
from clusterkit.jobs.recover import resume_plan
from clusterkit.launch.continuation import needs_ready, resume_note, resume_watch
from clusterkit.launch.fromplan import checkpoint_prep, job_from_plan
from clusterkit.node.ckpt.ready import ready_checkpoints
from clusterkit.node.contract import ASIDE_SUFFIX, JobDir
from clusterkit.node.hooks import accelerate_cpu
from clusterkit.plan.build import plan_job
from clusterkit.plan.profile import cpu_hook_source
from clusterkit.render.artifacts import render_all
from clusterkit.spec.job import JobOptions, JobPlan
from clusterkit.spec.programs import (
    ACCELERATE,
    ACCELERATE_CONFIG_ENV,
    CONTRACT,
    CPU_HOOK_FILE,
    CUSTOM,
    DEEPSPEED,
    DERIVED_DS_CONFIG,
    HF,
    LIBRARY_DS_CONFIG,
    PROFILES,
    SNAPSHOT,
    UNKNOWN,
    cpu_hook_env,
    detect,
    from_layout,
    node_local_args,
    node_local_config,
    program_ds_config,
)
from clusterkit.spec.resume import began_fresh_line, restart_problem, resumed_program, with_resume
from tests.render_cases import FACTS, inventory, plan_for

HF_SRC = "from transformers import Trainer, TrainingArguments\ntrainer = Trainer(model=m)\n"
ACC_SRC = "from accelerate import Accelerator\nacc = Accelerator()\nacc.save_state(d)\n"
DS_SRC = "import deepspeed\nengine.save_checkpoint(d, tag=t)\nengine.load_checkpoint(d)\n"
SNAP_SRC = "import torch\nif rank == 0:\n    torch.save(snapshot, path)\n"
CONTRACT_SRC = ("d = os.environ['CLUSTERKIT_CKPT_DIR']\ntag = os.environ.get('CLUSTERKIT_RESUME_TAG')"
                "\nengine.save_checkpoint(d, tag=t)\n")
OWN_SRC = "d = os.environ['CLUSTERKIT_CKPT_DIR']\nopen(d + '/state.bin', 'wb')\n"

# (id, args, source, --program, --resume-arg, workload) -> profile
DETECT = [
    ("workload", (), None, None, None, True, CONTRACT),
    ("hf-source", ("--output_dir", "/o"), HF_SRC, None, None, False, HF),
    ("hf-args-only", ("--output_dir", "/o", "--deepspeed", "ds.json"), "print(1)\n", None,
     None, False, HF),
    ("hf-no-source", ("--output_dir", "/o", "--deepspeed", "ds.json"), None, None, None, False,
     HF),
    ("accelerate", (), ACC_SRC, None, None, False, ACCELERATE),
    ("deepspeed", (), DS_SRC, None, None, False, DEEPSPEED),
    ("snapshot", (), SNAP_SRC, None, None, False, SNAPSHOT),
    ("ddp-tutorial", (), "class Trainer:\n    pass\ntrainer = Trainer(model)\n" + SNAP_SRC,
     None, None, False, SNAPSHOT),
    ("seq2seq", (), "args = Seq2SeqTrainingArguments(o)\n", None, None, False, HF),
    ("contract-before-deepspeed", (), CONTRACT_SRC, None, None, False, CONTRACT),
    ("deepspeed-in-ckpt-dir", (), DS_SRC + OWN_SRC, None, None, False, DEEPSPEED),
    ("own-saves-in-ckpt-dir", (), OWN_SRC, None, None, False, CONTRACT),
    ("unknown", ("--epochs", "3"), "print('hello')\n", None, None, False, UNKNOWN),
    ("not-readable", (), None, None, None, False, CONTRACT),
    ("resume-arg", (), "print(1)\n", None, "--resume {dir}", False, CUSTOM),
    ("program-wins", ("--output_dir", "/o"), HF_SRC, "deepspeed", None, False, DEEPSPEED),
]


@pytest.mark.parametrize(("row", "args", "text", "program", "resume", "workload", "want"),
                         DETECT, ids=[r[0] for r in DETECT])
def test_detect(row: str, args: tuple[str, ...], text: str | None, program: str | None,
                resume: str | None, workload: bool, want: str) -> None:
    choice = detect(workload=workload, args=args, script_text=text, program=program,
                    resume_arg=resume)
    assert choice.name == want
    assert choice.why and choice.name in choice.line() and choice.why in choice.line()


def test_detect_says_why_and_how_it_resumes() -> None:
    line = detect(workload=False, args=(), script_text=HF_SRC).line()
    assert line == ("program profile: hf-trainer (its source builds transformers' Trainer); "
                    "resumes with --resume_from_checkpoint {dir}")
    assert detect(workload=False, args=(), script_text="x\n").line().endswith(
        "no way to resume known")
    # --program with --resume-arg: that profile, resumed by the template
    c = detect(workload=False, args=(), script_text=None, program="torch-snapshot",
               resume_arg="--snapshot {dir}/snap.pt")
    assert (c.name, c.resume) == (SNAPSHOT, ("--snapshot", "{dir}/snap.pt"))


def test_bad_program_and_template_are_one_line_errors() -> None:
    with pytest.raises(RenderError, match="not a known profile"):
        detect(workload=False, args=(), script_text=None, program="megatron")
    with pytest.raises(RenderError, match=r"does not name the checkpoint as \{dir\}"):
        detect(workload=False, args=(), script_text=None, resume_arg="--resume")
    with pytest.raises(RenderError, match=r"\{ckpt\} is not a field \(the only one is \{dir\}"):
        detect(workload=False, args=(), script_text=None, resume_arg="--from {dir} --x {ckpt}")


LAYOUT = [
    ("hf", ["checkpoint-10/trainer_state.json", "checkpoint-10/global_step10/mp_rank_00_"
            "model_states.pt", "checkpoint-10/latest"], HF),
    ("accelerate", ["step_4/random_states_0.pkl", "step_4/pytorch_model/mp_rank_00_model_"
                    "states.pt"], ACCELERATE),
    ("deepspeed", ["latest", "global_step8/mp_rank_00_model_states.pt"], DEEPSPEED),
    ("snapshot", ["snapshot.pt"], SNAPSHOT),
    ("contract", ["step8/mp_rank_00_model_states.pt", "step8/complete.rank0"], None),
    ("empty", [], None),
]


@pytest.mark.parametrize(("row", "names", "want"), LAYOUT, ids=[r[0] for r in LAYOUT])
def test_layout(row: str, names: list[str], want: str | None) -> None:
    assert from_layout(names) == want


RESUME = [
    ("append", ("--output_dir", "/o"), ("--output_dir", "/o", "--resume_from_checkpoint",
                                        "/ck/j/checkpoint-20")),
    ("replace-older", ("--resume_from_checkpoint", "/ck/j/checkpoint-10", "--bf16"),
     ("--bf16", "--resume_from_checkpoint", "/ck/j/checkpoint-20")),
    ("replace-eq", ("--resume_from_checkpoint=/x", "--bf16"),
     ("--bf16", "--resume_from_checkpoint", "/ck/j/checkpoint-20")),
    ("replace-bare", ("--resume_from_checkpoint", "--bf16"),
     ("--bf16", "--resume_from_checkpoint", "/ck/j/checkpoint-20")),
]


@pytest.mark.parametrize(("row", "args", "want"), RESUME, ids=[r[0] for r in RESUME])
def test_resume_argument(row: str, args: tuple[str, ...], want: tuple[str, ...]) -> None:
    assert with_resume(PROFILES[HF].resume, args, "/ck/j/checkpoint-20") == want


def test_resumed_program_keeps_the_script_or_module_head() -> None:
    tmpl = ("--resume", "{dir}")
    assert resumed_program(("t.py", "-x"), tmpl, "/c/s4") == ("t.py", "-x", "--resume", "/c/s4")
    assert resumed_program(("-m", "pkg.t", "-x"), tmpl, "/c/s4") == (
        "-m", "pkg.t", "-x", "--resume", "/c/s4")


def test_node_local_args_and_config() -> None:
    hf = PROFILES[HF]
    assert node_local_args(hf, ("--deepspeed", "ds.json", "--save_on_each_node"),
                           config_path="/j/d.json") == ("--deepspeed", "/j/d.json",
                                                        "--save_on_each_node")
    assert node_local_args(hf, ("--deepspeed=ds.json",), config_path=None) == (
        "--deepspeed=ds.json", "--save_on_each_node")
    assert node_local_args(hf, ("--deepspeed=ds.json",), config_path="/j/d.json") == (
        "--deepspeed=/j/d.json", "--save_on_each_node")
    assert node_local_args(PROFILES[DEEPSPEED], ("--deepspeed_config", "c.json"),
                           config_path="/j/d.json") == ("--deepspeed_config", "/j/d.json")
    text = json.dumps({"zero_optimization": {"stage": 2}, "train_batch_size": "auto",
                       "checkpoint": {"tag_validation": "WARN"}})
    doc = json.loads(node_local_config(text, "ds.json"))
    assert doc == {"zero_optimization": {"stage": 2}, "train_batch_size": "auto",
                   "checkpoint": {"tag_validation": "WARN", "use_node_local_storage": True}}
    with pytest.raises(RenderError, match=r"ds\.json is not JSON"):
        node_local_config("{", "ds.json")


STEP0 = [  # profile -> refused at a restart while a complete checkpoint exists
    (HF, False), (ACCELERATE, False), (DEEPSPEED, False), (SNAPSHOT, False),
    (CONTRACT, False), (UNKNOWN, True),
]


@pytest.mark.parametrize(("name", "refused"), STEP0, ids=[r[0] for r in STEP0])
def test_the_step0_rule(name: str, refused: bool) -> None:
    choice = detect(workload=False, args=(), script_text=None, program=None
                    if name == UNKNOWN else name)
    if name == UNKNOWN:
        choice = detect(workload=False, args=(), script_text="print(1)\n")
    line = restart_problem(choice, "step40", "/scratch/ckpt/j", "j")
    assert (line is not None) is refused
    if line is not None:
        assert "\n" not in line and "step40" in line and "--resume-arg" in line \
            and "--program" in line
    custom = detect(workload=False, args=(), script_text="x\n", resume_arg="--from {dir}")
    assert restart_problem(custom, "step40", "/c", "j") is None


# ---------------------------------------------------------------- the plan

def _program_plan(script_text: str | None, args: tuple[str, ...], *, storage: str = "node-local",
          files: dict[str, str] | None = None, **kw: object) -> JobPlan:
    kw = {"nodes": 3, **kw}
    o = JobOptions(job_id="j", script="train.py", script_args=args, storage=storage,
                   ckpt_dir="/scratch/ckpt", gpus_per_node=1, **kw)  # type: ignore[arg-type]
    facts = dataclasses.replace(FACTS, script_text=script_text, program_files=files or {})
    return plan_job(inventory("a800-7x2"), o, facts)


def test_hf_on_node_local_saves_on_each_node_with_a_derived_config() -> None:
    user = json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": "auto"},
                       "train_micro_batch_size_per_gpu": "auto"})
    plan = _program_plan(HF_SRC, ("--output_dir", "/scratch/ckpt/j", "--deepspeed", "ds.json"),
                 files={"ds.json": user})
    assert plan.profile is not None and plan.profile.name == HF
    for prog, node in zip(plan.programs, plan.nodes, strict=True):
        assert prog == ("train.py", "--output_dir", "/scratch/ckpt/j", "--deepspeed",
                        f"{node.job_dir}/{DERIVED_DS_CONFIG}", "--save_on_each_node")
    derived = json.loads(plan.program_files[DERIVED_DS_CONFIG])
    assert derived["checkpoint"] == {"use_node_local_storage": True}
    assert derived["zero_optimization"]["overlap_comm"] == "auto"  # the rest as written
    assert plan.warnings == ()
    # the agents write the derived copy into every node's job dir
    job = job_from_plan(render_all(plan, run_id="r-a0"))
    assert all(t.files[DERIVED_DS_CONFIG] == plan.program_files[DERIVED_DS_CONFIG]
               for t in job.tasks)


def test_hf_elsewhere_is_left_alone_or_warned() -> None:
    shared = _program_plan(HF_SRC, ("--output_dir", "/o", "--deepspeed", "ds.json"), storage="shared",
                   files={"ds.json": "{}"})
    assert shared.program == ("train.py", "--output_dir", "/o", "--deepspeed", "ds.json")
    assert shared.program_files == {}
    already = json.dumps({"checkpoint": {"use_node_local_storage": True}})
    plan = _program_plan(HF_SRC, ("--output_dir", "/o", "--deepspeed", "ds.json"),
                 files={"ds.json": already})
    assert plan.program[-3:] == ("--deepspeed", "ds.json", "--save_on_each_node")
    assert any("--output_dir /o is not the job's checkpoint dir" in w for w in plan.warnings)
    unread = _program_plan(HF_SRC, ("--output_dir", "/scratch/ckpt/j", "--deepspeed", "ds.json"))
    assert [w for w in unread.warnings if "ds.json is not readable here" in w]


def test_a_save_on_one_node_only_is_said_and_refuses_replicas() -> None:
    plan = _program_plan(SNAP_SRC, ())
    assert [w for w in plan.warnings if w.startswith("torch-snapshot: checkpoints are not "
                                                     "complete on every node")]
    with pytest.raises(RenderError, match="--replicas 1: this program's checkpoints are not "
                                          "complete on every node"):
        _program_plan(SNAP_SRC, (), replicas=1)


def test_program_flags_reach_the_profile() -> None:
    plan = _program_plan("print(1)\n", (), resume_arg="--from {dir}")
    assert plan.profile is not None and plan.profile.name == CUSTOM
    plan = _program_plan(HF_SRC, (), program_profile="deepspeed")
    assert plan.profile is not None and plan.profile.name == DEEPSPEED


# ---------------------------------------------------------------- the agents' part

def test_checkpoint_prep_per_node() -> None:
    plan = _program_plan(HF_SRC, ("--output_dir", "/scratch/ckpt/j"))
    job = job_from_plan(render_all(plan, run_id="r-a0"))
    for task, node in zip(job.tasks, plan.nodes, strict=True):
        prep = json.loads(task.files[JobDir.ckpt_prep(node.name)])
        assert prep == {"ckpt_dir": node.ckpt_dir, "aside": [], "latest": None,
                        "nested_latest": True}
        assert not [n for n in task.files if n.startswith(JobDir.CKPT_PREP)
                    and n != JobDir.ckpt_prep(node.name)]
    ds = dataclasses.replace(_program_plan(DS_SRC, ()), resume_from="global_step8",
                             set_aside=("global_step12",))
    prep = json.loads(checkpoint_prep(ds, ds.nodes[1]))
    assert (prep["latest"], prep["aside"], prep["nested_latest"]) == (
        "global_step8", ["global_step12"], False)


def test_ready_checkpoints_on_a_node(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt" / "j"
    prep: dict[str, object] = {"ckpt_dir": str(ckpt), "aside": [], "latest": None,
                               "nested_latest": True}
    assert ready_checkpoints(json.dumps(prep)) == []
    assert ckpt.is_dir()  # the program's save finds its directory
    inner = ckpt / "checkpoint-20" / "global_step20"
    inner.mkdir(parents=True)
    (inner / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (ckpt / "checkpoint-20" / "trainer_state.json").write_text("{}")
    (ckpt / "checkpoint-30").mkdir()  # a save cut short: nothing DeepSpeed's in it
    assert ready_checkpoints(json.dumps(prep)) == ["checkpoint-20/latest -> global_step20"]
    assert (ckpt / "checkpoint-20" / "latest").read_text() == "global_step20"
    assert not (ckpt / "checkpoint-30" / "latest").exists()
    assert ready_checkpoints(json.dumps(prep)) == []  # once
    # DeepSpeed's own layout: `latest` at the top, newer tags moved aside, kept
    for tag in ("global_step8", "global_step12"):
        (ckpt / tag).mkdir()
    prep = {"ckpt_dir": str(ckpt), "aside": ["global_step12", "gone"], "latest": "global_step8",
            "nested_latest": False}
    said = ready_checkpoints(json.dumps(prep))
    assert said == [f"moved global_step12 aside to global_step12{ASIDE_SUFFIX} (it cannot be "
                    "assembled on this node set)", "latest -> global_step8"]
    assert (ckpt / f"global_step12{ASIDE_SUFFIX}").is_dir()
    assert (ckpt / "latest").read_text() == "global_step8"
    (ckpt / "global_step12").mkdir()
    ready_checkpoints(json.dumps(prep))
    assert (ckpt / f"global_step12{ASIDE_SUFFIX}2").is_dir()  # never overwritten


# ---------------------------------------------------------------- restarts

def _assembly(tag: str) -> Assembly:
    return Assembly(tag=tag, names={}, sources={}, candidates={}, missing={})


def test_a_restart_resumes_hf_from_the_newest_complete_checkpoint() -> None:
    plan = _program_plan(HF_SRC, ("--output_dir", "/scratch/ckpt/j", "--resume_from_checkpoint",
                          "/scratch/ckpt/j/checkpoint-10"))
    said: list[str] = []
    new = resume_plan(plan, _assembly("checkpoint-20"), ["checkpoint-30"], said.append)
    assert new is not None and new.resume_from == "checkpoint-20"
    assert new.set_aside == ()  # told where to resume: nothing newer is in its way
    for prog, node in zip(new.programs, new.nodes, strict=True):
        assert prog[-2:] == ("--resume_from_checkpoint", f"{node.ckpt_dir}/checkpoint-20")
        assert prog.count("--resume_from_checkpoint") == 1
    assert said == ["hf-trainer: resuming from checkpoint-20, the newest checkpoint complete on "
                    "every node (--resume_from_checkpoint /scratch/ckpt/j/checkpoint-20)"]


def test_a_program_that_picks_by_itself_gets_latest_and_newer_tags_aside() -> None:
    plan = _program_plan(DS_SRC, ())
    new = resume_plan(plan, _assembly("global_step8"), ["global_step12"], lambda s: None)
    assert new is not None
    assert (new.resume_from, new.set_aside, new.programs) == (
        "global_step8", ("global_step12",), plan.programs)
    snap = _program_plan(CONTRACT_SRC, ())
    assert resume_plan(snap, _assembly("step8"), [], lambda s: None) is None


def test_an_unknown_program_is_refused_rather_than_restarted_at_step0() -> None:
    plan = _program_plan("print('hello')\n", ())
    with pytest.raises(LaunchError) as exc:
        resume_plan(plan, _assembly("step40"), [], lambda s: None)
    assert "would restart at step 0: checkpoint step40 in /scratch/ckpt/j" in exc.value.message
    ok = _program_plan("print('hello')\n", (), resume_arg="--from {dir}")
    new = resume_plan(ok, _assembly("step40"), [], lambda s: None)
    assert new is not None and new.program[-2:] == ("--from", "/scratch/ckpt/j/step40")


NEEDS = [  # profile -> a restart on the same nodes is readied first (node-local)
    (HF_SRC, None, True), (DS_SRC, None, True), ("print(1)\n", None, True),
    ("print(1)\n", "--from {dir}", True), (SNAP_SRC, None, True), (CONTRACT_SRC, None, False),
    (ACC_SRC, None, True),
]


@pytest.mark.parametrize(("text", "resume", "want"), NEEDS)
def test_which_restarts_are_readied(text: str, resume: str | None, want: bool) -> None:
    assert needs_ready(_program_plan(text, (), resume_arg=resume)) is want
    assert needs_ready(_program_plan(text, (), resume_arg=resume, storage="shared")) is False


def test_a_restart_of_a_profile_clusterkit_readies_says_so() -> None:
    """Not the node-local trap (DeepSpeed's `latest` on rank 0's node only) for a program
    whose checkpoint clusterkit readies before the restart."""
    for text in (ACC_SRC, DS_SRC, SNAP_SRC):
        plan = _program_plan(text, ())
        assert plan.profile is not None and needs_ready(plan)
        note = resume_note(False, "node-local", plan)
        assert note == (f"{plan.profile.name} resumes by itself; clusterkit readies the newest "
                        "checkpoint complete on every node for it first (docs/programs.md)")
    for text in (CONTRACT_SRC, "print(1)\n"):
        assert "explicit tag" in resume_note(False, "node-local", _program_plan(text, ()))


def test_accelerate_gets_a_node_local_library_config() -> None:
    plan = _program_plan(ACC_SRC, ())
    for n in plan.nodes:
        assert n.env[ACCELERATE_CONFIG_ENV] == f"{n.job_dir}/{DERIVED_DS_CONFIG}"
    assert json.loads(plan.program_files[DERIVED_DS_CONFIG]) == LIBRARY_DS_CONFIG
    assert plan.warnings == ()
    sched = _program_plan(ACC_SRC + "sched = get_scheduler('linear', opt)\n", ())
    assert [w for w in sched.warnings if w.startswith("accelerate: checkpoints are not complete")]
    assert _program_plan(ACC_SRC + "sched = 1\nProjectConfiguration(save_on_each_node=True)\n",
                 ()).warnings == ()
    own = _program_plan(ACC_SRC + "DeepSpeedPlugin(hf_ds_config='ds.json')\n", ())
    assert ACCELERATE_CONFIG_ENV not in own.nodes[0].env and own.program_files == {}
    shared = _program_plan(ACC_SRC, (), storage="shared")
    assert ACCELERATE_CONFIG_ENV not in shared.nodes[0].env


class _Said:
    def __init__(self) -> None:
        self.got: list[str] = []

    def line(self, node: str, rank: int | None, text: str, *, agent: bool = False) -> None:
        self.got.append(text)

    def show(self, item: Folded) -> None:
        self.got.append(item.text)


WATCH = [  # rank lines of a resumed HF attempt -> began at step 0?
    ("resumed", ["***** Running training *****", "  Resuming training from checkpoint with "
                 "epoch 0 and global step 10", "{'loss': '2.791', 'epoch': '1.3'}"], False),
    ("older-wording", ["  Continuing training from global step 10", "{'loss': '2.7'}"], False),
    ("fresh", ["***** Running training *****", "{'loss': '3.091', 'epoch': '0.45'}",
               "Resuming training from checkpoint"], True),
    ("nothing-yet", ["***** Running training *****"], False),
]


@pytest.mark.parametrize(("row", "lines", "fresh"), WATCH, ids=[r[0] for r in WATCH])
def test_a_resumed_attempt_that_began_at_step0_is_seen(row: str, lines: list[str],
                                                       fresh: bool) -> None:
    plan = dataclasses.replace(_program_plan(HF_SRC, ()), resume_from="checkpoint-10")
    inner = _Said()
    watch = resume_watch(plan, inner)  # type: ignore[arg-type]  # a sink's two methods
    assert watch is not None
    for i, text in enumerate(lines):
        if i % 2:
            watch.show(Folded("[r0-2]", text, ("n1", "n2", "n3"), (0, 1, 2)))
        else:
            watch.line("n1", 0, text)
    watch.line("n1", None, "{'loss': 'a launcher line is no rank line'}")
    assert watch.began_fresh is fresh
    assert inner.got[:len(lines)] == lines  # everything passed on unchanged
    sink: Any = inner
    assert resume_watch(_program_plan(HF_SRC, ()), sink) is None  # not told where to resume
    assert resume_watch(dataclasses.replace(_program_plan(DS_SRC, ()), resume_from="s8"), sink) is None
    line = began_fresh_line("checkpoint-10", "j")
    assert "checkpoint-10" in line and "--resume-arg" in line and "\n" not in line


def test_a_program_with_its_own_optimizer_gets_a_ds_config_without_clusterkits() -> None:
    """accelerate refuses an optimizer in the config and in the code at once: the job's
    ds_config.json (what --launcher accelerate hands it) has neither optimizer nor
    scheduler for HF and accelerate; the rest, batch sizes included, stays."""
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"},
          "zero_optimization": {"stage": 2}}
    for name in (HF, ACCELERATE):
        got = program_ds_config(PROFILES[name], ds)
        assert "optimizer" not in got and "scheduler" not in got
        assert got == {k: v for k, v in ds.items() if k not in ("optimizer", "scheduler")}
    for name in (DEEPSPEED, CONTRACT, SNAPSHOT, UNKNOWN):
        assert program_ds_config(PROFILES[name], ds) == ds


# ------------------------------------------------- accelerate's process group on CPU ranks

HOOK = [  # (profile, the node's ranks on CPU, its PYTHONPATH) -> the ranks' PYTHONPATH
    ("accelerate-cpu", ACCELERATE, True, None, "/w/j"),
    ("keeps-the-nodes-own", ACCELERATE, True, "/opt/lib:/src", "/w/j:/opt/lib:/src"),
    ("once", ACCELERATE, True, "/w/j:/opt/lib", "/w/j:/opt/lib"),
    ("gpu-node", ACCELERATE, False, "/opt/lib", None),
    ("hf-finds-its-own", HF, True, None, None),
    ("deepspeed", DEEPSPEED, True, None, None),
]


@pytest.mark.parametrize(("row", "name", "cpu", "pythonpath", "want"), HOOK,
                         ids=[r[0] for r in HOOK])
def test_which_ranks_get_the_cpu_hook(row: str, name: str, cpu: bool, pythonpath: str | None,
                                      want: str | None) -> None:
    got = cpu_hook_env(PROFILES[name], cpu=cpu, job_dir="/w/j", pythonpath=pythonpath)
    assert got == ({} if want is None else {"PYTHONPATH": want})
    assert [n for n, p in PROFILES.items() if p.cpu_hook] == [ACCELERATE]


def _cpu_plan(tmp: Path, script_text: str, *, storage: str = "node-local",
              gpus: int = 0) -> JobPlan:
    inv = tmp / "inv.yaml"
    inv.write_text(f"""schema_version: 1
cluster: {{name: c}}
defaults: {{gpus: {gpus}, slots: 1, workdir: /srv/w,
           checkpoint: {{local_dir: /scratch/ckpt, shared_dir: /shared/ckpt}},
           env: {{PYTHONPATH: /opt/site}}}}
hosts: {{n1: {{address: 10.0.0.1}}, n2: {{address: 10.0.0.2}}, n3: {{address: 10.0.0.3}}}}
""")
    o = JobOptions(job_id="j", script="train.py", nodes=3, storage=storage)
    facts = dataclasses.replace(FACTS, script_text=script_text)
    return plan_job(load_inventory(inv), o, facts)


def test_accelerate_on_cpu_nodes_gets_the_hook_on_every_storage(tmp_path: Path) -> None:
    """accelerate 1.15 picks no process group on a rank without a GPU (node/hooks/accelerate_cpu.py):
    such ranks get the job dir's sitecustomize.py first on PYTHONPATH, on node-local and
    shared storage alike, and the profile line says so; GPU nodes and other profiles get
    nothing."""
    for storage in ("node-local", "shared"):
        plan = _cpu_plan(tmp_path, ACC_SRC, storage=storage)
        for n in plan.nodes:
            assert n.env["PYTHONPATH"] == f"{n.job_dir}:/opt/site", storage
        assert plan.program_files[CPU_HOOK_FILE] == cpu_hook_source()
        assert plan.profile is not None
        line = plan.profile.line()
        assert line.startswith("program profile: accelerate (its source calls accelerate's "
                               "save_state); resumes by itself; on CPU ranks (n[1-3]) ")
        assert "gloo" in line and "DeepSpeed plugin kept" in line
    local = _cpu_plan(tmp_path, ACC_SRC)
    assert ACCELERATE_CONFIG_ENV in local.nodes[0].env  # the node-local config still comes
    gpu = _cpu_plan(tmp_path, ACC_SRC, gpus=1)
    assert gpu.nodes[0].env["PYTHONPATH"] == "/opt/site"
    assert CPU_HOOK_FILE not in gpu.program_files
    assert gpu.profile is not None and "CPU ranks" not in gpu.profile.line()
    hf = _cpu_plan(tmp_path, HF_SRC)
    assert hf.nodes[0].env["PYTHONPATH"] == "/opt/site" and CPU_HOOK_FILE not in hf.program_files


class _Kind:
    NO, MULTI_CPU, MULTI_GPU = "NO", "MULTI_CPU", "MULTI_GPU"


def _fake_state(gpu: bool) -> Any:
    class PartialState:
        def _prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False,
                             backend: str | None = None) -> tuple[str | None, str]:
            if "LOCAL_RANK" in os.environ and not cpu and gpu:
                return backend or "nccl", _Kind.MULTI_GPU
            if cpu and "LOCAL_RANK" in os.environ:
                return "gloo", _Kind.MULTI_CPU
            return backend, _Kind.NO

    return type(sys)("fake_state"), PartialState


BACKEND = [  # (a GPU, LOCAL_RANK, cpu=, backend=) -> what accelerate's state then picks
    ("cpu-rank", False, "0", False, None, ("gloo", "MULTI_CPU")),
    ("gpu-rank", True, "0", False, None, ("nccl", "MULTI_GPU")),
    ("not-launched", False, None, False, None, (None, "NO")),
    ("program-said-cpu", False, "0", True, None, ("gloo", "MULTI_CPU")),
    ("program-named-a-backend", False, "0", False, "gloo", ("gloo", "NO")),
]


@pytest.mark.parametrize(("row", "gpu", "local_rank", "cpu", "backend", "want"), BACKEND,
                         ids=[r[0] for r in BACKEND])
def test_the_hook_changes_only_a_launched_cpu_rank_without_a_backend(
        row: str, gpu: bool, local_rank: str | None, cpu: bool, backend: str | None,
        want: tuple[str | None, str], monkeypatch: pytest.MonkeyPatch) -> None:
    module, cls = _fake_state(gpu)
    module.PartialState, module.DistributedType = cls, _Kind
    accelerate_cpu.patch(module)
    accelerate_cpu.patch(module)  # once
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert cls()._prepare_backend(cpu, False, backend) == want


PROBE = """import sys
from accelerate.state import PartialState
print(PartialState._prepare_backend(None, False))
import sitecustomize_before
"""


def test_the_shipped_hook_makes_accelerate_pick_gloo(tmp_path: Path) -> None:
    """The file the ranks get, as Python runs it at start (PYTHONPATH), with the real
    accelerate: under a launcher on this CPU machine its backend is gloo (MULTI_CPU until
    its DeepSpeed plugin takes over), without the hook none; a sitecustomize it shadows
    still runs."""
    hook, other = tmp_path / "job", tmp_path / "site"
    hook.mkdir()
    other.mkdir()
    (hook / CPU_HOOK_FILE).write_text(cpu_hook_source())
    (other / "sitecustomize.py").write_text("import sys\nsys.modules['sitecustomize_before'] = "
                                            "type(sys)('x')\nprint('shadowed one ran')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    runs = {}
    for name, path in (("hooked", f"{hook}:{other}"), ("bare", str(other))):
        res = subprocess.run([sys.executable, "-c", PROBE], env={**env, "LOCAL_RANK": "0",
                                                                  "PYTHONPATH": path},
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        runs[name] = res.stdout
    assert "('gloo', <DistributedType.MULTI_CPU: 'MULTI_CPU'>)" in runs["hooked"], runs
    assert "(None, <DistributedType.NO: 'NO'>)" in runs["bare"], runs
    assert all("shadowed one ran" in out for out in runs.values()), runs


# ------------------------------------------------------------------ one writer's file, spread


def test_a_snapshot_reaches_a_spare_whose_checkpoint_dir_does_not_exist_yet(
        tmp_path: Path) -> None:
    """jobs/spread.py before a restart onto a spare: rank 0's snapshot.pt is on node1
    only; node3 has an older copy and node4 (the spare) no checkpoint dir at all. Both
    get node1's file (the spare used to be taken for unreachable and left out: its rank
    started at epoch 0 while the others resumed)."""
    from clusterkit.jobs.spread import spread_files, top_files
    from clusterkit.remote.local import LocalTransport

    plan = plan_for("a800-7x2", "torchrun", nodes=3)
    hosts = [dataclasses.replace(n.host, transport="local") for n in plan.nodes]
    nodes = [dataclasses.replace(n, host=h, ckpt_dir=str(tmp_path / name / "ckpt"))
             for n, h, name in zip(plan.nodes, hosts, ("node1", "node3", "node4"), strict=True)]
    (tmp_path / "node1" / "ckpt").mkdir(parents=True)
    (tmp_path / "node3" / "ckpt").mkdir(parents=True)
    (tmp_path / "node3" / "ckpt" / "snapshot.pt").write_bytes(b"epoch 3")
    os.utime(tmp_path / "node3" / "ckpt" / "snapshot.pt", (1, 1))
    (tmp_path / "node1" / "ckpt" / "snapshot.pt").write_bytes(b"epoch 7")
    transport = LocalTransport()
    assert top_files(transport, nodes[2]) == []  # reachable, nothing there yet
    said: list[str] = []
    staging = tmp_path / "staging"
    staging.mkdir()
    spread_files(transport, dataclasses.replace(plan, nodes=tuple(nodes)), str(staging),
                 said.append)
    for name in ("node1", "node3", "node4"):
        assert (tmp_path / name / "ckpt" / "snapshot.pt").read_bytes() == b"epoch 7", name
    assert len(said) == 1 and "written by" in said[0] and "sha256 verified" in said[0], said


def test_an_accelerate_job_on_fewer_nodes_is_resharded_inside_its_folders(
        tmp_path: Path) -> None:
    """Relaunched on 2 of its 3 nodes (no spare), an accelerate job continues resharded
    (OtherWorld.UNIVERSAL_INSIDE, in the place of the DeepSpeed tag it loads by name): the
    attempt's ACCELERATE_DEEPSPEED_CONFIG_FILE is clusterkit's derived config, which gets
    checkpoint.load_universal. A script that hands the plugin its own config is refused
    before anything is gathered (clusterkit edits no file of the user's); DeepSpeed's
    `latest` of the program's own choosing stays refused, in one line naming what goes on."""
    from clusterkit.jobs.reshard import check_inside, load_universal_plan
    from clusterkit.launch.continuation import check_continue, is_reshard

    prior = _recorded(tmp_path / "acc", _program_plan(ACC_SRC, ()))
    fewer = _program_plan(ACC_SRC, (), nodes=2)
    assert is_reshard(fewer, prior)
    assert "the newest checkpoint is resharded first" in (check_continue(fewer, prior) or "")
    assert dict(fewer.nodes[0].env)[ACCELERATE_CONFIG_ENV].endswith("/" + DERIVED_DS_CONFIG)
    check_inside(fewer)  # the derived config is clusterkit's: nothing refused
    doc = json.loads(load_universal_plan(fewer).program_files[DERIVED_DS_CONFIG])
    assert doc["checkpoint"] == {"use_node_local_storage": True, "load_universal": True}
    assert json.loads(fewer.program_files[DERIVED_DS_CONFIG])["checkpoint"] == {
        "use_node_local_storage": True}  # this attempt only
    own = ACC_SRC.replace("Accelerator()", "Accelerator(deepspeed_plugin=DeepSpeedPlugin("
                          "hf_ds_config='mine.json'))")
    with pytest.raises(LaunchError, match="clusterkit edits no file of yours") as err:
        check_inside(_program_plan(own, (), nodes=2))
    assert "DeepSpeedPlugin" in err.value.message and ACCELERATE_CONFIG_ENV in (err.value.hint or "")
    prior = _recorded(tmp_path / "ds", _program_plan(DS_SRC, ()))
    with pytest.raises(LaunchError) as err:
        check_continue(_program_plan(DS_SRC, (), nodes=2), prior)
    msg = err.value.message
    assert "cannot continue job j on a different rank->node mapping" in msg
    assert "HF Trainer's and accelerate's DeepSpeed tags, converted" in msg, msg
    assert "\n" not in msg and "--replace OLD=NEW" in (err.value.hint or "")


def test_accelerate_hands_deepspeed_load_universal_from_the_derived_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt after a reshard: the script builds DeepSpeedPlugin(zero_stage=2) in code
    and names no config; the plugin reads ACCELERATE_DEEPSPEED_CONFIG_FILE (accelerate
    1.15, utils/dataclasses.py DeepSpeedPlugin.__post_init__: hf_ds_config from the
    variable), keeps checkpoint.load_universal in the deepspeed_config it hands
    deepspeed.initialize, and its own zero_stage fills the "auto" stage."""
    pytest.importorskip("accelerate")
    from accelerate.utils import DeepSpeedPlugin

    from clusterkit.jobs.reshard import load_universal_plan

    plan = load_universal_plan(_program_plan(ACC_SRC, (), nodes=2))
    config = tmp_path / DERIVED_DS_CONFIG
    config.write_text(plan.program_files[DERIVED_DS_CONFIG])
    monkeypatch.setenv(ACCELERATE_CONFIG_ENV, str(config))
    cfg = DeepSpeedPlugin(zero_stage=2).deepspeed_config
    assert cfg["checkpoint"] == {"use_node_local_storage": True, "load_universal": True}
    assert cfg["zero_optimization"]["stage"] == 2


# ------------------------------------------------------------------ on another world size


@pytest.mark.parametrize(("name", "want"), [
    (HF, "universal-inside"), (ACCELERATE, "universal-inside"), (DEEPSPEED, "refused"),
    (SNAPSHOT, "as-is"), (CONTRACT, "universal"), (CUSTOM, "refused"), (UNKNOWN, "refused"),
])
def test_how_each_profile_continues_on_another_world_size(name: str, want: str) -> None:
    """spec/programs.Profile.other_world, the one answer: clusterkit's contract converted
    to the universal checkpoint, HF's and accelerate's inside their own folders, a torch
    snapshot (the whole model, from rank 0) as it is, every other layout refused (converted
    in the wrong place it began at step 0)."""
    from clusterkit.spec.programs import OtherWorld

    assert PROFILES[name].other_world is OtherWorld(want)


def _recorded(tmp_path: Path, plan: JobPlan) -> Any:
    from clusterkit.launch.registry import Registry
    from clusterkit.launch.run import _record
    from clusterkit.spec.jobrecord import JobState

    registry = Registry(tmp_path / "reg" / plan.job_id)
    rec = _record(job_from_plan(render_all(plan)), plan, 0)
    rec.state = JobState.FAILED
    registry.save(rec)
    return registry.find(plan.job_id)


def test_a_snapshot_job_on_fewer_nodes_goes_on_as_it_is(tmp_path: Path) -> None:
    """A torch-snapshot job relaunched on 2 of its 3 nodes (no spare): continued, nothing
    converted, the relaunch line says so; the attempt table's reshard row reads it."""
    from clusterkit.launch.continuation import check_continue, is_reshard, other_world, reshardable
    from clusterkit.spec.programs import OtherWorld

    args = ("8", "2", "--snapshot_path", "/scratch/ckpt/j/snapshot.pt")
    prior = _recorded(tmp_path, _program_plan(SNAP_SRC, args))
    fewer = _program_plan(SNAP_SRC, args, nodes=2)
    assert other_world(fewer) is OtherWorld.AS_IS and reshardable(fewer)
    assert is_reshard(fewer, prior)
    note = check_continue(fewer, prior) or ""
    assert "on 2 nodes, 2 ranks (was node1:r0-0, node2:r1-1, node3:r2-2)" in note, note
    assert "loads on any world size as it is" in note and "resharded" not in note, note
    # the same nodes: no reshard at all
    assert not is_reshard(_program_plan(SNAP_SRC, args), prior)


def test_a_snapshot_job_on_fewer_nodes_gets_the_snapshot_on_every_node(
        tmp_path: Path) -> None:
    """jobs/recover.prepare_continue on 2 of 3 nodes: the snapshot (on node1 only) is
    copied to node3, nothing is gathered or converted (no reshard dir), and the plan
    runs as it is; the dry run says what it would copy and copies nothing."""
    from clusterkit.jobs.recover import prepare_continue
    from clusterkit.remote.local import LocalTransport

    args = ("8", "2")
    prior = _recorded(tmp_path, _program_plan(SNAP_SRC, args))
    o = JobOptions(job_id="j", script="train.py", script_args=args, storage="node-local",
                   ckpt_dir="/scratch/ckpt", include="node1:0@node3:0")
    fewer = plan_job(inventory("a800-7x2"), o, dataclasses.replace(FACTS, script_text=SNAP_SRC))
    nodes = tuple(dataclasses.replace(n, host=dataclasses.replace(n.host, transport="local"),
                                      ckpt_dir=str(tmp_path / n.name / "ckpt"))
                  for n in fewer.nodes)
    fewer = dataclasses.replace(fewer, nodes=nodes)
    assert [n.name for n in nodes] == ["node1", "node3"]
    (tmp_path / "node1" / "ckpt").mkdir(parents=True)
    (tmp_path / "node1" / "ckpt" / "snapshot.pt").write_bytes(b"epoch 5")
    home = tmp_path / "home"
    home.mkdir()
    said: list[str] = []
    assert prepare_continue(LocalTransport(), fewer, prior, str(home), said.append,
                            dry_run=True) is None
    assert not (tmp_path / "node3" / "ckpt" / "snapshot.pt").exists()
    assert len(said) == 1 and "nothing is converted" in said[0], said
    said.clear()
    assert prepare_continue(LocalTransport(), fewer, prior, str(home), said.append) is None
    assert (tmp_path / "node3" / "ckpt" / "snapshot.pt").read_bytes() == b"epoch 5"
    assert len(said) == 1 and "copied to node3 (sha256 verified)" in said[0], said
    assert not (home / "reshard").exists()


def test_hf_is_converted_inside_its_checkpoint_dir(tmp_path: Path) -> None:
    """jobs/reshard for HF's Trainer: the converter's <tag>_universal/global_stepN moves
    to checkpoint-N/global_stepN_universal with latest_universal naming it (what
    DeepSpeed's load_checkpoint(tag=None) reads with load_universal on); what is pushed is
    the tag dir but the old DeepSpeed tag; the attempt's derived config gets
    load_universal, the user's batch left alone; no derived config: refused first."""
    from clusterkit.checkpoints.convert.tagdir import into_tag_dir
    from clusterkit.checkpoints.convert.universal import Universal
    from clusterkit.checkpoints.universal_marker import UniversalMarker
    from clusterkit.jobs.reshard import _inside_plan, check_inside

    dest = tmp_path / "dest"
    for rel in ("checkpoint-10/trainer_state.json", "checkpoint-10/rng_state_1.pth",
                "checkpoint-10/latest", "checkpoint-10/global_step10/zero_pp_rank_0.pt",
                "checkpoint-10_universal/global_step10/mp_rank_00_model_states.pt",
                "checkpoint-10_universal/global_step10/zero/w/fp32.pt"):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(rel)
    marker = UniversalMarker("checkpoint-10", 10, 120, 3, 2, 4, 1, 12, "deepspeed", "fp32",
                             "0.19.8", ds_subdir="global_step10")
    u = Universal(str(dest / "checkpoint-10_universal"), "checkpoint-10_universal", marker, 1.0)
    u2, files = into_tag_dir(str(dest), "checkpoint-10", u)
    assert u2.tag == "checkpoint-10/global_step10_universal"
    assert (dest / "checkpoint-10" / "latest_universal").read_text() == "global_step10_universal\n"
    assert sorted(files) == [
        "checkpoint-10/global_step10_universal/clusterkit-universal.json",
        "checkpoint-10/global_step10_universal/mp_rank_00_model_states.pt",
        "checkpoint-10/global_step10_universal/zero/w/fp32.pt",
        "checkpoint-10/latest", "checkpoint-10/latest_universal",
        "checkpoint-10/rng_state_1.pth", "checkpoint-10/trainer_state.json"]
    # the marker goes with it: what it was converted from (the old world's size), its files
    moved = json.loads((dest / "checkpoint-10" / "global_step10_universal"
                        / "clusterkit-universal.json").read_text())
    assert (moved["source_tag"], moved["world_size"], moved["ds_subdir"]) == \
        ("checkpoint-10/global_step10", 3, "")
    user = json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}})
    plan = _program_plan(HF_SRC, ("--output_dir", "/scratch/ckpt/j", "--deepspeed", "ds.json"),
                 files={"ds.json": user}, nodes=2)
    check_inside(plan)
    said: list[str] = []
    new = _inside_plan(plan, u2, said.append)
    cfg = json.loads(new.program_files[DERIVED_DS_CONFIG])
    assert cfg["checkpoint"] == {"use_node_local_storage": True, "load_universal": True}
    assert cfg["train_micro_batch_size_per_gpu"] == "auto"  # HF's own batch
    assert new.programs == plan.programs and "world size 3 -> 2" in said[0], said
    mine = json.dumps({"checkpoint": {"use_node_local_storage": True}})
    own = _program_plan(HF_SRC, ("--output_dir", "/scratch/ckpt/j", "--deepspeed", "ds.json"),
                files={"ds.json": mine}, nodes=2)
    with pytest.raises(LaunchError, match="edits no file of yours"):
        check_inside(own)


def test_a_restart_after_an_hf_reshard_resumes_from_the_converted_tag() -> None:
    """After a reshard, checkpoint-10 holds the old world's global_step10 beside
    global_step10_universal, so it does not assemble on the new mapping: a restart before
    the next save used to run HF without a resume argument, from step 0, and end
    "finished" (seen on the test bed). It resumes from the converted tag again
    (load_universal on), unless a newer checkpoint is complete."""
    from clusterkit.checkpoints.listing import FileInfo, NodeListing
    from clusterkit.jobs.recover import _converted
    from clusterkit.jobs.reshard import converted_inside

    def node(name: str, index: int, *, universal: bool = True, size: int = 7) -> NodeListing:
        files = {"trainer_state.json": FileInfo(1, 0.0), "global_step10/x.pt": FileInfo(2, 0.0)}
        if universal:
            files |= {"latest_universal": FileInfo(24, 0.0),
                      "global_step10_universal/mp_rank_00_model_states.pt": FileInfo(size, 0.0)}
        return NodeListing(name, index, "/c", exists=True, tags={"checkpoint-10": files})

    both = [node("node1", 0), node("node3", 1)]
    assert converted_inside(both, ["checkpoint-10"]) == "checkpoint-10"
    assert converted_inside([node("node1", 0), node("node3", 1, universal=False)],
                            ["checkpoint-10"]) is None
    assert converted_inside([node("node1", 0), node("node3", 1, size=8)],
                            ["checkpoint-10"]) is None  # not the same copy
    user = json.dumps({"zero_optimization": {"stage": 2}})
    hf = _program_plan(HF_SRC, ("--output_dir", "/scratch/ckpt/j", "--deepspeed", "ds.json"),
               files={"ds.json": user}, nodes=2)
    assert _converted(hf, both, None) == "checkpoint-10"
    snap = _program_plan(SNAP_SRC, ("8", "2"), nodes=2)
    assert _converted(snap, both, None) is None  # only HF's profile converts inside
    from types import SimpleNamespace
    newer: Any = SimpleNamespace(tag="checkpoint-20", complete=True)
    both20 = [dataclasses.replace(ls, tags={**ls.tags, "checkpoint-20": {
        "global_step20/mp_rank_00_model_states.pt": FileInfo(3, 0.0)}}) for ls in both]
    assert _converted(hf, both20, [newer]) is None  # a newer complete save wins
