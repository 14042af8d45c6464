"""The environment every rank of a node gets (a plan decision, pure).

It is built from an allowlist, never from a dump of the launcher's environment
(accelerate#2839): a few well-known names and globs, the inventory's
``env_allowlist`` globs, the inventory's ``env`` values and the user's
``--env``/``--set-env``. Names that look like secrets are only taken from the
launcher's environment when they are listed by their exact name. Every value must
survive ``.deepspeed_env`` (:mod:`clusterkit.shellsafe`).
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from collections.abc import Iterable, Mapping

from clusterkit.node.contract import ENV_JOB_ID
from clusterkit.shellsafe import check_env_name, check_env_value
from clusterkit.spec.job import SYSTEM_PATH

DEFAULT_ALLOWLIST: tuple[str, ...] = (
    "NCCL_*", "GLOO_SOCKET_IFNAME", "PYTHONPATH", "CUDA_HOME", "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
)
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)
_GLOB_CHARS = set("*?[")
# NCCL's settings (and torch's for its NCCL process group) mean nothing to a CPU (gloo)
# job; torch >= 2.7 even prints a deprecation warning on every rank for some of them
# (TORCH_NCCL_TRACE_BUFFER_SIZE). A node without GPUs does not get them from the
# launching shell or the inventory; a name the user sets with --set-env still goes.
GPU_ONLY_PREFIXES = ("NCCL_", "TORCH_NCCL_")


def is_secret_name(name: str) -> bool:
    return bool(_SECRET.search(name))


def allowed_from_environ(environ: Mapping[str, str], patterns: Iterable[str]) -> dict[str, str]:
    """The variables of ``environ`` matched by ``patterns``, in sorted name order.

    A glob never matches a secret-looking name; an exact name always does.
    """
    patterns = tuple(patterns)
    exact = {p for p in patterns if not set(p) & _GLOB_CHARS}
    globs = [p for p in patterns if set(p) & _GLOB_CHARS]
    out: dict[str, str] = {}
    for name in sorted(environ):
        if name in exact or (not is_secret_name(name)
                             and any(fnmatch.fnmatchcase(name, g) for g in globs)):
            out[name] = environ[name]
    return out


def _path_list(first: Iterable[str], rest: str | None) -> str:
    seen: dict[str, None] = {}
    for entry in [*first, *(rest.split(":") if rest else [])]:
        if entry:
            seen.setdefault(entry, None)
    return ":".join(seen)


def build_env(
    *,
    python: str,
    environ: Mapping[str, str],
    host_env: Mapping[str, str],
    host_allowlist: Iterable[str],
    user_allowlist: Iterable[str],
    set_env: Iterable[tuple[str, str]],
    cuda_lib_dirs: Iterable[str],
    job_id: str,
    gpu: bool = True,
) -> dict[str, str]:
    """Every variable a rank on one node gets, later sources overriding earlier ones.

    PATH starts with the interpreter's bin directory so console scripts installed
    next to it (``ninja`` for DeepSpeed's op builds, ``deepspeed``, ``accelerate``)
    are found on every node, whatever the remote login shell sets; then
    ``$CUDA_HOME/bin`` (nvcc for JIT op builds) and the standard system directories.
    """
    env = allowed_from_environ(environ, (*DEFAULT_ALLOWLIST, *host_allowlist, *user_allowlist))
    cuda_home = host_env.get("CUDA_HOME") or env.get("CUDA_HOME")
    first = [posixpath.dirname(python), *([posixpath.join(cuda_home, "bin")] if cuda_home else [])]
    env["PATH"] = _path_list(first, ":".join(SYSTEM_PATH))
    ld = _path_list(cuda_lib_dirs, environ.get("LD_LIBRARY_PATH"))
    if ld:
        env["LD_LIBRARY_PATH"] = ld
    env["PYTHONUNBUFFERED"] = "1"
    env.update(host_env)
    if not gpu:
        env = {k: v for k, v in env.items() if not k.startswith(GPU_ONLY_PREFIXES)}
    env.update(dict(set_env))
    env[ENV_JOB_ID] = job_id  # tags every rank: job-scoped status/teardown
    for name, value in env.items():
        check_env_name(name)
        check_env_value(name, value)
    return env
