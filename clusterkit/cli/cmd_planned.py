"""Verbs that are designed but not built yet: they say so plainly and exit 3."""

from __future__ import annotations

import argparse

from clusterkit.errors import NotBuiltYet

# verb -> (help, issue that builds it)
PLANNED: dict[str, tuple[str, str]] = {}


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for verb, (help_text, issue) in PLANNED.items():
        p = sub.add_parser(verb, help=f"{help_text} [not built yet]", add_help=True)
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=_not_built, verb=verb, issue=issue)


def _not_built(args: argparse.Namespace) -> int:
    raise NotBuiltYet(
        f"'clusterkit {args.verb}' is not built yet",
        hint=f"it is planned in {args.issue}; see docs/ for what exists today",
        exit_code=3,
    )
