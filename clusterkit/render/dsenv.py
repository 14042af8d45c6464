"""A node's environment as ``.deepspeed_env`` (pure); the environment itself is decided
in :mod:`clusterkit.plan.env`.

``.deepspeed_env`` format, from ``deepspeed/launcher/runner.py``: every line is
``split('=', 1)`` (a blank or comment line crashes the runner), key and value are
stripped, and a value with a character outside ``[\\w@%+=:,./-]`` is wrapped in
``"..."`` for the remote shell. :func:`clusterkit.shellsafe.check_env_value`
refuses values that would not survive that.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

from clusterkit.errors import RenderError
from clusterkit.shellsafe import check_env_name, check_env_value


def render_deepspeed_env(env: Mapping[str, str]) -> str:
    """``KEY=VALUE`` lines, nothing else (no blank lines, no comments)."""
    lines = []
    for name, value in env.items():
        check_env_name(name)
        check_env_value(name, value)
        lines.append(f"{name}={value}")
    text = "\n".join(lines) + "\n"
    if parse_deepspeed_env(text) != dict(env):  # belt and braces: read it back as DeepSpeed does
        raise RenderError("internal: .deepspeed_env does not read back as written")
    return text


def parse_deepspeed_env(text: str) -> dict[str, str]:
    """What DeepSpeed's runner reads from ``text`` (its exact splitting and stripping)."""
    out: dict[str, str] = {}
    # DeepSpeed opens the file in text mode: universal newlines, nothing else splits a line.
    for line in io.StringIO(text, newline=None).readlines():
        key, value = line.split("=", maxsplit=1)
        out[key.strip()] = value.strip()
    return out
