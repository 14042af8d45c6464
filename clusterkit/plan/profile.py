"""What a job's program profile decides in the plan (issue 38), pure.

``plan_job`` asks :func:`profile_programs` once: the profile (spec/programs.py), each
node's program with what node-local storage needs added (HF's ``--save_on_each_node``;
a user's DeepSpeed config pointed at a derived copy with
``checkpoint.use_node_local_storage``), the derived files, and the warnings. A program
whose saves cannot be made complete on every node is said so in one warning with the
fix, and an explicit ``--replicas`` is refused for it: a replica of one node's part in
three protects nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from clusterkit.errors import RenderError
from clusterkit.node.contract import StorageKind
from clusterkit.node.hooks import accelerate_cpu
from clusterkit.spec.job import JobOptions, LaunchFacts
from clusterkit.spec.programs import (
    CPU_HOOK_FILE,
    DERIVED_DS_CONFIG,
    HF,
    LIBRARY_DS_CONFIG,
    ProgramChoice,
    config_arg,
    cpu_hook_env,
    cpu_hook_note,
    detect,
    library_config_env,
    node_local_args,
    node_local_config,
    save_problem,
)


@dataclass(frozen=True)
class Profiled:
    """The profile's part of a plan."""

    choice: ProgramChoice
    programs: tuple[tuple[str, ...], ...]
    files: Mapping[str, str]
    warnings: tuple[str, ...]
    env: tuple[Mapping[str, str], ...] = ()  # per node: added to its environment


def choose(o: JobOptions, facts: LaunchFacts) -> ProgramChoice:
    return detect(workload=o.uses_workload, args=o.script_args, script_text=facts.script_text,
                  program=o.program_profile, resume_arg=o.resume_arg)


@dataclass(frozen=True)
class ProfileNode:
    """What the profile reads of one node of the plan."""

    name: str
    job_dir: str
    ckpt_dir: str
    cpu: bool  # its ranks run without a GPU (gpus: 0)
    pythonpath: str | None = None  # its ranks' PYTHONPATH as planned so far


def profile_programs(o: JobOptions, facts: LaunchFacts, storage: str,
                     nodes: Sequence[ProfileNode],
                     program: Callable[[JobOptions, str, str], tuple[str, ...]]
                     ) -> Profiled:
    """``program``: the plan's own program builder (options, job dir, checkpoint dir) ->
    the interpreter arguments."""
    choice = choose(o, facts)
    if o.uses_workload:
        return Profiled(choice, tuple(program(o, n.job_dir, n.ckpt_dir) for n in nodes), {}, ())
    hooked = _cpu_hook(choice, nodes)
    if storage != StorageKind.NODE_LOCAL:
        return dataclasses.replace(hooked, programs=tuple(program(o, n.job_dir, n.ckpt_dir)
                                                          for n in nodes))
    local = _node_local(hooked.choice, o, facts, [(n.job_dir, n.ckpt_dir) for n in nodes],
                        program)
    env = tuple({**h, **e} for h, e in zip(hooked.env or [{}] * len(nodes),
                                          local.env or [{}] * len(nodes), strict=True))
    return dataclasses.replace(local, files={**hooked.files, **local.files},
                               env=env if any(env) else ())


def cpu_hook_source() -> str:
    """The shipped :data:`CPU_HOOK_FILE`: node/hooks/accelerate_cpu.py, installing itself."""
    with open(accelerate_cpu.__file__, encoding="utf-8") as f:
        source = f.read()
    return source + "\n\ninstall(__file__)  # shipped by clusterkit as the job dir's " \
        f"{CPU_HOOK_FILE}\n"


def _cpu_hook(choice: ProgramChoice, nodes: Sequence[ProfileNode]) -> Profiled:
    """The profile's CPU hook (Profile.cpu_hook), on every storage: the file, each CPU
    node's PYTHONPATH, and the note on the profile line; nothing when no node needs it."""
    env = tuple(cpu_hook_env(choice.profile, cpu=n.cpu, job_dir=n.job_dir,
                             pythonpath=n.pythonpath) for n in nodes)
    if not any(env):
        return Profiled(choice, (), {}, ())
    note = cpu_hook_note(choice.profile, [n.name for n in nodes if n.cpu])
    return Profiled(dataclasses.replace(choice, note=note), (), {CPU_HOOK_FILE: cpu_hook_source()},
                    (), env)


