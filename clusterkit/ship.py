"""The launcher's half of node programs: which modules each ships, and its command line.

A node program is a module under :mod:`clusterkit.node` with ``main(argv)``; its name
is that module's dotted name below ``clusterkit.node`` (``facts.probe``, ``agent.core``),
the one spelling in ``PROGRAMS``, on the command line and in the batch script. It runs
as::

    argv:  <python> [-S] -u -c BOOTSTRAP <program> <args...>
    stdin: b"clusterkit-node 2 <module>:<nbytes> ...\\n" <sources> [<payload>...]

The bootstrap (``node/contract.py``; standard library, Python >= 3.8) reads the header
line and exactly the announced bytes of each module, registers each as
``clusterkit.node.<module>`` (``clusterkit.node.agent.core``) under empty ``clusterkit``,
``clusterkit.node`` and subpackage modules (so the same sources import each other here
and there, and nothing else of clusterkit is reachable on the node), then calls
``<program>.main(args)``. What follows the sources on stdin is the program's own: the
agent reads its spec line and then its control words there. No file is written on the
node and clusterkit need not be installed there; the sources always match the
launcher's version.

Launcher code only: nothing under ``clusterkit/node/`` imports it, and it is never
shipped (one layer above ``node``, docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

from clusterkit.node import protocol
from clusterkit.node.contract import BOOTSTRAP, encode_bundle
from clusterkit.node.replicas import proc as replicas_proc


@dataclass(frozen=True)
class Program:
    """A node program: the node modules it imports (dependencies first, the program's
    own module last), and whether it needs the interpreter's full start-up (``site``:
    .pth hooks, sitecustomize)."""

    modules: tuple[str, ...]
    site: bool = False


# The facts every gate reads (the launch gate's program and what imports it).
_GATE = ("contract", "files", "facts.sitepaths", "facts.parity", "hashing", "facts.envfacts",
         "facts.gatefacts")
# The agent's checkpoint replicas (its copy process; a Slurm job's replica steps): the
# copy process's own list (it hands its sources on to its child), less the process itself.
_REPLICAS = tuple(m for m in replicas_proc.MODULES if m != "replicas.proc")

# Programs that only read files and metadata run with ``python -S`` (sitepaths.add()
# restores the package directories where they matter); the agent runs the user's
# ranks and `provision.install` runs pip: they start as the user's own Python would.
PROGRAMS: dict[str, Program] = {
    # The agent split by concern (docs/architecture.md, "The node agent's modules").
    "agent.core": Program((*_GATE, "protocol", "agent.zygote", "agent.files", "agent.state", "agent.procs",
                           "provision.buildowner", "provision.jitops", "agent.hangs", "agent.env",
                           "agent.output", "agent.forkserver", "ckpt.listing", "ckpt.ready", "replicas.rules",
                           "replicas.done", "replicas.area", "replicas.priority", "replicas.wire",
                           "replicas.service", "replicas.proc", "agent.core"), site=True),
    "facts.probe": Program(("contract", "files", "facts.sitepaths", "facts.parity", "hashing",
                            "facts.envfacts", "provision.buildowner", "provision.jitops",
                            "facts.gatefacts", "facts.probe")),
    "facts.bw_worker": Program(("facts.bw_worker",), site=True),  # imports torch
    "ckpt.listing": Program(("contract", "ckpt.listing")),
    "hashing": Program(("hashing",)),
    "ckpt.stream": Program(("contract", "ckpt.listing", "hashing", "ckpt.stream")),
    "facts.gatefacts": Program(_GATE),
    # clusterkit sync: one node of the chain
    "sync.chain": Program(("contract", "files", "hashing", "sync.store", "sync.wire", "sync.chain")),
    # nodes env: facts, verify, record (provision/envcopy.py)
    "facts.envfacts": Program(("contract", "files", "hashing", "facts.envfacts")),
    # nodes build-ops: imports deepspeed to build
    "provision.jitops": Program(("files", "provision.buildowner", "provision.jitops"), site=True),
    # sbatch.sh's JIT ops step, one task per node (docs/sbatch.md, "JIT ops")
    "provision.jitbatch": Program(("files", "provision.buildowner", "provision.jitops",
                                   "provision.jitbatch"),
                                  site=True),
    "provision.install": Program((*_GATE, "provision.install"), site=True),
    # sbatch.sh's watchdog (docs/sbatch.md); jitops: which op builds run at start-up
    "slurm.watch": Program(("contract", "files", "hangrule", "provision.buildowner", "provision.jitops",
                            "slurm.watch")),
    # sbatch.sh's end of a run: exit status, requeue, its lines (docs/sbatch.md, "How the
    # batch job decides"); a heredoc of the script, as the watchdog's.
    "slurm.end": Program(("slurm.end",)),
    # sbatch.sh's checkpoint replicas and a run on other nodes (docs/sbatch.md): launch's
    # replication service, started by the batch script.
    "slurm.replica": Program((*_REPLICAS, "ckpt.ready", "slurm.restore", "slurm.replica")),
}



@dataclass(frozen=True)
class NodeCommand:
    """What to run on a node (``argv``) and what to send first on its stdin."""

    argv: list[str]
    stdin: bytes


@cache
def source(module: str) -> bytes:
    """One node module's source, read from this installed clusterkit (never the cwd)."""
    *package, name = module.split(".")
    return resources.files("clusterkit.node").joinpath(*package, f"{name}.py").read_bytes()


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
    return node_command(python, "agent.core", args, payload=payload)
