"""Entry point: builds the parser from the verb modules and owns every exit code.

Exit codes: 0 ok; 1 warnings under --strict (doctor); 2 bad input or failed checks;
70 internal error; 130 interrupted. A ClusterkitError is
printed as exactly one line; a traceback only appears with CLUSTERKIT_DEBUG=1.
Every mistake on the command line (unknown verb or flag, a bad value, a missing one)
is such an error too (cli/argparser.py): one line, exit 2, never the usage text. With
``--json`` on a verb that has it, the error is also one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib import import_module
from typing import cast

from clusterkit import __version__
from clusterkit.cli import safety
from clusterkit.cli.argparser import Parser, subparser_for, verbs_with
from clusterkit.errors import ClusterkitError, UsageError

# Verb -> the module whose add_parser(sub) builds it. Only the verb being run is
# imported and built: every verb module at start-up cost ~0.15 s of CPU per command
# (doctor's overhead at 7 nodes, and every CLI call of the test suite). `clusterkit
# --help` and words that are no verb build them all. tests/process/test_cli_safety.py checks
# this index against what the modules register.
VERBS: dict[str, str] = {
    "inventory": "clusterkit.cli.cmd_inventory",
    "doctor": "clusterkit.cli.cmd_doctor",
    "launch": "clusterkit.cli.cmd_launch",
    "status": "clusterkit.cli.cmd_status",
    "stop": "clusterkit.cli.cmd_stop",
    "render": "clusterkit.cli.cmd_render",
    "collect-ckpt": "clusterkit.cli.cmd_collect",
    "sbatch": "clusterkit.cli.cmd_sbatch",
    "plan": "clusterkit.cli.cmd_plan",
    "sync": "clusterkit.cli.cmd_sync",
    "nodes": "clusterkit.cli.cmd_nodes",
}
VERB_MODULES = tuple(dict.fromkeys(VERBS.values()))


def verb_word(argv: Sequence[str]) -> str | None:
    """The verb of a command line: its first word, unless help/version comes first."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
        if arg in ("-h", "--help", "--version"):
            return None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Every verb's parser; with ``argv``, only the parser of its verb (when it is one)."""
    parser = Parser(
        prog="clusterkit",
        description="From SSH-reachable GPU servers to a restartable DeepSpeed ZeRO run.",
    )
    parser.add_argument("--version", action="version", version=f"clusterkit {__version__}")
    # Every verb's parser is a Parser (argparse makes subparsers of the parent's class);
    # the verb modules are typed against plain ArgumentParser.
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               parser.add_subparsers(dest="verb", metavar="VERB", required=True))
    word = verb_word(argv) if argv is not None else None
    for name in (VERBS[word],) if word in VERBS else VERB_MODULES:
        import_module(name).add_parser(sub)
    safety.install(sub)  # DeepSpeed/torchrun spellings; each verb's own flags
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(words)
    args: argparse.Namespace | None = None
    try:
        args = parser.parse_args(words)
        func: Callable[[argparse.Namespace], int] = args.func
        safety.check_args(args)  # values and flags-after-the-script, before anything starts
        return func(args)
    except ClusterkitError as exc:
        if isinstance(exc, UsageError) and exc.unknown:
            exc.hint = _with_elsewhere(exc.hint, _elsewhere(exc.unknown, exc.prog))
        print(f"clusterkit: error: {exc.one_line()}", file=sys.stderr)
        if _wants_json(parser, words, args):
            print(json.dumps({"error": exc.one_line(), "key": exc.key, "hint": exc.hint,
                              "exit_code": exc.exit_code}))
        return exc.exit_code
    except KeyboardInterrupt:
        print("clusterkit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `clusterkit ... | head` closed the pipe: not an error worth a message.
        return 0
    except Exception as exc:
        if os.environ.get("CLUSTERKIT_DEBUG"):
            raise
        print(
            f"clusterkit: internal error: {type(exc).__name__}: {exc} "
            "(rerun with CLUSTERKIT_DEBUG=1 for the traceback and report it)",
            file=sys.stderr,
        )
        return 70


def _elsewhere(flag: str, prog: str) -> str | None:
    """``launch --submit``: say which commands have the flag (every verb is built for it)."""
    owners = [p for p in verbs_with(build_parser(), flag) if p != prog]
    if not owners:
        return None
    return f"{flag} is a flag of {' and '.join(f'`{p}`' for p in owners[:3])}"


def _with_elsewhere(mine: str | None, elsewhere: str | None) -> str | None:
    """The verb's own close flag first (what the user most likely meant), then the other
    verbs that have the flag typed: ``did you mean --to? (--dest is a flag of ...)``."""
    if mine and elsewhere:
        return f"{mine} ({elsewhere})"
    return mine or elsewhere


def _wants_json(parser: argparse.ArgumentParser, words: Sequence[str],
                args: argparse.Namespace | None) -> bool:
    """``--json`` was asked for on a verb that has it (parsed, or typed before a parse error)."""
    if args is not None:
        return getattr(args, "json", False) is True
    typed = words[:words.index("--")] if "--" in words else words
    if "--json" not in typed:
        return False
    verb = subparser_for(parser, [w for w in typed if not w.startswith("-")])
    return any("--json" in a.option_strings for a in verb._actions)


if __name__ == "__main__":
    raise SystemExit(main())