def _node_local(choice: ProgramChoice, o: JobOptions, facts: LaunchFacts,
                nodes: Sequence[tuple[str, str]],
                program: Callable[[JobOptions, str, str], tuple[str, ...]]) -> Profiled:
    """What node-local storage adds: ``nodes`` are each node's (job dir, checkpoint dir)."""
    warnings: list[str] = []
    files: dict[str, str] = {}
    derived = _derived_config(choice, o, facts, warnings)
    env = tuple(library_config_env(choice, facts.script_text, f"{jd}/{DERIVED_DS_CONFIG}")
                for jd, _ in nodes)
    if derived is not None:
        files[DERIVED_DS_CONFIG] = derived
    elif any(env):  # the library's own config, node-local (accelerate's DeepSpeedPlugin)
        files[DERIVED_DS_CONFIG] = json.dumps(LIBRARY_DS_CONFIG, indent=2) + "\n"
    else:
        env = ()
    programs = tuple(
        program(dataclasses.replace(o, script_args=node_local_args(
            choice.profile, o.script_args,
            config_path=f"{jd}/{DERIVED_DS_CONFIG}" if derived is not None else None)), jd, cd)
        for jd, cd in nodes)
    if len(nodes) > 1:
        warnings += _completeness(choice, o, facts)
        warnings += _output_dir(choice, o, [cd for _, cd in nodes])
    return Profiled(choice, programs, files, tuple(warnings), env)


def _derived_config(choice: ProgramChoice, o: JobOptions, facts: LaunchFacts,
                    warnings: list[str]) -> str | None:
    """The user's DeepSpeed config with ``use_node_local_storage`` on, when it lacks it;
    None when there is none, it has it already, or it is not readable here (warned)."""
    where = config_arg(choice.profile, o.script_args)
    if where is None:
        return None
    path = where[1]
    text = facts.program_files.get(path)
    if text is None:
        warnings.append(f"{path} is not readable here, so clusterkit cannot make it node-local: "
                        "add \"checkpoint\": {\"use_node_local_storage\": true} to it, or every "
                        "node but rank 0's lacks the model states (docs/programs.md)")
        return None
    try:
        ckpt = json.loads(text).get("checkpoint") or {}
        if isinstance(ckpt, dict) and ckpt.get("use_node_local_storage") is True:
            return None
    except (ValueError, AttributeError):
        pass  # node_local_config says what is wrong with it
    return node_local_config(text, path)


def _completeness(choice: ProgramChoice, o: JobOptions, facts: LaunchFacts) -> list[str]:
    why = save_problem(choice, facts.script_text)
    if why is None:
        return []
    if o.replicas:
        raise RenderError(f"--replicas {o.replicas}: this program's checkpoints are not complete "
                          f"on every node ({why})", key="--replicas",
                          hint="make its saves per node as said, or drop --replicas "
                               "(docs/programs.md)")
    return [f"{choice.name}: checkpoints are not complete on every node: {why}"]


def _output_dir(choice: ProgramChoice, o: JobOptions, ckpt_dirs: Sequence[str]) -> list[str]:
    """HF saves under --output_dir: elsewhere than the job's checkpoint dir, replicas,
    restarts and collect-ckpt never see its checkpoints."""
    if choice.name != HF:
        return []
    args = list(o.script_args)
    out = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--output_dir"),
               next((a.split("=", 1)[1] for a in args if a.startswith("--output_dir=")), None))
    if out is None or out.rstrip("/") in {c.rstrip("/") for c in ckpt_dirs}:
        return []
    return [f"--output_dir {out} is not the job's checkpoint dir ({ckpt_dirs[0]}): replicas, "
            "restarts' resume and collect-ckpt only see checkpoints saved there; pass "
            f"--output_dir {ckpt_dirs[0]}"]
