"""Doctor's shared-storage phase (issue 32): two short commands per node, after the probe.

1. every node with a ``checkpoint.local_dir`` writes its token there and lists the tokens
   of this round it sees (``facts.gatefacts`` with one ``unshared`` need, node/facts/gatefacts.py);
2. once every node has looked, every node removes its token (``facts.gatefacts --drop``).

Two rounds because a node must not remove its token before the others have looked (the
launch's gate does the same, the agents dropping theirs after GO). The verdict is
:func:`clusterkit.checks.rules_storage.check_shared_dirs`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from clusterkit.checks.facts import NodeFacts
from clusterkit.node.facts.gatefacts import need_unshared
from clusterkit.node.protocol import ProtocolError, answer_of
from clusterkit.remote.base import SSHTarget, Transport
from clusterkit.ship import node_command

TOKEN_TIMEOUT_S = 20.0


def shared_dir_tokens(nodes: Mapping[str, tuple[SSHTarget, str]], local_dirs: Mapping[str, str],
                      facts: Mapping[str, NodeFacts], transport: Transport,
                      storage: str | None = None) -> dict[str, dict[str, object]]:
    """host -> its ``unshared`` fact. ``nodes``: host -> (SSH target, python). Only
    reachable hosts with a local_dir take part; fewer than two: nothing to compare;
    ``storage`` shared (doctor --storage shared): nothing asked, the rule is skipped."""
    hosts = [h for h in nodes if h in local_dirs and h in facts and facts[h].ok]
    if len(hosts) < 2 or storage == "shared":
        return {}
    run = f"doctor-{os.getpid()}-{time.time_ns()}"
    needs = {h: [need_unshared(local_dirs[h], run, h)] for h in hosts}
    out: dict[str, dict[str, object]] = {}
    try:
        found = _run(transport, nodes, {h: list(n) for h, n in needs.items()})
        for host, stdout in found.items():
            try:
                seen = answer_of(stdout).get("unshared")
            except ProtocolError:
                continue
            if isinstance(seen, dict):
                out[host] = seen
    finally:
        _run(transport, nodes, {h: ["--drop", *n] for h, n in needs.items()})
    return out


def _run(transport: Transport, nodes: Mapping[str, tuple[SSHTarget, str]],
         args: Mapping[str, list[str]]) -> dict[str, str]:
    """Each host's stdout (hosts that failed are left out: no verdict for them)."""
    cmds = {h: node_command(nodes[h][1], "facts.gatefacts", a) for h, a in args.items()}
    targets = [nodes[h][0] for h in cmds]
    results = transport.run_all(targets, {h: c.argv for h, c in cmds.items()},
                                timeout=TOKEN_TIMEOUT_S, stdin=next(iter(cmds.values())).stdin)
    return {r.host: r.result.stdout for r in results
            if r.error is None and r.result is not None and r.result.exit_code == 0}
