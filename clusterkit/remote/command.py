"""Turning ``argv`` + ``env`` into the one string a remote shell runs.

sshd hands the command string to the user's login shell (``$SHELL -c``), so the
argv is quoted exactly once, here, with :func:`shlex.join` (POSIX quoting: the
login shell must be sh-compatible — bash, dash, zsh, ksh). Environment values are
passed as ``env K=V ... argv``: every word is single-quoted, so spaces, quotes,
``$(...)`` and newlines arrive verbatim and nothing is expanded or executed.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from clusterkit.errors import TransportError

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_env(env: Mapping[str, str] | None, host: str | None = None) -> dict[str, str]:
    """Validate names (a bad name would be parsed by ``env`` as the command)."""
    if not env:
        return {}
    for name, value in env.items():
        if not _ENV_NAME.match(name):
            raise TransportError(
                f"invalid environment variable name {name!r}",
                kind="usage",
                host=host,
                hint="names must match [A-Za-z_][A-Za-z0-9_]*",
            )
        if "\0" in value:
            raise TransportError(
                f"environment variable {name} contains a NUL byte",
                kind="usage",
                host=host,
            )
    return dict(env)


def check_argv(argv: Sequence[str], host: str | None = None) -> tuple[str, ...]:
    if isinstance(argv, str):
        # A bare string would be split into characters; commands are list[str].
        raise TransportError("a command must be a list of words, not a string", kind="usage", host=host)
    words = tuple(argv)
    if not words:
        raise TransportError("empty command", kind="usage", host=host)
    return words


def remote_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The shell string for ``argv`` with ``env`` set, quoted once."""
    words = list(check_argv(argv))
    assignments = [f"{k}={v}" for k, v in check_env(env).items()]
    if assignments:
        # `env` (not `K=V cmd`) so the prefix also works when argv[0] is a builtin-free
        # path and when a value would look like shell syntax: each word is one quote.
        words = ["env", *assignments, *words]
    return shlex.join(words)
