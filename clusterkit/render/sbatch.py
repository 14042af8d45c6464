"""The Slurm batch script, from ``templates/sbatch.sh.j2`` (jinja2, StrictUndefined).

Every value is quoted once with :func:`shlex.quote` (the ``q`` filter, or
``shlex.join`` for whole command lines); the only shell expansions in the script
are the fixed ``$MASTER_ADDR``/``$MASTER_PORT``/``$SLURM_*`` references written
into the template and the launch-line placeholders below.
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING

from clusterkit.errors import RenderError
from clusterkit.plan.ports import PORT_BASE, PORT_SPAN
from clusterkit.render.commands import (
    ACCELERATE,
    JobLayout,
    launcher_program,
    srun_torchrun_argv,
    uniform,
)

if TYPE_CHECKING:
    import jinja2

ADDR_WORD = "@CLUSTERKIT_MASTER_ADDR@"
PORT_WORD = "@CLUSTERKIT_MASTER_PORT@"
_SLURM_VALUE = re.compile(r"[A-Za-z0-9_.,:@+-]+")
_TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}|\d+-\d+")
# accelerate on each Slurm node: its machine_rank's YAML, the head resolved at run time.
# Slurm's USR1 (--signal=USR1@90, scancel --signal=USR1) reaches every process of the
# step. torchrun and `accelerate launch` do not handle USR1, so its default action would
# kill the launcher and --kill-on-bad-exit would then kill the ranks while they save a
# checkpoint (measured on a real Slurm 22.05): the launcher ignores it; the ranks install
# their own handler (an ignored signal stays ignored only until a program sets one).
IGNORE_USR1 = 'trap "" USR1; '
ACCELERATE_EXEC = (IGNORE_USR1 + 'd=$1; shift; exec "$0" ' + " ".join(ACCELERATE)
                   + ' --config_file="$d/accelerate_config.rank$SLURM_NODEID.yaml"'
                   ' --main_process_ip="$MASTER_ADDR" --main_process_port="$MASTER_PORT" "$@"')


@cache
def _environment() -> jinja2.Environment:
    # Imported here: jinja2 costs ~0.1-0.5 s to import and only this renderer needs it,
    # while every `clusterkit` invocation imports the plan package.
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(_load_template),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # shell, not HTML: values are quoted with the q filter instead
        keep_trailing_newline=True,
    )
    env.filters["q"] = shlex.quote
    return env


def _load_template(name: str) -> str:
    # templates/ is installed as the package clusterkit.templates (see pyproject.toml).
    return resources.files("clusterkit.templates").joinpath(name).read_text(encoding="utf-8")


def _slurm_value(value: str | None, key: str) -> str | None:
    """#SBATCH lines are not shell: a value must be one plain word."""
    if value is not None and not _SLURM_VALUE.fullmatch(value):
        raise RenderError(f"Slurm option {key} {value!r} is not a plain word", key=key,
                          hint="use letters, digits and _.,:@+- only")
    return value


def _with_shell_vars(argv: list[str]) -> str:
    """shlex.join, then the two placeholders become "$MASTER_ADDR"/"$MASTER_PORT"."""
    line = shlex.join(argv)
    if line.count(ADDR_WORD) != 1 or line.count(PORT_WORD) != 1:
        raise RenderError("a value contains a reserved word @CLUSTERKIT_MASTER_...@",
                          hint="rename it")
    return line.replace(ADDR_WORD, '"$MASTER_ADDR"').replace(PORT_WORD, '"$MASTER_PORT"')


def launch_line(layout: JobLayout, log_dir: str) -> tuple[str, str]:
    """(variant, the srun line) for the chosen backend."""
    backend = layout.options.backend
    if backend in ("torchrun", "slurm"):
        # TODO(commands.srun_torchrun_argv): torchrun needs IGNORE_USR1 too; it belongs in
        # the shared srun argv so the salloc line and this one stay identical.
        return "torchrun", _with_shell_vars(srun_torchrun_argv(layout, ADDR_WORD, PORT_WORD))
    uniform(layout, "srun")
    node = layout.nodes[0]
    env_words = ["env", *(f"{k}={v}" for k, v in node.env.items())]
    nodes = len(layout.nodes)
    if backend == "accelerate":
        program = launcher_program(layout.programs[0], "--module")
        argv = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                f"--chdir={node.workdir}", *env_words, "sh", "-c", ACCELERATE_EXEC, node.python,
                node.job_dir, *program]
        return "accelerate", shlex.join(argv)
    # deepspeed: one Slurm task per rank, as DeepSpeed's own slurm launcher does; the
    # workload reads SLURM_PROCID/SLURM_LOCALID and the exported MASTER_ADDR/PORT.
    argv = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={node.nproc}", "--kill-on-bad-exit=1",
            f"--chdir={node.workdir}", f"--output={log_dir}/%x-%j-rank%t.out", *env_words,
            node.python, "-u", *layout.programs[0]]
    return "srun-per-rank", shlex.join(argv)


def render_sbatch(layout: JobLayout, cluster: str) -> str:
    o = layout.options
    node = layout.nodes[0]
    log_dir = f"{node.job_dir}/logs"
    variant, line = launch_line(layout, log_dir)
    if not _TIME.fullmatch(o.time_limit):
        raise RenderError(f"--time {o.time_limit!r} is not a Slurm time", key="--time",
                          hint="use MINUTES, HH:MM:SS or D-HH:MM:SS")
    context = {
        "job_id": layout.job_id,
        "cluster": cluster,
        "job_name": _slurm_value(f"ck-{layout.job_id}", "--job-name"),
        "nodes": len(layout.nodes),
        # The allocation must hold every task of the launch step: srun inside a job
        # silently starts fewer tasks than asked for when the allocation has fewer
        # (measured: --ntasks-per-node=2 in a 1-task-per-node job ran world size 2, not 4).
        "ntasks_per_node": node.nproc if variant == "srun-per-rank" else 1,
        "gpus_per_node": node.nproc if node.host.gpus > 0 else 0,
        "cpus_per_task": o.cpus_per_task,
        "time_limit": o.time_limit,
        "partition": _slurm_value(o.partition, "--partition"),
        "account": _slurm_value(o.account, "--account"),
        "qos": _slurm_value(o.qos, "--qos"),
        "output": _path_word(f"{log_dir}/slurm-%j.out", "--output"),
        "error": _path_word(f"{log_dir}/slurm-%j.err", "--error"),
        "port_base": PORT_BASE,
        "port_span": PORT_SPAN,
        "exports": [f"{k}={shlex.quote(v)}" for k, v in node.env.items()],
        "log_dir": log_dir,
        "node_local_dirs": [node.ckpt_dir] if layout.node_local else [],
        "variant": variant,
        "launch_line": line,
    }
    return _environment().get_template("sbatch.sh.j2").render(context)


def _path_word(path: str, key: str) -> str:
    # `#SBATCH --output=PATH` is read by sbatch, not a shell: no quoting exists there.
    if re.search(r"[\s'\"\\$`]", path):
        raise RenderError(f"{key} path {path!r} cannot be written on an #SBATCH line", key=key,
                          hint="use a workdir without spaces, quotes or $")
    return path

