"""The quick pre-launch gate: every node reachable, same interpreter, same versions.

Deliberately smaller than ``clusterkit doctor``: the doctor's probe spends ~2 s
per node on names, interfaces and GPUs, which would double the start-up time of
every launch. Here one ``run_all`` reads the interpreter path, the Python version
and the versions of the packages every rank imports (package metadata only, no
``import torch``) — the mismatches behind DeepSpeed#3965 and friends — and what
the job needs there (``node_needs``: the script, the job and checkpoint dirs
writable, the master address and port). The facts
come from the node program :mod:`clusterkit.node.facts.gatefacts` (the same one the
agent reports when the gate is folded into it); clusterkit itself need not be
installed on the nodes, only the bundled workload needs it (``need``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from clusterkit.errors import LaunchError
from clusterkit.hostrange import fold, folded_lines
from clusterkit.node.contract import StorageKind
from clusterkit.node.facts.envfacts import env_problems
from clusterkit.node.facts.gatefacts import (
    NEED_UNSHARED,
    PACKAGES,
    SHARED_FIX,
    need_dir,
    need_port,
    need_resolve,
    need_unshared,
    shared_line,
    shared_verdict,
)
from clusterkit.node.facts.parity import holders, majority
from clusterkit.node.protocol import ProtocolError, answer_of
from clusterkit.provision.jitbuild import OpsNode, ready_ops
from clusterkit.remote.base import SSHTarget, Transport, target_for
from clusterkit.remote.dispatch import transport_for
from clusterkit.render.jobops import job_ops
from clusterkit.ship import node_command
from clusterkit.spec.job import JobPlan, NodePlan

GATE_TIMEOUT_S = 20.0
# The interpreter path, the Python version and the MUST packages of node/facts/parity.py
# (what gatefacts reads): doctor FAILs the same versions.
PARITY_KEYS = ("python", "version", *PACKAGES)


@dataclass(frozen=True)
class GateNode:
    node: str
    python: str
    target: SSHTarget
    needs: tuple[str, ...] = ()  # what the job needs there (node_needs)


@dataclass(frozen=True)
class GateResult:
    facts: dict[str, dict[str, object]]  # node -> facts
    problems: dict[str, str]  # node -> why it cannot run this job

    @property
    def ok(self) -> bool:
        return not self.problems


def needed_files(plan: JobPlan, node: NodePlan) -> tuple[str, ...]:
    """Files the gate checks on ``node``: the user's script as its ranks open it (their
    cwd is the workdir); none for a module (``-m``), which only its import can find."""
    program = plan.programs[node.node_rank]
    if not program or program[0] == "-m":
        return ()
    return (program[0] if program[0].startswith("/") else f"{node.workdir}/{program[0]}",)


def node_needs(plan: JobPlan, node: NodePlan, *, synced: bool = False) -> tuple[str, ...]:
    """Everything the gate checks on ``node`` before a rank starts (node/facts/gatefacts.py):
    the user's script (unless ``synced``: a dry run's ``--sync`` brings it), the job dir,
    the checkpoint dir and the NVMe offload dir (if any) created and written as the
    agent and the ranks will, the master address resolved, and on the master's node its
    port free. The real launch (the agents), ``--drop-failed-nodes`` and the dry run
    check the same list."""
    files = () if synced else needed_files(plan, node)
    master = (need_port(plan.master_port),) if node.node_rank == 0 else ()
    z = plan.zero
    nvme = (need_dir(z.nvme_path, NVME_DIR),) if z.nvme_path and "nvme" in (
        z.offload_optimizer, z.offload_param) else ()
    # node-local on several nodes: the checkpoint dir must be each node's own (issue 32)
    own = (need_unshared(node.ckpt_dir, plan.job_id, node.name),) if (
        plan.storage == StorageKind.NODE_LOCAL and len(plan.nodes) > 1) else ()
    return (*files, need_dir(node.job_dir, "job dir"), need_dir(node.ckpt_dir), *nvme,
            need_resolve(plan.master_addr), *master, *own)


def check_here(plan: JobPlan, sync: str | None, *, gate: bool = True,
               cwd: str | None = None) -> bool:
    """The checks a launch makes on this machine before anything starts; the dry run
    makes the same ones (issue 25: it printed a plan for a missing script, a directory
    as the script and a missing --sync DIR). ``gate``: False with --skip-checks, which
    leaves only what the launch cannot run without (the --sync DIR itself).

    Returns whether ``--sync`` brings the script to the nodes (a dry run's node gate
    then leaves it out: nothing has been copied yet). Raises :class:`LaunchError`."""
    cwd = cwd or os.getcwd()
    here = script_path_here(plan, cwd)
    if sync is not None and not os.path.isdir(sync):
        what = "is not a directory" if os.path.exists(sync) else "does not exist"
        raise LaunchError(f"{sync} {what}", key="--sync", hint="pass the directory to copy to "
                          "every node's workdir (--sync . for the current one)")
    script = plan.options.script
    synced = bool(sync and here and os.path.isfile(here)
                  and _inside(here, os.path.join(cwd, sync)))
    if not gate or here is None:
        return synced
    if os.path.isdir(here):
        raise LaunchError(f"{script} is a directory, not a Python file", key="SCRIPT",
                          hint="give the script's path, e.g. ./train.py (or -m PACKAGE for a "
                               "package with __main__.py)")
    for node in plan.nodes:  # virtual nodes on this machine: their files are ours
        if node.host.transport != "local" or synced:
            continue
        for path in needed_files(plan, node):
            if not os.path.isfile(path):
                raise LaunchError(f"{script}: no such file ({path})", key="SCRIPT",
                                  hint="check the path (it is relative to the current "
                                       "directory)")
    return synced


def _inside(path: str, directory: str) -> bool:
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(directory))
    return rel != ".." and not rel.startswith(".." + os.sep)


def gate_nodes(plan: JobPlan, *, synced: bool = False) -> list[GateNode]:
    return [GateNode(n.name, n.python, target_for(n.host), node_needs(plan, n, synced=synced))
            for n in plan.nodes]


def run_gate(transport: Transport, nodes: Sequence[GateNode], *, need: Sequence[str] = (),
             same_python: bool = True, script_here: bool = True) -> GateResult:
    """Probe every node at once; ``need``: packages that must be installed everywhere;
    ``same_python``: the backend's (``launchers.base.Backend.same_python``);
    ``script_here``: :func:`script_is_here`."""
    cmds = {n.node: node_command(n.python, "facts.gatefacts", n.needs) for n in nodes}
    results = transport.run_all([n.target for n in nodes], {k: c.argv for k, c in cmds.items()},
                                timeout=GATE_TIMEOUT_S,
                                stdin=next(iter(cmds.values())).stdin if cmds else None)
    facts: dict[str, dict[str, object]] = {}
    problems: dict[str, str] = {}
    for r in results:
        if r.error is not None:
            problems[r.host] = r.reason() or ""  # without the host's name: reports fold
            continue
        assert r.result is not None
        if r.result.exit_code != 0:
            tail = (r.result.stderr or r.result.stdout).strip().splitlines()[-1:] or ["no output"]
            problems[r.host] = f"interpreter check failed (exit {r.result.exit_code}): {tail[0]}"
            continue
        try:
            facts[r.host] = answer_of(r.result.stdout)
        except ProtocolError:
            problems[r.host] = f"unexpected output: {r.result.stdout.strip()[:120]!r}"
            continue
    drop_tokens(transport, nodes)
    return judge(facts, problems, [n.node for n in nodes], need, same_python=same_python,
                 script_here=script_here)


def drop_tokens(transport: Transport, nodes: Sequence[GateNode]) -> None:
    """Every node has looked for the others' tokens: remove them (node/facts/gatefacts.py).
    Best effort: a token left behind is removed by a later round after an hour."""
    cmds = {n.node: node_command(n.python, "facts.gatefacts", ("--drop", *tokens))
            for n in nodes if (tokens := [x for x in n.needs if x.startswith(NEED_UNSHARED)])}
    if cmds:
        transport.run_all([n.target for n in nodes if n.node in cmds],
                          {k: c.argv for k, c in cmds.items()}, timeout=GATE_TIMEOUT_S,
                          stdin=next(iter(cmds.values())).stdin)


def judge(facts: dict[str, dict[str, object]], problems: dict[str, str], order: Sequence[str],
          need: Sequence[str] = (), *, same_python: bool = True,
          script_here: bool = True) -> GateResult:
    """Per-node requirements and parity with the majority (``problems``: already known);
    the interpreter path counts only where the launcher needs one path everywhere
    (``same_python``), as in doctor's ``check_interpreter``."""
    problems = dict(problems)
    # A script some node has is not "nowhere", even when the launching host lacks it (a
    # script put on one node's own disk): the others lack a copy.
    somewhere = script_here or any(f.get("missing") == [] for f in facts.values())
    for node, f in facts.items():
        for pkg in need:
            if not f.get(pkg):
                fix = " (`clusterkit nodes install`)" if pkg == "clusterkit" else ""
                problems.setdefault(node, f"{pkg} is not installed for {f.get('python')}{fix}")
        missing = f.get("missing")
        if isinstance(missing, list) and missing:
            # Seen as a user: without this, every rank died of Python's "can't open file".
            problems.setdefault(node, missing_problem([str(m) for m in missing], somewhere))
        for why in _need_problems(f):
            problems.setdefault(node, why)
    for node, why in shared_dirs(facts, order).items():
        problems.setdefault(node, why)
    for node, why in env_problems(facts).items():  # `nodes env`'s digest, recorded
        problems.setdefault(node, why)
    keys = PARITY_KEYS if same_python else tuple(k for k in PARITY_KEYS if k != "python")
    problems.update(_parity(facts, order, keys))
    return GateResult(facts=facts, problems=problems)


