"""Every file and command set of one job, as text (pure), and the dry-run listing.

:func:`render_all` is the one render: a :class:`~clusterkit.spec.job.JobPlan` (the
decisions) in, a :class:`~clusterkit.spec.job.LaunchPlan` (the decisions plus every
file and command line) out. The launcher modules of the registry build their own
command sets and files; this module renders what every job has and puts it together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from clusterkit.errors import RenderError
from clusterkit.hostfile import render_hostfile
from clusterkit.hostrange import folded_lines
from clusterkit.launchers import BACKENDS
from clusterkit.node.contract import JobDir
from clusterkit.render.dsenv import render_deepspeed_env
from clusterkit.render.sbatch import SlurmSite, render_sbatch
from clusterkit.render.ssh_config import render_ssh_config
from clusterkit.spec.job import JOB_ID, JobPlan, LaunchPlan, NodeCommand, rank_log_dir

T = TypeVar("T")
SBATCH_SCRIPT = "sbatch.sh"


def _attempt(fn: Callable[[], T], name: str, required: bool, skipped: dict[str, str]) -> T | None:
    try:
        return fn()
    except RenderError as exc:
        if required:
            raise
        skipped[name] = exc.one_line()
        return None


def render_all(plan: JobPlan, *, run_id: str | None = None, site: SlurmSite | None = None,
               require: Collection[str] = ()) -> LaunchPlan:
    """Every file and command set of ``plan`` (pure), with ``commands.sh``/``plan.json``.

    The chosen backend's own command sets and files must render (their RenderError
    propagates), and so must the names in ``require`` (``sbatch`` asks for sbatch.sh);
    the others are noted in ``skipped`` with the reason. ``run_id``: the
    ``clusterkit launch`` run the commands are for (it names the per-rank log directory,
    ``spec.job.rank_log_dir``); None for a job a person runs. ``site``: the batch
    script's site settings (``clusterkit sbatch``'s flags).
    """
    if run_id is not None and not JOB_ID.fullmatch(run_id):
        raise RenderError(f"run id {run_id!r} is not a plain name")  # it names a directory
    backend = BACKENDS[plan.backend]
    required = {*backend.command_sets, *require}
    skipped: dict[str, str] = {}
    files = _render_files(plan, site or SlurmSite(), required, skipped)
    commands = _render_commands(plan, run_id, required, skipped)
    decisions = {f.name: getattr(plan, f.name) for f in dataclasses.fields(JobPlan)}
    out = LaunchPlan(**decisions, commands=commands, skipped=skipped, artifacts=files,
                     chosen=backend.command_sets, run_id=run_id,
                     rank_log_dir=rank_log_dir(plan.job_dir, run_id)
                     if backend.rank_log_files else None)
    return _with_reference_files(out)


def _with_reference_files(plan: LaunchPlan) -> LaunchPlan:
    """The plan with ``commands.sh`` and ``plan.json`` added (both describe the plan itself)."""
    files = {**plan.artifacts, "commands.sh": render_commands_sh(plan)}
    plan = dataclasses.replace(plan, artifacts=files)
    return dataclasses.replace(plan, artifacts={**files, "plan.json": plan_json(plan)})


def _render_commands(plan: JobPlan, run_id: str | None, required: Collection[str],
                     skipped: dict[str, str]) -> dict[str, tuple[NodeCommand, ...]]:
    """Every registered launcher's command sets, in registry order (commands.sh's)."""
    out: dict[str, tuple[NodeCommand, ...]] = {}
    for entry in BACKENDS.values():
        for name, builder in entry.builders:
            if name == "sbatch" and SBATCH_SCRIPT in skipped:
                skipped[name] = skipped[SBATCH_SCRIPT]  # nothing to submit
                continue
            cmds = _attempt(functools.partial(builder, plan, run_id), name, name in required,
                            skipped)
            if cmds is not None:
                out[name] = cmds
    return out


def _render_files(plan: JobPlan, site: SlurmSite, required: Collection[str],
                  skipped: dict[str, str]) -> dict[str, str]:
    """hostfile, deepspeed_env, ssh_config, ds_config.json, the launchers' own files
    (accelerate YAMLs), sbatch.sh."""
    files: dict[str, str] = OrderedDict()
    files[JobDir.HOSTFILE] = render_hostfile(OrderedDict((n.name, list(n.slots)) for n in plan.nodes))
    files[JobDir.DEEPSPEED_ENV] = render_deepspeed_env(plan.nodes[0].env)
    files["ssh_config"] = render_ssh_config([n.host for n in plan.nodes])
    files[JobDir.DS_CONFIG] = json.dumps(plan.ds_config, indent=2) + "\n"
    for entry in BACKENDS.values():
        if entry.files is not None:
            files.update(entry.files(plan))
    sbatch = _attempt(lambda: render_sbatch(plan, site), SBATCH_SCRIPT,
                      "sbatch" in required or SBATCH_SCRIPT in required, skipped)
    if sbatch is not None:
        files[SBATCH_SCRIPT] = sbatch
    return files


def render_commands_sh(plan: LaunchPlan) -> str:
    lines = [
        "#!/bin/sh",
        f"# Command lines for clusterkit job {plan.job_id} ({plan.cluster}); chosen backend: "
        f"{plan.backend}.",
        "# Each line runs on the host named above it, from the job's files in its job directory;",
        "# `clusterkit launch` does this for you. This file is a reference and runs nothing:",
        "exit 0",
    ]
    for name, cmds in plan.commands.items():
        chosen = " (chosen)" if name in plan.chosen else ""
        lines += ["", f"# == {name}{chosen}"]
        for cmd in cmds:
            where = "the submit host / inside an allocation" if cmd.host is None else cmd.host
            if cmd.host is not None:
                where += f" ({plan.node(cmd.host).host.address})"
            lines.append(f"# {cmd.label}: on {where}")
            lines.append(cmd.shell_line())
    for name, why in plan.skipped.items():
        lines += ["", f"# == {name}: not rendered: {' '.join(why.splitlines())}"]
    return "\n".join(lines) + "\n"


def _command_json(cmd: NodeCommand) -> dict[str, Any]:
    return {"label": cmd.label, "host": cmd.host, "node_rank": cmd.node_rank,
            "cwd": cmd.cwd, "env": dict(cmd.env), "argv": list(cmd.argv),
            "shell_line": cmd.shell_line()}


def plan_json(plan: LaunchPlan) -> str:
    doc: dict[str, Any] = {
        "job_id": plan.job_id,
        "cluster": plan.cluster,
        "backend": plan.backend,
        "world_size": plan.world_size,
        "master_addr": plan.master_addr,
        "master_port": plan.master_port,
        "storage": plan.storage,
        "job_dir": plan.job_dir,
        "program": list(plan.program),
        "nodes": [{"node_rank": n.node_rank, "host": n.name, "address": n.host.address,
                   "slots": list(n.slots), "ranks": [n.ranks.start, n.ranks.stop - 1],
                   "python": n.python, "workdir": n.workdir, "job_dir": n.job_dir,
                   "ckpt_dir": n.ckpt_dir, "env": dict(n.env)} for n in plan.nodes],
        "commands": {k: [_command_json(c) for c in v] for k, v in plan.commands.items()},
        "skipped": dict(plan.skipped),
        "files": sorted({*plan.artifacts, "commands.sh", "plan.json"}),
    }
    if plan.doctor_ifaces:  # absent without a doctor pick: such plans read as before
        doc["doctor_ifaces"] = {n: dict(env) for n, env in plan.doctor_ifaces.items()}
    if plan.replica_targets:  # absent without checkpoint replicas (issue 22)
        doc["replicas"] = plan.replica_placement()
    return json.dumps(doc, indent=2) + "\n"


def summary(plan: LaunchPlan) -> str:
    z = plan.zero
    per_node = sorted({n.nproc for n in plan.nodes})
    shape = f"{len(plan.nodes)} nodes x {per_node[0]}" if len(per_node) == 1 else \
        f"{len(plan.nodes)} nodes"
    lines = [
        f"job {plan.job_id} on {plan.cluster}: {shape} = {plan.world_size} ranks, "
        f"backend {plan.backend}",
        f"master {plan.master_addr}:{plan.master_port}, storage {plan.storage}, "
        f"job dir {plan.job_dir}",
        f"ZeRO {z.stage}, offload optimizer={z.offload_optimizer} param={z.offload_param}, "
        f"{z.precision}, global batch {z.train_batch_size} = micro {z.micro_batch} x accum "
        f"{z.grad_accum} x world {z.world_size}",
    ]
    for n in plan.nodes:
        lines.append(f"  node {n.node_rank}: {n.name} ({n.host.address}) ranks "
                     f"{n.ranks.start}-{n.ranks.stop - 1} slots {','.join(map(str, n.slots))} "
                     f"ckpt {n.ckpt_dir}")
    lines += _iface_lines(plan)
    if plan.profile is not None and not plan.options.uses_workload:
        lines.append(f"  {plan.profile.line()}")  # how it saves and resumes (issue 38)
    if plan.replica_targets:
        lines.append("  replicas: " + "; ".join(
            f"{src} -> {', '.join(dst)}" for src, dst in plan.replica_placement().items()))
    for name, why in plan.skipped.items():
        lines.append(f"  not rendered: {name}: {why}")
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"


def _iface_lines(plan: LaunchPlan) -> list[str]:
    """What doctor's saved interface pick set, nodes with the same settings folded."""
    settings = {n: " ".join(f"{k}={v}" for k, v in env.items())
                for n, env in plan.doctor_ifaces.items()}
    return [f"  doctor's interface pick: {row}" for row in folded_lines(settings.items())]


FILE_MARK = "===== "


def dry_run_text(plan: LaunchPlan) -> str:
    """The summary, then every file exactly as ``render`` writes it, each under a marker line."""
    parts = [summary(plan)]
    for name, text in plan.artifacts.items():
        parts.append(f"{FILE_MARK}{name} ({len(text.encode())} bytes)\n{text}")
    return "\n".join(parts)
