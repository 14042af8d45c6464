"""Entry point: builds the parser from the verb modules and owns every exit code.

Exit codes: 0 ok; 1 warnings under --strict (doctor); 2 bad input or failed checks;
3 verb not built yet; 70 internal error; 130 interrupted. A ClusterkitError is
printed as exactly one line; a traceback only appears with CLUSTERKIT_DEBUG=1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib import import_module

from clusterkit import __version__
from clusterkit.cli import safety
from clusterkit.errors import ClusterkitError

# Modules with add_parser(sub); imported lazily so `clusterkit --help` stays fast.
VERB_MODULES = (
    "clusterkit.cli.cmd_inventory",
    "clusterkit.cli.cmd_doctor",
    "clusterkit.cli.cmd_launch",
    "clusterkit.cli.cmd_render",
    "clusterkit.cli.cmd_collect",
    "clusterkit.cli.cmd_sbatch",
    "clusterkit.cli.cmd_plan",
    "clusterkit.cli.cmd_sync",
    "clusterkit.cli.cmd_nodes",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clusterkit",
        description="From SSH-reachable GPU servers to a restartable DeepSpeed ZeRO run.",
    )
    parser.add_argument("--version", action="version", version=f"clusterkit {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in VERB_MODULES:
        import_module(name).add_parser(sub)
    from clusterkit.cli import cmd_planned

    cmd_planned.add_parsers(sub)
    safety.install(sub)  # DeepSpeed/torchrun spellings; each verb's own flags
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        safety.check_args(args)  # values and flags-after-the-script, before anything starts
        return func(args)
    except ClusterkitError as exc:
        print(f"clusterkit: error: {exc.one_line()}", file=sys.stderr)
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


if __name__ == "__main__":
    raise SystemExit(main())