def script_is_here(plan: JobPlan, cwd: str | None = None) -> bool:
    """Whether the user's script exists on the launching host, where the launch is typed:
    a relative path from the current directory (the nodes take it from their workdir,
    which may be another directory: the node's path says nothing about this host)."""
    here = script_path_here(plan, cwd)
    return here is None or os.path.isfile(here)


def script_path_here(plan: JobPlan, cwd: str | None = None) -> str | None:
    """The user's script as the launching host sees it (None: a module, no script)."""
    script = plan.options.script
    return os.path.join(cwd or os.getcwd(), script) if script else None


def missing_problem(paths: Sequence[str], script_here: bool = True) -> str:
    """A node lacks files the ranks open (the user's script). When the launching host has
    no such script either, it exists nowhere (a typo in the path: --sync cannot help);
    otherwise it was never copied to the node."""
    if not script_here:
        return (f"{', '.join(paths)} does not exist, on this node nor here on the launching "
                "host: check the script's path (a relative one is taken from the workdir)")
    return (f"{', '.join(paths)} is not on this node (--sync DIR copies DIR to the same path "
            "under the workdir, relative to your current directory: --sync . for all of it; "
            "or use a shared workdir)")


def _need_problems(f: dict[str, object]) -> list[str]:
    """The directory, master port and address checks of one node's facts (facts without
    these keys, as from a hand-run probe: nothing to say)."""
    out: list[str] = []
    for key, say in (("unwritable", _dir_problem), ("port", _port_problem),
                     ("resolve", _resolve_problem)):
        found = f.get(key)
        if isinstance(found, dict):
            out += [say(str(value), str(why)) for value, why in found.items()]
    return out


