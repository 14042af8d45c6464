"""CLI safety nets that apply to every verb: habits from DeepSpeed/torchrun, values
checked before anything starts, and clusterkit flags typed after the script.

* :func:`install` (from ``build_parser``): DeepSpeed/torchrun spellings as hidden
  aliases of the flag with the same meaning (``--num_nodes`` -> ``--nodes``, ...),
  and the list of each verb's own flags for :func:`split_program`.
* :func:`check_args` (from ``main``, before the verb runs): numeric and enumerated
  values, one line naming the flag the user typed (exit 2), and the program words of
  ``launch``, ``render`` and ``sbatch`` checked for launch-control flags.

After the script, everything is the script's (as with torchrun, DeepSpeed's runner and
accelerate): ``train.py --deepspeed --deepspeed_config ds.json --steps 5 --save 2``
hands all six words to train.py. The one exception is an exact spelling of one of
the verb's *launch-control* flags (``--dry-run``, ``--nodes``, ``-i``/``--inventory``,
``--launcher``, ``--job-id``, ``--grace``, ``--sync``, ...): there it was almost
surely meant for clusterkit, and is refused with a hint (before SCRIPT, or after
``--`` for the script). Which flags a script commonly shares with clusterkit's job
model (``--steps``, ``--lr``, ``--micro-batch``, ... : the spec's "workload and ZeRO"
group) is said once, in ``cli/jobflags.py`` (``SCRIPT_GROUPS``); those pass through.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from clusterkit.cli.argparser import nonempty
from clusterkit.errors import ClusterkitError, UsageError
from clusterkit.node.sync.wire import PORT_TRIES

OWN_FLAGS = "_own_flags"  # namespace attribute set by install(): ((flag, dest), ...)
# Namespace attribute a verb sets: first program words that are its own actions, whose
# words it parses itself (`clusterkit sbatch status JOBID --watch`).
PROGRAM_ACTIONS = "_program_actions"
# Namespace attribute set by jobflags.add_program() on a verb with a program: the dests
# whose flags after SCRIPT are the script's own words (jobflags.script_dests()).
SCRIPT_DESTS = "_script_dests"
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


def _finite(low: float, high: float = math.inf, *, low_ok: bool = True) -> Callable[[object], bool]:
    """A real number in [low, high] ((low, high] without ``low_ok``); never NaN or inf."""
    def ok(v: object) -> bool:
        return (isinstance(v, (int, float)) and math.isfinite(v) and v <= high
                and (v >= low if low_ok else v > low))
    return ok


RULES: tuple[Rule, ...] = (
    # doctor's --master-port: 0 skips the port test (docs/doctor.md)
    Rule("master_port", "--master-port", lambda v: isinstance(v, int) and 0 <= v <= 65535,
         "a TCP port 1-65535 (0: skip the test)"),
    # sync's --port: the first of the PORT_TRIES ports a node tries (node/sync/wire.py)
    Rule("port", "--port", lambda v: isinstance(v, int) and 1 <= v <= 65536 - PORT_TRIES,
         f"a TCP port 1-{65536 - PORT_TRIES} (the first of {PORT_TRIES} tried)"),
    Rule("op", "--op", lambda v: isinstance(v, list) and all(v),
         "a DeepSpeed op builder's name, not empty"),
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
    Rule("env_allowlist", "--env", lambda v: isinstance(v, list) and all(v),
         "a variable name or glob, not empty"),
    Rule("lr", "--lr", _finite(0, low_ok=False), "a number > 0"),
    Rule("clip", "--clip", _finite(0), "a number >= 0 (0: off)"),
    Rule("gpu_fraction", "--gpu-fraction", _finite(0, 1, low_ok=False),
         "a fraction > 0 and <= 1"),
    Rule("jobs", "--jobs", _at_least(1), "a number >= 1"),
    Rule("world_size", "--world-size", _at_least(1), "a number >= 1"),
)


# A flag that does nothing without another one: (dest, flag, the other is given, what to
# add). Refused instead of being ignored silently.
NEEDS: tuple[tuple[str, str, Callable[[argparse.Namespace], bool], str], ...] = (
    ("drop_failed_nodes", "--drop-failed-nodes", lambda a: bool(getattr(a, "max_restarts", 0)),
     "--max-restarts K (nodes are dropped on a restart)"),
)


class NotForThisVerb(argparse.Action):
    """A flag that belongs to another verb (``launch --partition``): recognised, so the
    answer says where it belongs instead of "unknown flag"; refused when used."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, where: str,
                 **kwargs: Any) -> None:
        kwargs["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, **kwargs)
        self.where = where

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        raise UsageError(f"only for {self.where}; `{parser.prog}` does not use it",
                         key=option_string, prog=parser.prog,
                         hint=f"drop it here, or run {self.where}")


def install(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Aliases and the own-flags list on every verb's parser (after the verbs are built)."""
    for parser in sub.choices.values():
        _add_aliases(parser)
        flags = sorted({(s, a.dest) for a in parser._actions for s in a.option_strings
                        if not isinstance(a, (argparse._HelpAction, NotForThisVerb))})
        parser.set_defaults(**{OWN_FLAGS: tuple(flags)})


def _add_aliases(parser: argparse.ArgumentParser) -> None:
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    for alias, target in ALIASES.items():
        action = by_flag.get(target)
        if action is None or alias in by_flag or action.nargs not in (None, "?"):
            continue  # only where the verb has the same flag, taking one value
        kind = _hostfile if alias == "--hostfile" else action.type
        parser.add_argument(alias, dest=action.dest, type=kind,  # type: ignore[arg-type]
                            choices=action.choices, metavar=action.metavar,
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _hostfile(value: str) -> HostfilePath:
    return HostfilePath(nonempty(value))


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad values before the verb starts anything (one line, exit 2)."""
    for rule in RULES:
        value = getattr(args, rule.dest, None)
        if value is not None and not rule.ok(value):
            raise ClusterkitError(f"must be {rule.need}, got {value!r}", key=rule.flag)
    for dest, flag, given, other in NEEDS:
        if getattr(args, dest, None) and not given(args):
            raise ClusterkitError(f"does nothing without {other.split(' (')[0]}", key=flag,
                                  hint=f"add {other}, or drop {flag}")
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
        control = control_flags(getattr(args, OWN_FLAGS, ()), getattr(args, SCRIPT_DESTS, ()))
        args.program = split_program(words, control, module=getattr(args, "module", None)
                                     or getattr(args, "script_option", None))


def control_flags(own: Sequence[tuple[str, str]], passing: Collection[str]) -> frozenset[str]:
    """The verb's flags that are refused after SCRIPT: all of its own (short and long,
    aliases included) except those whose job field a script commonly has too
    (``passing``: the verb's :data:`SCRIPT_DESTS`, set where its program is added)."""
    return frozenset(flag for flag, dest in own if dest not in passing)


def split_program(words: Sequence[str], control: Collection[str],
                  module: str | None = None) -> list[str]:
    """``SCRIPT ARGS``: every word of ARGS is the script's, except an exact spelling of a
    launch-control flag (``control``), refused; a ``--`` after the script passes what
    follows to the script verbatim (the ``--`` itself is dropped).

    A leading ``--`` (``launch ... -- train.py ...``) already means "all of this is
    the program" and is left for the verb.
    """
    if not words or words[0] == "--":
        return list(words)
    head = 0 if module else 1  # with --module every word is an argument
    rest = list(words[head:])
    cut = rest.index("--") if "--" in rest else len(rest)
    name = module or words[0]
    for word in rest[:cut]:
        flag = word.split("=", 1)[0]
        if flag in control:
            raise ClusterkitError(
                f"a clusterkit launch flag after the program {name}: clusterkit would not "
                f"see it", key=flag,
                hint=f"put it before {name}, or after `--` to hand it to your script "
                     f"(`{name} -- {word} ...`)")
    return [*words[:head], *rest[:cut], *rest[cut + 1:]]


def node_spec_hint(value: str) -> str | None:
    """For a missing ``-i`` file: DeepSpeed's ``-i`` is ``--include``; say so."""
    if value.endswith((".yaml", ".yml", ".json")) or "/" in value:
        return None
    if _NODE_SPEC.fullmatch(value):
        return (f"did you mean --include {value}? (-i is DeepSpeed's --include; in "
                f"clusterkit -i is the inventory file)")
    return None
