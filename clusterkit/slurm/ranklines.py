"""Who wrote a line of a clusterkit batch job's output (pure; docs/sbatch.md, "Watching").

What each variant of ``sbatch.sh`` writes (real captures: tests/fixtures/sbatch_watch):

* torchrun, accelerate (one launcher task per node): the script exports
  ``SLURM_LABELIO=1`` (srun's ``--label``: ``"1: "``, the task = the node's place in
  the allocation) and ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'``
  (torchrun's tee prefix with the global rank), so a rank's line reads
  ``1: [rank3]:text``; the launcher's own lines read ``1: text``. torch < 2.2 ignores
  the template and writes the node-local rank, ``1: [default1]:text``.
* deepspeed (one Slurm task per rank): each rank writes its own file,
  ``<job name>-<job id>-rank<t>.out``, with unlabelled lines; the rank is in the name.
* The batch script's own lines carry no label; one of them names the job's shape:
  ``clusterkit: job J slurm=N ... variant=V world_size=W ranks_per_node=R ...``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_SHAPE = re.compile(r"^clusterkit: job \S+ slurm=\S+ .* variant=(\S+)"
                    r"(?: world_size=(\d+) ranks_per_node=(\d+))?")
_TASK = re.compile(r"^ *(\d+): (.*)$", re.DOTALL)  # srun --label pads the task number
_GLOBAL = re.compile(r"^\[rank(\d+)\]:(.*)$", re.DOTALL)
_LOCAL = re.compile(r"^\[[A-Za-z_]*?(\d+)\]:(.*)$", re.DOTALL)  # torchrun's "[default1]:"
_RANK_FILE = re.compile(r"-rank(\d+)\.out$")


@dataclass(frozen=True)
class JobShape:
    """The batch script's own account of the job (its ``variant=`` line)."""

    variant: str
    world_size: int | None = None
    ranks_per_node: int | None = None


@dataclass(frozen=True)
class RankLine:
    """One output line: ``node`` None = the batch script's own line; ``rank`` None = a
    node's launcher (torchrun, accelerate) speaking for itself."""

    node: str | None
    rank: int | None
    text: str


def parse_shape(line: str) -> JobShape | None:
    m = _SHAPE.match(line)
    if not m:
        return None
    world, per_node = m.group(2), m.group(3)
    return JobShape(m.group(1), int(world) if world else None, int(per_node) if per_node else None)


# srun --label forwards a task's output in messages of at most this many bytes and
# labels each one: a longer line arrives cut into labelled pieces (seen on the Slurm
# test bed: a 3000-byte line -> 1024 + 1024 + 952, each "0: ..."). Known gap: a line
# that starts inside a message is cut at that message's end, so its first piece can be
# shorter (714 bytes seen); this joiner only rejoins full-size pieces.
SRUN_PIECE_BYTES = 1024


class LabelJoiner:
    """Rejoins the lines ``srun --label`` cut: a labelled piece of exactly
    :data:`SRUN_PIECE_BYTES` continues on that task's next labelled line."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[str, str]] = {}  # task -> (label as written, text so far)

    def feed(self, raw: str) -> list[str]:
        """One line as read (with its newline) -> the whole lines it completes."""
        m = _TASK.match(raw.rstrip("\r\n"))
        if not m:
            return [raw]
        label, piece = raw[:m.start(2)], m.group(2)
        _, head = self._open.pop(m.group(1), (label, ""))
        if len(piece.encode()) == SRUN_PIECE_BYTES:
            self._open[m.group(1)] = (label, head + piece)
            return []
        return [f"{label}{head}{piece}\n"]

    def flush(self) -> list[str]:
        """At the end: whatever is still open (a line of exactly 1024 bytes, or a cut-off one)."""
        out = [f"{label}{text}\n" for label, text in self._open.values()]
        self._open.clear()
        return out


def _node(nodes: Sequence[str], index: int) -> str:
    # Before scontrol names the nodes (or past its list): the place still tells them apart.
    return nodes[index] if 0 <= index < len(nodes) else f"node#{index}"


def parse_labelled(line: str, nodes: Sequence[str], shape: JobShape | None) -> RankLine:
    """A line of the job's StdOut/StdErr: ``1: [rank3]:text``, ``1: text`` or ``text``."""
    m = _TASK.match(line)
    if not m:
        return RankLine(None, None, line)
    task, rest = int(m.group(1)), m.group(2)
    node = _node(nodes, task)
    g = _GLOBAL.match(rest)
    if g:
        # torchrun's tee (torch.distributed.elastic tail_logfile) reads the rank's log with
        # readline(): a line caught half-written is printed in two parts, the second with
        # the header again ("[rank0]:part1[rank0]:part2"); drop the repeated header.
        return RankLine(node, int(g.group(1)), g.group(2).replace(f"[rank{g.group(1)}]:", ""))
    local = _LOCAL.match(rest)
    per_node = shape.ranks_per_node if shape else None
    if local and per_node:
        # Old torch: the node's place x its ranks + the local rank (exact with the static
        # rendezvous; with c10d torchrun may have ordered the nodes differently).
        return RankLine(node, task * per_node + int(local.group(1)), local.group(2))
    return RankLine(node, None, rest)


def rank_of_file(path: str) -> int | None:
    """``ck-j-12-rank3.out`` -> 3: a one-task-per-rank step's file (srun ``%t`` = rank)."""
    m = _RANK_FILE.search(path)
    return int(m.group(1)) if m else None


def node_of_rank(rank: int, nodes: Sequence[str], shape: JobShape | None) -> str:
    """Slurm's default block distribution: ranks 0..R-1 on the first node, and so on."""
    per_node = shape.ranks_per_node if shape and shape.ranks_per_node else None
    if per_node is None:
        return nodes[0] if len(nodes) == 1 else "?"
    return _node(nodes, rank // per_node)