def shared_dirs(facts: dict[str, dict[str, object]], order: Sequence[str]) -> dict[str, str]:
    """node -> why its node-local checkpoint dir is not its own (gatefacts.token_seen):
    one text per group of nodes sharing a dir, so they fold."""
    out: dict[str, str] = {}
    for path, group in shared_verdict(facts, order):
        out.update(dict.fromkeys(group, f"{shared_line(path, fold(group))}; use {SHARED_FIX}"))
    return out


def _port_problem(port: str, why: str) -> str:
    return (f"master port {port} is taken here ({why}): another job or process listens on "
            "it; a new --job-id picks another port")


def _resolve_problem(address: str, why: str) -> str:
    return (f"cannot resolve the master address {address} here ({why}); set --master-addr to "
            "an address every node reaches")


# Where each directory the gate probes comes from: the fix names it.
NVME_DIR = "NVMe offload dir"
_DIR_SOURCES = {"checkpoint dir": "--ckpt-dir or the inventory's checkpoint dirs",
                "job dir": "the workdir (the inventory's, or the current directory)",
                NVME_DIR: "--nvme-path (default: <checkpoint.local_dir>/nvme-offload)"}


def _dir_problem(value: str, why: str) -> str:
    """``checkpoint dir=/ck/j`` -> ``checkpoint dir /ck/j WHY; it comes from --ckpt-dir ...``"""
    what, _, path = value.partition("=")
    source = _DIR_SOURCES.get(what)
    return f"{what} {path} {why}" + (f"; it comes from {source}" if source else "")


