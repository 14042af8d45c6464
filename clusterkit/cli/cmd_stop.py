"""clusterkit stop JOB [--grace S] (docs/launch.md): ``clusterkit.api.stop``, printed."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from clusterkit.cli.jobflags import job_id_type
from clusterkit.hostrange import folded_lines
from clusterkit.node.protocol import DEFAULT_GRACE_S
from clusterkit.units import duration_type

if TYPE_CHECKING:
    from clusterkit.jobs.stop import StopResult


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    st = sub.add_parser("stop", help="stop a job on every node (only that job's processes)")
    st.add_argument("job", metavar="JOB", type=job_id_type)
    st.add_argument("--grace", type=duration_type("--grace"), default=DEFAULT_GRACE_S,
                    metavar="S")
    st.set_defaults(func=cmd_stop)


def cmd_stop(args: argparse.Namespace) -> int:
    from clusterkit import api
    from clusterkit.jobs.stop import StopIncomplete

    try:
        result = api.stop(args.job, grace_s=args.grace)
    except StopIncomplete as exc:  # each node's line, then the error's
        if exc.result is not None:
            _print_nodes(exc.result)
        raise
    _print_nodes(result)
    print(f"job {result.job_id}: no process left on {len(result.nodes)} node(s)")
    return 0


def _print_nodes(result: StopResult) -> None:
    rows: list[tuple[str, str]] = []  # nodes that fared the same share one line
    for n in result.nodes:
        if n.reply is None:
            rows.append((n.node, f"could not stop: {n.error}"))
        else:
            rows.append((n.node, f"signalled {n.reply.signalled}, killed {n.reply.killed}, "
                                 f"left {n.reply.left}"))
    for line in folded_lines(rows, [n.node for n in result.nodes]):
        print(f"  {line}")
