"""The rules for values that reach a shell, in one place.

Most of clusterkit quotes each word once with :func:`shlex.join`, which makes any
string safe. Two consumers re-parse what we hand them with weaker quoting, so
values bound for them are *validated* instead (a refused value raises
:class:`RenderError` naming it; it is never silently altered):

* DeepSpeed's runner (``deepspeed/launcher/multinode_runner.py``) wraps an exported
  value in ``"..."`` only when it contains a character outside ``[\\w@%+=:,./-]``
  (inside double quotes ``$``, backquote, ``\\`` and ``"`` stay live), passes a user
  argument raw unless it contains a space (then ``"..."`` again), and puts the
  working directory, interpreter path and master address on the line unquoted.
* pdsh substitutes ``%h``/``%u``/``%n`` in the remote command and turns ``%%`` into ``%``.
"""

from __future__ import annotations

import re

from clusterkit.errors import RenderError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# DeepSpeed's add_export leaves a value unquoted when it matches this (Python \w is Unicode).
DS_PLAIN = re.compile(r"[^\w@%+=:,./-]")
# Characters that stay live inside DeepSpeed's "..." wrapping, plus pdsh's % escapes.
_DS_LIVE_IN_QUOTES = set('"$`\\%')
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Unquoted words: DeepSpeed pastes cwd / python / master address as they are.
_BARE_WORD = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
PDSH_NODE_RANK = "%n"
NODE_RANK_PLACEHOLDER = "@CLUSTERKIT_NODE_RANK@"  # shlex leaves it unquoted


def check_env_name(name: str, where: str = "environment") -> str:
    if not ENV_NAME.fullmatch(name):
        raise RenderError(f"invalid environment variable name {name!r}", key=name,
                          hint=f"{where}: names must match [A-Za-z_][A-Za-z0-9_]*")
    return name


def check_env_value(name: str, value: str) -> str:
    """A value every artifact can carry verbatim (the .deepspeed_env rules are the strictest).

    The same environment goes into .deepspeed_env, the sbatch exports and the
    command lines, so it is checked once against the weakest of them.
    """
    bad = sorted({c for c in value if c in _DS_LIVE_IN_QUOTES})
    if _CONTROL.search(value):
        raise RenderError(f"environment variable {name} contains a newline or control character",
                          key=name, hint="DeepSpeed reads .deepspeed_env line by line; "
                          "remove the line break from the value")
    if bad:
        raise RenderError(
            f"environment variable {name} contains {' '.join(repr(c) for c in bad)}, which "
            "DeepSpeed's runner would pass to the remote shell unescaped",
            key=name, hint="set a literal value without \" $ ` \\ % (expand variables before "
            "launching)")
    if value != value.strip():
        raise RenderError(f"environment variable {name} has leading or trailing whitespace",
                          key=name, hint="DeepSpeed strips it; remove it from the value")
    return value


def ds_user_arg(arg: str, what: str = "script argument") -> str:
    """An argument that survives DeepSpeed's pdsh re-quoting unchanged and inert."""
    if arg == "":
        raise RenderError(f"empty {what}", key=what,
                          hint="DeepSpeed's pdsh launcher drops empty arguments")
    if _CONTROL.search(arg) or set(arg) & (_DS_LIVE_IN_QUOTES | {"!"}):
        raise RenderError(f"{what} {arg!r} cannot pass through DeepSpeed's pdsh launcher safely",
                          key=what, hint="it re-quotes arguments with \"...\" only when they contain "
                          "a space; avoid \" $ ` \\ % ! and line breaks, or use --launcher torchrun")
    if " " not in arg and DS_PLAIN.search(arg):
        raise RenderError(f"{what} {arg!r} contains shell syntax that DeepSpeed's pdsh launcher "
                          "passes unquoted", key=what,
                          hint="use letters, digits and @%+=:,./- only, or use --launcher torchrun")
    return arg


def bare_word(value: str, what: str) -> str:
    """A value DeepSpeed or pdsh puts on a remote command line without any quoting."""
    if not _BARE_WORD.fullmatch(value):
        raise RenderError(f"{what} {value!r} cannot appear unquoted on a remote command line",
                          key=what, hint="use letters, digits and _@+=:,./- only")
    return value


def pdsh_remote(text: str) -> str:
    """A remote shell line (already quoted once) made ready for pdsh: ``%`` escaped.

    ``text`` carries :data:`NODE_RANK_PLACEHOLDER` exactly once (inside a word such as
    ``--node-rank=...``); it becomes pdsh's ``%n``, the position of the host in the
    ``-w`` list, which is the hostfile order.
    """
    if text.count(NODE_RANK_PLACEHOLDER) != 1:
        raise RenderError(f"a value contains the reserved word {NODE_RANK_PLACEHOLDER}",
                          hint="rename it")
    return text.replace("%", "%%").replace(NODE_RANK_PLACEHOLDER, PDSH_NODE_RANK)


def ssh_config_value(value: str, what: str) -> str:
    """A value for ssh_config(5): double quotes allow spaces; quotes and line breaks cannot."""
    if _CONTROL.search(value) or '"' in value or value == "":
        raise RenderError(f"{what} {value!r} cannot be written to an ssh_config file",
                          key=what, hint="remove quotes and line breaks")
    return f'"{value}"' if (" " in value or "#" in value) else value