def _parity(facts: dict[str, dict[str, object]], order: Sequence[str],
            keys: Sequence[str] = PARITY_KEYS) -> dict[str, str]:
    """Nodes whose interpreter or versions differ from the majority's (ties: the earliest
    node's), with what differs: doctor's rule (node/facts/parity.py), so both name the same
    odd node. The text names no node of its own: nodes with the same difference fold."""
    diffs: dict[str, list[str]] = {}
    for key in keys:
        values = {n: _show(facts[n].get(key)) for n in order if n in facts}
        if not values:
            continue
        common = majority(values, order)
        where = fold(holders(values, common, order))
        for node, value in values.items():
            if value != common:
                diffs.setdefault(node, []).append(f"{key} {value} != {common} on {where}")
    return {node: "differs from the majority: " + ", ".join(d) for node, d in diffs.items()}


def _show(value: object) -> str:
    return "not installed" if value is None else str(value)


def gate_error(result: GateResult) -> LaunchError:
    # Nodes with the same problem share one "node[1-7]: why" part (clubak -b).
    rows = folded_lines(result.problems.items())
    return LaunchError(
        f"pre-launch check failed on {len(result.problems)} node(s): " + "; ".join(rows[:6])
        + (f"; and {len(rows) - 6} more" if len(rows) > 6 else ""),
        host=None,
        hint="fix the node (or pass --exclude NODE); `clusterkit doctor` explains more; "
             "--skip-checks skips this gate",
    )


# ----------------------------------------------------------------------------- JIT ops


def ops_step(build_ops: bool, info: Callable[[str], None], *,
             build: bool = True) -> Callable[[JobPlan], None] | None:
    """:func:`ready_job_ops` as one step before a start (None: --no-build-ops)."""
    if not build_ops:
        return None

    def ready(plan: JobPlan) -> None:
        with transport_for() as transport:
            ready_job_ops(transport, plan, info, build=build)

    return ready


def ready_job_ops(transport: Transport, plan: JobPlan, info: Callable[[str], None], *,
                  build: bool = True) -> None:
    """Before the agents start: the ops every node's ranks would JIT-build, built there
    first, once per node (``build`` False: the dry run, which only says what it would
    build). Raises one :class:`LaunchError` for the nodes refused (a stale build lock, a
    failed build), each with its path and fix."""
    ops = job_ops(plan)
    if not any(ops.values()):
        return
    nodes = [OpsNode(n.name, target_for(n.host), n.python, dict(n.env)) for n in plan.nodes]
    report = ready_ops(transport, nodes, ops, build=build)
    if report.needed or not build:  # a launch with every op in place says nothing
        info(report.line(dry_run=not build))
    if report.refused:
        rows = folded_lines(report.refused.items(), report.order)
        raise LaunchError(f"JIT ops not ready on {len(report.refused)} node(s): "
                          + "; ".join(rows),
                          hint="--no-build-ops skips this step (ops carried with the "
                               "environment)")
