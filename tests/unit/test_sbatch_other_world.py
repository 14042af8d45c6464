"""How ``clusterkit sbatch`` continues a program's node-local checkpoint on another number
of nodes (spec/resume.sbatch_other_world): the one word submit's check and the batch
host's plan step read, and the reason of a refusal. HF Trainer's and accelerate's tags,
inside their own tag dirs, are converted there when the job's DeepSpeed config is
clusterkit's derived copy; with the user's own config they are refused with launch's
reason and fix (spec/programs.OWN_CONFIG_WHY/FIX, jobs/reshard.check_inside)."""

from __future__ import annotations

import dataclasses

import pytest

from clusterkit.node.contract import OTHER_WORLD_AS_IS, OTHER_WORLD_CONVERT, OTHER_WORLD_REFUSE
from clusterkit.spec.programs import (
    ACCELERATE,
    CONTRACT,
    CUSTOM,
    DEEPSPEED,
    DERIVED_DS_CONFIG,
    HF,
    OWN_CONFIG_FIX,
    OWN_CONFIG_WHY,
    PROFILES,
    SNAPSHOT,
    UNKNOWN,
    ProgramChoice,
)
from clusterkit.spec.resume import plan_rule, resume_rule, sbatch_other_world
from tests.render_cases import plan_for


@pytest.mark.parametrize(("name", "derived", "word", "own_config"), [
    (HF, True, OTHER_WORLD_CONVERT, False),
    (HF, False, OTHER_WORLD_REFUSE, True),
    (ACCELERATE, True, OTHER_WORLD_CONVERT, False),
    (ACCELERATE, False, OTHER_WORLD_REFUSE, True),
    (CONTRACT, False, OTHER_WORLD_CONVERT, False),  # its own ds_config: the job's, rewritten
    (SNAPSHOT, False, OTHER_WORLD_AS_IS, False),
    (DEEPSPEED, True, OTHER_WORLD_REFUSE, False),  # DeepSpeed's `latest` of its own choosing
    (CUSTOM, True, OTHER_WORLD_REFUSE, False),
    (UNKNOWN, True, OTHER_WORLD_REFUSE, False),
])
def test_the_word_and_the_reason_by_profile_and_config(name: str, derived: bool, word: str,
                                                       own_config: bool) -> None:
    choice = ProgramChoice(PROFILES[name], "test")
    assert sbatch_other_world(choice, derived=derived) == word
    rule = resume_rule(choice, job_id="j", ckpt_dir="/ck/j", node_local=True, workload=False,
                       derived=derived)
    assert rule["other_world"] == word
    assert (rule["other_world_why"], rule["other_world_fix"]) == (
        (OWN_CONFIG_WHY, OWN_CONFIG_FIX) if own_config else ("", ""))


def test_plan_rule_reads_the_derived_config_from_the_plan() -> None:
    """plan_rule: the plan's profile and whether its program_files hold the derived config
    (what render/sbatch.py, slurm/submit.py and jobs/recover.py ask)."""
    plan = plan_for("a800-7x2", "torchrun", storage="node-local")
    hf = dataclasses.replace(plan, profile=ProgramChoice(PROFILES[HF], "test"),
                             options=dataclasses.replace(plan.options, script="train.py"))
    assert plan_rule(hf, node_local=True)["other_world"] == OTHER_WORLD_REFUSE
    derived = dataclasses.replace(hf, program_files={DERIVED_DS_CONFIG: "{}"})
    assert plan_rule(derived, node_local=True)["other_world"] == OTHER_WORLD_CONVERT
    assert plan_rule(plan) == {}  # the bundled workload: it resumes by itself
