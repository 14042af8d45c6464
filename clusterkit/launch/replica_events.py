"""What the launcher says about the agents' checkpoint replicas (issue 22).

The agents report each copy as a :class:`~clusterkit.node.protocol.Replica` event; the
launch runtime hands each one to :func:`replica_line` for the console and keeps them in
:class:`ReplicaLedger`, which says per checkpoint how many nodes' files have a complete
copy somewhere (``global_step40: replicated 7/7``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clusterkit.node.protocol import REPLICA_ALREADY_THERE, Replica


def replica_line(ev: Replica) -> str:
    """One console line for one finished copy."""
    if ev.state == "complete" and ev.detail == REPLICA_ALREADY_THERE:
        return (f"replica {ev.tag}: node index {ev.source}'s copy on {ev.target} is already "
                "there (its manifest names these files)")
    if ev.state == "complete":
        mb = ev.bytes / 1e6
        return (f"replica {ev.tag}: node index {ev.source}'s files copied to {ev.target} "
                f"({mb:.1f} MB in {ev.seconds:.1f} s, sha256 verified)")
    return f"replica {ev.tag}: copy of node index {ev.source}'s files to {ev.target} failed: {ev.detail}"


@dataclass
class ReplicaLedger:
    """Complete copies seen so far: tag -> source node index -> the nodes holding one."""

    copies: dict[str, dict[int, set[str]]] = field(default_factory=dict)

    def add(self, ev: Replica) -> None:
        if ev.state == "complete":
            self.copies.setdefault(ev.tag, {}).setdefault(ev.source, set()).add(ev.target)

    def replicated(self, tag: str) -> int:
        """How many nodes' files of ``tag`` have at least one complete copy."""
        return sum(1 for held in self.copies.get(tag, {}).values() if held)
