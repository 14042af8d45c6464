"""The one argparse parser class of every verb: exact flags only, every mistake one line.

``Parser`` is the top-level parser's class, so every verb's parser and every nested
``VERB ACTION`` parser (``inventory show``, ``nodes install``) is one too (argparse
builds subparsers with the parent's class):

* no prefix matching (``allow_abbrev=False``): ``--save`` is never ``--save-every``,
  ``--deepspeed`` never "ambiguous" — a word clusterkit does not know is unknown;
* every parse error is a :class:`~clusterkit.errors.UsageError` (one line, exit 2,
  "see `clusterkit VERB --help`"; ``cli/main.py`` prints it), never the usage text;
* an unknown verb, flag or choice names the closest one (difflib; for a flag, else the
  verb's flag of the same meaning, :data:`SAME_MEANING`); a flag of another verb also says
  whose it is (``launch --submit``: a flag of ``clusterkit sbatch``; main).
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from clusterkit.errors import UsageError

# argparse's own wording of its errors, rewritten to clusterkit's (Python 3.11's texts).
_ARGUMENT = re.compile(r"argument (.+?): (.*)", re.DOTALL)
_REWORDS = (
    (re.compile(r"invalid int value: (.*)"), r"expected a whole number, got \1"),
    (re.compile(r"invalid float value: (.*)"), r"expected a number, got \1"),
    (re.compile(r"expected one argument"), "needs a value"),
    (re.compile(r"not allowed with argument (?:\S+/)?(\S+)"), r"cannot be combined with \1"),
    (re.compile(r"the following arguments are required: (.*)"), r"missing \1"),
)
_NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d*)?")
# Flags that name one concept in different words, across tools and verbs: no spelling is
# close to another (`collect-ckpt --dest` means its `--to`, which difflib never finds), so
# an unknown flag of one group suggests the verb's flag of the same group.
SAME_MEANING = (
    frozenset({"--to", "--dest", "--destination", "--out", "--output", "--output-dir",
               "--target"}),
)


def flag_of(action: argparse.Action) -> str:
    """The name a user knows an argument by: its long flag, else its metavar/dest."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    if longs or action.option_strings:
        return (longs or action.option_strings)[0]
    return str(action.metavar or action.dest)


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The one candidate close enough to ``word`` to suggest: a near spelling (``--stesp``
    -> ``--steps``, ``--zero_stage`` -> ``--zero-stage``), else the one flag ``word``
    begins (``--zero`` -> ``--zero-stage``: no abbreviations, but the full name helps)."""
    def bare(text: str) -> str:
        return text.lstrip("-")

    pool = {bare(c): c for c in candidates}
    found = difflib.get_close_matches(bare(word), list(pool), n=1, cutoff=0.75)
    if found:
        return pool[found[0]]
    squash = {k.replace("-", "").replace("_", ""): v for k, v in pool.items()}
    found = difflib.get_close_matches(bare(word).replace("-", "").replace("_", ""),
                                      list(squash), n=1, cutoff=0.85)
    if found:
        return squash[found[0]]
    starts = [c for c in pool.values() if bare(word) and c.startswith(word)]
    return starts[0] if len(starts) == 1 else None


def same_meaning(flag: str, candidates: Iterable[str]) -> str | None:
    """The one of ``candidates`` that names what ``flag`` names in other words
    (:data:`SAME_MEANING`): ``--dest`` -> ``--to`` where a verb has ``--to``."""
    group = next((g for g in SAME_MEANING if flag in g), frozenset())
    found = [c for c in candidates if c in group and c != flag]
    return found[0] if len(found) == 1 else None


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with exact flags and one-line errors (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False  # also for the subparsers argparse makes of this class
        super().__init__(*args, **kwargs)

    def visible_flags(self) -> list[str]:
        """Long flags shown in --help (hidden aliases are accepted, not suggested)."""
        return [s for a in self._actions if a.help != argparse.SUPPRESS
                for s in a.option_strings if s.startswith("--") and s != "--help"]

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        # A parser of VERBs: a flag before the verb that it does not know is that, not a
        # "missing VERB" (`clusterkit --bogus`).
        if args is not None and self._subparsers is not None:
            for word in args:
                if not word.startswith("-"):
                    break
                if word.split("=", 1)[0] not in self._option_string_actions:
                    self._unknown([word])
        # Each parser refuses its own leftovers, so the innermost parser (the verb's)
        # names the unknown flag and suggests one of its own.
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self._unknown(extras)
        return ns, extras

    def _unknown(self, extras: list[str]) -> NoReturn:
        word = extras[0]
        if word.startswith("-") and len(word) > 1 and not _NEGATIVE_NUMBER.fullmatch(word):
            flag = word.split("=", 1)[0]
            mine = self.visible_flags()
            near = closest(flag, mine) or same_meaning(flag, mine)
            raise UsageError(f"unknown flag {flag}", prog=self.prog, unknown=flag,
                             hint=f"did you mean {near}?" if near else None)
        raise UsageError(f"unexpected argument {word!r}", prog=self.prog)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is None or value in action.choices:
            return
        names = [str(c) for c in action.choices]
        near = closest(str(value), names)
        if isinstance(action, argparse._SubParsersAction):
            raise UsageError(f"unknown verb {value!r}", prog=self.prog,
                             hint=f"did you mean `{self.prog} {near}`?" if near
                             else f"one of {', '.join(names)}")
        raise UsageError(f"invalid choice {value!r}", key=flag_of(action), prog=self.prog,
                         hint=(f"did you mean {near}? " if near else "")
                         + f"choose from {', '.join(names)}")

    def error(self, message: str) -> NoReturn:
        verbs = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)),
                     None)
        if verbs is not None and message.endswith(f"required: {verbs.metavar}"):
            raise UsageError(f"missing {verbs.metavar}", prog=self.prog,
                             hint=f"one of {', '.join(dict.fromkeys(verbs.choices))}")
        key = None
        m = _ARGUMENT.fullmatch(message)
        if m:
            key, message = m.group(1).split("/")[-1], m.group(2)
        for pattern, text in _REWORDS:
            message = pattern.sub(text, message)
        message = message.replace("argument ", "")
        raise UsageError(message, key=key, prog=self.prog)


def verbs_with(parser: argparse.ArgumentParser, flag: str) -> list[str]:
    """The commands under ``parser`` that have ``flag`` (``--submit`` -> clusterkit sbatch)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                if flag in sub._option_string_actions:
                    found.append(sub.prog)
                found += verbs_with(sub, flag)
    return found


def nonempty(value: str) -> str:
    """The argparse type of a path or name flag (``-i``, ``--out``, ``--wheel``, ...): an
    empty value (``-i "$UNSET"``) would silently mean "not given"."""
    if not value.strip():
        raise argparse.ArgumentTypeError("needs a value, got an empty string")
    return value


def subparser_for(parser: argparse.ArgumentParser,
                  words: Sequence[str]) -> argparse.ArgumentParser:
    """The innermost parser ``words`` reach (``inventory show`` -> show's parser)."""
    for word in words:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
                   None)
        if sub is None:
            break
        if word in sub.choices:
            parser = sub.choices[word]
    return parser
