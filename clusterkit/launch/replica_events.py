"""What the launcher says about the agents' checkpoint replicas (issues 22, 32).

The agents report each copy as a :class:`~clusterkit.node.protocol.Replica` event; the
launch runtime hands each one to :meth:`ReplicaLedger.report`, which keeps them (per
checkpoint, how many nodes' files have a complete copy somewhere: ``step40 7/7``) and
says what the console shows of it. One line per copy was 7 lines at every save of a
7-node job, for news that is only interesting when it is bad: a save's copies are one
line, once every node's files have one; a failed copy is its own line at once. Every
copy stays in its node's log (``launcher.log``: the agent's ``replica: ...`` lines).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clusterkit.node.contract import node_log_name
from clusterkit.node.protocol import REPLICA_ALREADY_THERE, Replica


def replica_line(ev: Replica) -> str:
    """One console line for one finished copy (the node log's detail, in words)."""
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
    sent: dict[str, int] = field(default_factory=dict)  # tag -> bytes copied for it
    announced: set[str] = field(default_factory=set)  # tags whose one line was shown

    def add(self, ev: Replica) -> None:
        if ev.state == "complete":
            self.copies.setdefault(ev.tag, {}).setdefault(ev.source, set()).add(ev.target)
            self.sent[ev.tag] = self.sent.get(ev.tag, 0) + ev.bytes

    def replicated(self, tag: str) -> int:
        """How many nodes' files of ``tag`` have at least one complete copy."""
        return sum(1 for held in self.copies.get(tag, {}).values() if held)

    def report(self, ev: Replica, nodes: int, rank_logs: str = "") -> list[str]:
        """Keep ``ev``; the console's lines for it: a failed copy at once, a save's
        copies in one line when the last of its ``nodes`` nodes' files has a copy, else
        none. ``rank_logs``: the agents' log files (``<job dir>/nodes/<node>/rank<N>.log``,
        as the collateral line names them); the copies are in the launcher's beside them."""
        self.add(ev)
        if ev.state != "complete":
            return [replica_line(ev)]
        if ev.tag in self.announced or self.replicated(ev.tag) < nodes:
            return []
        self.announced.add(ev.tag)
        logs = rank_logs.rpartition("/")[0] + "/" + node_log_name(None) if rank_logs else ""
        kept = f"; each copy in {logs}" if logs else ""
        return [f"replicas {ev.tag}: {nodes}/{nodes} nodes' files copied to another node "
                f"({self.sent[ev.tag] / 1e6:.1f} MB, sha256 verified{kept})"]
