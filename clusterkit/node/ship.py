"""The one way node programs reach a node: a tiny bootstrap, the sources on stdin.

A node program runs as::

    argv:  <python> [-S] -u -c BOOTSTRAP <program> <args...>
    stdin: b"clusterkit-node 1 <module>:<nbytes> ...\\n" <sources> [<payload>...]

The bootstrap (standard library, Python >= 3.8) reads the header line and
exactly the announced bytes of each module, registers each as
``clusterkit.node.<module>`` under an empty ``clusterkit`` package (so the same
sources import each other here and there, and nothing else of clusterkit is
reachable on the node), then calls ``<program>.main(args)``. What follows the
sources on stdin is the program's own: the agent reads its spec line and then
its control words there. No file is written on the node and clusterkit need not
be installed there; the sources always match the launcher's version.

This module is the launcher's half and is never shipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

from clusterkit.node import protocol
from clusterkit.node.contract import BOOTSTRAP, BUNDLE_MAGIC, encode_bundle

MAGIC = BUNDLE_MAGIC  # the header every node program is started with (node/contract.py)

@dataclass(frozen=True)
class Program:
    """A node program: the node modules it imports (dependencies first), and whether it
    needs the interpreter's full start-up (``site``: .pth hooks, sitecustomize)."""

    modules: tuple[str, ...]
    site: bool = False


# Programs that only read files and metadata run with ``python -S`` (sitepaths.add()
# restores the package directories where they matter); the agent runs the user's
# ranks and `install` runs pip: they start as the user's own Python would.
PROGRAMS: dict[str, Program] = {
    # The agent split by concern (docs/architecture.md, "Node agent modules").
    "agent": Program(("contract", "protocol", "sitepaths", "parity", "sync_store", "hashing", "envfacts",
                      "gatefacts", "zygote", "agent_files", "agent_state",
                      "agent_procs", "buildowner", "jitops", "agent_hangs", "agent_env",
                      "agent_output",
                      "agent_forkserver", "listing", "replica_rules", "replica_done",
                      "replica_area", "priority", "replica",
                      "replica_service", "replica_proc", "agent"), site=True),
    "probe": Program(("contract", "sitepaths", "parity", "sync_store", "hashing", "envfacts", "buildowner",
                      "jitops",
                      "gatefacts", "probe")),
    "bw_worker": Program(("bw_worker",), site=True),  # imports torch
    "listing": Program(("contract", "listing")),
    "hashing": Program(("hashing",)),
    "ckstream": Program(("contract", "listing", "hashing", "ckstream")),
    "gatefacts": Program(("contract", "sitepaths", "parity", "sync_store", "hashing", "envfacts",
                          "gatefacts")),
    # clusterkit sync: one node of the chain
    "sync_chain": Program(("hashing", "sync_store", "sync_wire", "sync_chain")),
    # nodes env: facts, verify, record (provision/envcopy.py)
    "envfacts": Program(("contract", "sync_store", "hashing", "envfacts")),
    "jitops": Program(("buildowner", "jitops"), site=True),  # nodes build-ops: imports deepspeed to build
    # sbatch.sh's JIT ops step, one task per node (docs/sbatch.md, "JIT ops")
    "jitbatch": Program(("buildowner", "jitops", "jitbatch"), site=True),
    "install": Program(("contract", "sitepaths", "parity", "sync_store", "hashing", "envfacts", "gatefacts",
                         "install"), site=True),
    # sbatch.sh's watchdog (docs/sbatch.md); jitops: which op builds run at start-up
    "slurmwatch": Program(("contract", "hangrule", "buildowner", "jitops", "slurmwatch")),
    # sbatch.sh's end of a run: exit status, requeue, its lines (docs/sbatch.md, "How the
    # batch job decides"); a heredoc of the script, as the watchdog's.
    "slurmend": Program(("slurmend",)),
    # sbatch.sh's checkpoint replicas and a run on other nodes (docs/sbatch.md): launch's
    # replication service, started by the batch script.
    "slurmreplica": Program(("contract", "hashing", "protocol", "agent_files", "agent_procs", "listing",
                             "replica_rules", "replica_done", "replica_area", "priority", "replica",
                             "replica_service", "slurmrestore", "slurmreplica")),
}



@dataclass(frozen=True)
class NodeCommand:
    """What to run on a node (``argv``) and what to send first on its stdin."""

    argv: list[str]
    stdin: bytes


@cache
def source(module: str) -> bytes:
    """One node module's source, read from this installed clusterkit (never the cwd)."""
    return resources.files("clusterkit.node").joinpath(f"{module}.py").read_bytes()


@cache
def bundle(program: str) -> bytes:
    """The header line and the sources of ``program`` and its node imports."""
    return encode_bundle([(m, source(m)) for m in PROGRAMS[program].modules])


def node_command(python: str, program: str, args: Sequence[str] = (), *,
                 payload: bytes = b"") -> NodeCommand:
    """``python`` runs ``program`` with ``args``; ``payload`` follows the sources on stdin."""
    if program not in PROGRAMS:
        raise KeyError(f"unknown node program {program!r}")
    flags = ["-u"] if PROGRAMS[program].site else ["-S", "-u"]
    return NodeCommand(argv=[python, *flags, "-c", BOOTSTRAP, program, *args],
                       stdin=bundle(program) + payload)


def agent_command(python: str, args: Sequence[str] = (),
                  spec: protocol.AgentSpec | None = None) -> NodeCommand:
    """The agent; with ``spec``, its spec line follows the sources (control words later)."""
    payload = (spec.to_json() + "\n").encode() if spec is not None else b""
    return node_command(python, "agent", args, payload=payload)
