"""CLI safety nets that apply to every verb: habits from DeepSpeed/torchrun, values
checked before anything starts, and clusterkit flags typed after the script.

* :func:`install` (from ``build_parser``): DeepSpeed/torchrun spellings as hidden
  aliases of the flag with the same meaning (``--num_nodes`` -> ``--nodes``, ...),
  and the list of each verb's own long flags for :func:`split_program`.
* :func:`check_args` (from ``main``, before the verb runs): numeric and enumerated
  values, one line naming the flag the user typed (exit 2), and the program words of
  ``launch``, ``render`` and ``sbatch`` checked for clusterkit flags that would silently
  go to the script.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from clusterkit.errors import ClusterkitError

OWN_FLAGS = "_own_long_flags"  # namespace attribute set by install()
# Namespace attribute a verb sets: first program words that are its own actions, whose
# words it parses itself (`clusterkit sbatch status JOBID --watch`).
PROGRAM_ACTIONS = "_program_actions"
# DeepSpeed / torchrun spelling -> clusterkit flag with the same meaning.
ALIASES: dict[str, str] = {
    "--num_nodes": "--nodes", "--num-nodes": "--nodes",
    "--num_gpus": "--gpus-per-node", "--num-gpus": "--gpus-per-node",
    "--nproc_per_node": "--gpus-per-node", "--nproc-per-node": "--gpus-per-node",
    "--master_port": "--master-port", "--master_addr": "--master-addr",
    "--hostfile": "--inventory",
}
# torchrun's --local-ranks-filter: a comma-separated list of local ranks.
_RANK_LIST = re.compile(r"\d+(,\d+)*")
# DeepSpeed's NODE_SPEC: NAME[:SLOT[,SLOT...]][@NAME[:SLOT...]...]
_NODE_SPEC = re.compile(r"[A-Za-z0-9_.\-\[\]]+(:\d+(,\d+)*)?(@[A-Za-z0-9_.\-\[\]]+(:\d+(,\d+)*)?)*")


class HostfilePath(str):
    """An ``--inventory`` value that came from ``--hostfile``: a DeepSpeed hostfile."""


@dataclass(frozen=True)
class Rule:
    """A value check: ``ok(value)`` or the flag is refused with ``need``."""

    dest: str
    flag: str
    ok: Callable[[object], bool]
    need: str


def _at_least(minimum: float) -> Callable[[object], bool]:
    return lambda v: isinstance(v, (int, float)) and v >= minimum


RULES: tuple[Rule, ...] = (
    Rule("grace", "--grace", _at_least(0), "a number of seconds >= 0"),
    Rule("master_port", "--master-port", lambda v: isinstance(v, int) and 1 <= v <= 65535,
         "a TCP port 1-65535"),
    Rule("cpus_per_task", "--cpus-per-task", _at_least(1), "a number >= 1"),
    Rule("local_ranks_filter", "--local-ranks-filter",
         lambda v: isinstance(v, str) and bool(_RANK_LIST.fullmatch(v)),
         "local ranks as N or N,M,... (torchrun's meaning)"),
    Rule("nodes", "--nodes", _at_least(1), "a number >= 1"),
    Rule("gpus_per_node", "--gpus-per-node", _at_least(1), "a number >= 1"),
    Rule("steps", "--steps", _at_least(1), "a number >= 1"),
    Rule("micro_batch", "--micro-batch", _at_least(1), "a number >= 1"),
    Rule("grad_accum", "--grad-accum", _at_least(1), "a number >= 1"),
    Rule("save_every", "--save-every", _at_least(0), "a number >= 0"),
    Rule("max_restarts", "--max-restarts", _at_least(0), "a number >= 0"),
    Rule("warmup_steps", "--warmup-steps", _at_least(0), "a number >= 0"),
)


def install(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Aliases and the own-flags list on every verb's parser (after the verbs are built)."""
    for parser in sub.choices.values():
        _add_aliases(parser)
        flags = sorted({s for a in parser._actions for s in a.option_strings
                        if s.startswith("--") and s != "--help"})
        parser.set_defaults(**{OWN_FLAGS: tuple(flags)})


def _add_aliases(parser: argparse.ArgumentParser) -> None:
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    for alias, target in ALIASES.items():
        action = by_flag.get(target)
        if action is None or alias in by_flag or action.nargs not in (None, "?"):
            continue  # only where the verb has the same flag, taking one value
        kind = HostfilePath if alias == "--hostfile" else action.type
        parser.add_argument(alias, dest=action.dest, type=kind,  # type: ignore[arg-type]
                            choices=action.choices, metavar=action.metavar,
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad values before the verb starts anything (one line, exit 2)."""
    for rule in RULES:
        value = getattr(args, rule.dest, None)
        if value is not None and not rule.ok(value):
            raise ClusterkitError(f"must be {rule.need}, got {value!r}", key=rule.flag)
    model = getattr(args, "model", None)
    if isinstance(model, str):
        from clusterkit.workload.presets import PRESETS  # light: no torch

        if model not in PRESETS:
            raise ClusterkitError(f"unknown model {model!r}", key="--model",
                                  hint=f"choose one of {', '.join(PRESETS)}")
    words = getattr(args, "program", None)
    if isinstance(words, list) and words[:1] and words[0] in getattr(args, PROGRAM_ACTIONS, ()):
        return  # the verb's own action form, not a program
    if isinstance(words, list):
        # with -m MODULE or --script PATH every word is an argument of the program
        args.program = split_program(words, getattr(args, OWN_FLAGS, ()),
                                     module=getattr(args, "module", None)
                                     or getattr(args, "script_option", None))


def split_program(words: Sequence[str], own_flags: Sequence[str],
                  module: str | None = None) -> list[str]:
    """``SCRIPT ARGS``: refuse clusterkit's own long flags among ARGS; a ``--`` after the
    script passes what follows to the script verbatim (the ``--`` itself is dropped).

    A leading ``--`` (``launch ... -- train.py ...``) already means "all of this is
    the program" and is left for the verb.
    """
    if not words or words[0] == "--":
        return list(words)
    head = 0 if module else 1  # with --module every word is an argument
    rest = list(words[head:])
    cut = rest.index("--") if "--" in rest else len(rest)
    name = module or words[0]
    own = set(own_flags)
    for word in rest[:cut]:
        flag = word.split("=", 1)[0]
        if flag in own:
            raise ClusterkitError(
                f"a clusterkit flag after the program {name}: it would go to your program, "
                f"not to clusterkit", key=flag,
                hint=f"put clusterkit's flags before {name}, or write `{name} -- {word} ...` "
                     f"to pass it to your program")
    return [*words[:head], *rest[:cut], *rest[cut + 1:]]


def node_spec_hint(value: str) -> str | None:
    """For a missing ``-i`` file: DeepSpeed's ``-i`` is ``--include``; say so."""
    if value.endswith((".yaml", ".yml", ".json")) or "/" in value:
        return None
    if _NODE_SPEC.fullmatch(value):
        return (f"did you mean --include {value}? (-i is DeepSpeed's --include; in "
                f"clusterkit -i is the inventory file)")
    return None


def check_out_dir(out: str) -> None:
    """``--out DIR`` must be a directory clusterkit can create or write into; said before
    planning, as one line naming ``--out`` (not an OSError from the first write)."""
    from pathlib import Path

    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ClusterkitError("is a file, not a directory", path=out, key="--out",
                              hint="give a directory (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".clusterkit-write-test"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ClusterkitError(f"cannot write there: {e.strerror or e}", path=out, key="--out",
                              hint="choose a directory you can write to") from None
