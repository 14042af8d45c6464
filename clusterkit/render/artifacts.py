"""Every file ``clusterkit render`` writes, as text (pure), and the dry-run listing."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from clusterkit.errors import RenderError
from clusterkit.hostfile import render_hostfile
from clusterkit.render.accelerate_config import render_accelerate_config
from clusterkit.render.commands import (
    JobLayout,
    accelerate_commands,
    accelerate_config_name,
    deepspeed_command,
    sbatch_command,
    srun_command,
    torchrun_commands,
    torchrun_pdsh_command,
)
from clusterkit.render.dsenv import render_deepspeed_env
from clusterkit.render.sbatch import render_sbatch
from clusterkit.render.ssh_config import render_ssh_config
from clusterkit.spec.backends import BACKENDS
from clusterkit.spec.job import LaunchPlan, NodeCommand

# command set -> builder; the order is the order of commands.sh
COMMAND_BUILDERS: dict[str, Callable[[JobLayout], tuple[NodeCommand, ...]]] = {
    "torchrun": torchrun_commands,
    "torchrun-pdsh": torchrun_pdsh_command,
    "deepspeed": deepspeed_command,
    "accelerate": accelerate_commands,
    "srun": srun_command,
    "sbatch": sbatch_command,
}
def _attempt(fn: Callable[[], Any], name: str, required: bool, skipped: dict[str, str]) -> Any:
    try:
        return fn()
    except RenderError as exc:
        if required:
            raise
        skipped[name] = exc.one_line()
        return None


@dataclass(frozen=True)
class Rendered:
    """Every file and command set of one job, and why any optional one was not rendered."""

    files: dict[str, str]
    commands: dict[str, tuple[NodeCommand, ...]]
    skipped: dict[str, str]


def render_all(layout: JobLayout, cluster: str, ds_config: Mapping[str, Any]) -> Rendered:
    """The launch files and every backend's commands (pure). The chosen backend's own
    artifacts must render (their RenderError propagates); the others are noted in
    ``skipped`` with the reason."""
    skipped: dict[str, str] = {}
    files = _render_files(layout, cluster, ds_config, skipped)
    commands = _render_commands(layout, skipped)
    return Rendered(files, commands, skipped)


def with_reference_files(plan: LaunchPlan) -> LaunchPlan:
    """The plan with ``commands.sh`` and ``plan.json`` added (both describe the plan itself)."""
    files = {**plan.artifacts, "commands.sh": render_commands_sh(plan)}
    plan = dataclasses.replace(plan, artifacts=files)
    return dataclasses.replace(plan, artifacts={**files, "plan.json": plan_json(plan)})


def _render_commands(layout: JobLayout, skipped: dict[str, str]
                     ) -> dict[str, tuple[NodeCommand, ...]]:
    required = BACKENDS[layout.options.backend].command_sets
    out: dict[str, tuple[NodeCommand, ...]] = {}
    for name, builder in COMMAND_BUILDERS.items():
        if name == "sbatch" and "sbatch.sh" in skipped:
            skipped[name] = skipped["sbatch.sh"]
            continue
        cmds = _attempt(functools.partial(builder, layout), name, name in required, skipped)
        if cmds is not None:
            out[name] = cmds
    return out


def _render_files(layout: JobLayout, cluster: str, ds_config: Mapping[str, Any],
                  skipped: dict[str, str]) -> dict[str, str]:
    """hostfile, deepspeed_env, ssh_config, ds_config.json, accelerate YAMLs, sbatch.sh."""
    node0 = layout.nodes[0]
    files: dict[str, str] = OrderedDict()
    files["hostfile"] = render_hostfile(OrderedDict((n.name, list(n.slots)) for n in layout.nodes))
    files["deepspeed_env"] = render_deepspeed_env(node0.env)
    files["ssh_config"] = render_ssh_config([n.host for n in layout.nodes])
    files["ds_config.json"] = json.dumps(ds_config, indent=2) + "\n"
    for node in layout.nodes:
        files[accelerate_config_name(node.node_rank)] = render_accelerate_config(
            layout, node.node_rank, f"{node.job_dir}/ds_config.json")
    sbatch = _attempt(lambda: render_sbatch(layout, cluster), "sbatch.sh",
                      "sbatch" in BACKENDS[layout.options.backend].command_sets, skipped)
    if sbatch is not None:
        files["sbatch.sh"] = sbatch
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
        chosen = " (chosen)" if name in BACKENDS[plan.backend].command_sets else ""
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
    for name, why in plan.skipped.items():
        lines.append(f"  not rendered: {name}: {why}")
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"


FILE_MARK = "===== "


def dry_run_text(plan: LaunchPlan) -> str:
    """The summary, then every file exactly as ``render`` writes it, each under a marker line."""
    parts = [summary(plan)]
    for name, text in plan.artifacts.items():
        parts.append(f"{FILE_MARK}{name} ({len(text.encode())} bytes)\n{text}")
    return "\n".join(parts)
