"""Doctor rules: the build toolchain (ninja, CUDA) and pdsh where DeepSpeed's runner needs it."""

from __future__ import annotations

from collections.abc import Mapping

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.rules_base import (
    DoctorContext,
    ok_nodes,
)

# ----------------------------------------------------------------------------- build toolchain


def check_ninja(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in ok_nodes(facts):
        py = f.python_executable or "python"
        bindir = py.rsplit("/", 1)[0] if "/" in py else None
        if f.tools.get("ninja"):
            out.append(Finding("ninja", Status.PASS, f.host, "ninja on PATH"))
        elif f.versions.get("ninja") and bindir:
            out.append(Finding("ninja", Status.WARN, f.host,
                               "ninja is installed but not on the PATH remote commands get",
                               f"add PATH={bindir}:$PATH to .deepspeed_env (or the "
                               f"inventory env) so DeepSpeed can JIT-build ops"))
        else:
            out.append(Finding("ninja", Status.WARN, f.host,
                               "ninja not found: DeepSpeed cannot JIT-build ops",
                               f"{py} -m pip install ninja (into the interpreter's env) and "
                               f"make sure its bin dir is on PATH in .deepspeed_env"))
    return out


def _has_gpus(f: NodeFacts, ctx: DoctorContext) -> bool:
    return bool(f.gpu_count) or ctx.gpus.get(f.host, 0) > 0


def check_cuda(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in ok_nodes(facts):
        if not _has_gpus(f, ctx):
            out.append(Finding("cuda", Status.PASS, f.host, "no GPU: CUDA checks skipped"))
            continue
        if not f.libcudart:
            out.append(Finding("cuda.libcudart", Status.FAIL, f.host,
                               "libcudart.so not found (LD_LIBRARY_PATH, CUDA_HOME, torch/lib, "
                               "ldconfig)",
                               "install the CUDA runtime (or a CUDA torch wheel) and add its lib "
                               "dir to LD_LIBRARY_PATH in .deepspeed_env"))
        else:
            out.append(Finding("cuda.libcudart", Status.PASS, f.host, "libcudart found"))
        if f.cuda_home and not f.cuda_home_exists:
            out.append(Finding("cuda.home", Status.FAIL, f.host,
                               f"CUDA_HOME={f.cuda_home} does not exist",
                               "point CUDA_HOME at the CUDA toolkit (dir with bin/nvcc)"))
        elif not f.cuda_home and not f.nvcc:
            out.append(Finding("cuda.home", Status.WARN, f.host,
                               "CUDA_HOME unset and no nvcc on PATH: DeepSpeed JIT ops will fail",
                               "install the CUDA toolkit matching torch's CUDA and set "
                               "CUDA_HOME in .deepspeed_env"))
        else:
            out.append(Finding("cuda.home", Status.PASS, f.host, "CUDA toolkit found"))
    return out


def check_pdsh(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    """pdsh is needed where DeepSpeed's runner runs.

    ``DoctorMode.HEAD_PDSH``: the runner runs on the launching machine (``deepspeed
    --hostfile`` by hand). ``FIRST_NODE_PDSH`` (``clusterkit launch --launcher
    deepspeed``): the runner runs on the first selected node and reaches the others
    through pdsh from there. The mode is the registry's (``Backend.doctor``).
    """
    fix = "apt-get install pdsh (or yum install pdsh), or use --backend torchrun"
    if ctx.backend.runner_on_head:
        if ctx.head_tools.get("pdsh"):
            return [Finding("pdsh", Status.PASS, "", "pdsh found on the launching machine")]
        return [Finding("pdsh", Status.FAIL, "", "pdsh not found on the launching machine "
                        "(the DeepSpeed runner needs it)", fix)]
    if not ctx.backend.runner_on_first_node or not ctx.hosts:
        return []
    runner = facts.get(ctx.hosts[0])
    if runner is None or not runner.ok:
        return []
    if runner.tools.get("pdsh"):
        return [Finding("pdsh", Status.PASS, runner.host, "pdsh on PATH (DeepSpeed runner node)")]
    return [Finding("pdsh", Status.FAIL, runner.host,
                    "pdsh not on the PATH remote commands get; the DeepSpeed runner starts "
                    "here (first node) and reaches the others through pdsh", fix)]
