"""The job's processes on one node: found by their environment tag, signalled, swept.

Part of the node agent (:mod:`clusterkit.node.agent.core`; node program ``agent.core``, whose
module list in :mod:`clusterkit.ship` names this file). It holds the job-scoped
teardown apart from the agent's loop because ``--stop`` and ``--status`` need it
without a running agent, and because it is the one place that signals processes.

Teardown is job-scoped: SIGTERM to the launcher's process group AND to every process
whose ``/proc/<pid>/environ`` carries this job's ``CLUSTERKIT_JOB_ID`` (workers may
live in other process groups, or be started by pdsh through sshd), SIGKILL after the
grace period. A process of another job is never signalled: we never match on command
lines (DeepSpeed's ``pkill -f`` kills every DeepSpeed job on the node, DeepSpeed#6807).

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any, Protocol

from clusterkit.node.contract import ENV_ATTEMPT, ENV_NODE, JobDir
from clusterkit.node.contract import ENV_JOB_ID as ENV_JOB

POLL_S = 0.1  # how often the agent looks again (its loop, the sweep, the fork server)


class Child(Protocol):
    """What the agent starts: a Popen, or a rank the fork server forked (ForkedRank)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def _environ(pid: int) -> dict[bytes, bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None  # gone, a kernel thread, or not ours to read
    out: dict[bytes, bytes] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key] = value
    return out


def job_processes(job_id: str, node: str | None = None, attempt: int | None = None
                  ) -> dict[int, dict[bytes, bytes]]:
    """pid -> environ of every live process tagged with ``job_id``.

    ``node``/``attempt``: also require these tags when the process carries them
    (virtual nodes share one machine; processes started by pdsh carry no node tag).
    """
    want = job_id.encode()
    skip = {os.getpid(), os.getppid()}
    found: dict[int, dict[bytes, bytes]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        env = _environ(int(name))
        if not env or env.get(ENV_JOB.encode()) != want:
            continue
        if node is not None and env.get(ENV_NODE.encode(), node.encode()) != node.encode():
            continue
        if attempt is not None and env.get(ENV_ATTEMPT.encode(), str(attempt).encode()) \
                != str(attempt).encode():
            continue
        found[int(name)] = env
    return found


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rank_pids_of(procs: dict[int, dict[bytes, bytes]]) -> dict[int, int]:
    """global rank -> pid of the rank's own process among ``procs`` (pid -> environ).

    A rank's helpers (DataLoader workers, compile workers) inherit its RANK: the rank is
    the process whose parent is not of the same rank (the lowest pid where that leaves
    several, as after a pid wrap)."""
    by_rank: dict[int, list[int]] = {}
    for pid, env in procs.items():
        value = env.get(b"RANK", b"")
        if value.isdigit() and b"LOCAL_RANK" in env:
            by_rank.setdefault(int(value), []).append(pid)
    out: dict[int, int] = {}
    for rank, pids in by_rank.items():
        roots = [p for p in pids if _ppid(p) not in pids] or pids
        out[rank] = min(roots)
    return out


def signal_pid(pid: int, sig: int) -> bool:
    """True when ``sig`` reached ``pid`` (False: gone, or not ours)."""
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def sweep(job_id: str, node: str | None, attempt: int | None, grace_s: float,
          children: Sequence[Child] = ()) -> dict[str, int]:
    """SIGTERM the children's groups and every process of the job; SIGKILL after grace."""
    counts = {"signalled": 0, "killed": 0, "left": 0}
    for child in children:
        if child.poll() is None:
            signal_group(child.pid, signal.SIGTERM)
            counts["signalled"] += 1
    for pid in job_processes(job_id, node, attempt):
        counts["signalled"] += signal_pid(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        alive = any(c.poll() is None for c in children)
        if not alive and not job_processes(job_id, node, attempt):
            return counts
        time.sleep(POLL_S)
    for child in children:
        if child.poll() is None:
            signal_group(child.pid, signal.SIGKILL)
            counts["killed"] += 1
    for pid in job_processes(job_id, node, attempt):
        counts["killed"] += signal_pid(pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(5.0)
    time.sleep(POLL_S)
    counts["left"] = len(job_processes(job_id, node, attempt))
    return counts


def job_status(job_id: str, job_dir: str | None, node: str | None) -> dict[str, Any]:
    """What ``agent.core --status`` prints: the job's processes here and the agent's record."""
    procs = job_processes(job_id, node)
    state: Any = None
    if job_dir and node:
        path = JobDir(os.path.expanduser(job_dir)).agent_state(node)
        try:
            with open(path, encoding="utf-8") as fh:
                state = json.load(fh)
        except (OSError, ValueError):
            state = None
    agent_alive = bool(state and state.get("state") != "exited" and state.get("agent_pid")
                       and os.path.exists(f"/proc/{state['agent_pid']}"))
    pids = rank_pids_of(procs)
    if isinstance(state, dict) and isinstance(state.get("ranks"), dict):
        # Ranks the agent started itself: its own record names them (a forked rank whose
        # environ has no room for RANK is found here too).
        pids.update({int(r): pid for r, pid in state["ranks"].items()
                     if isinstance(pid, int) and pid in procs and r.isdigit()})
    prog = state.get("progress") if isinstance(state, dict) else None
    progress = None
    if isinstance(prog, dict) and isinstance(prog.get("time"), (int, float)):
        # The age on this node's own clock: the launcher's may differ.
        progress = {"step": prog.get("step"), "age_s": round(time.time() - prog["time"], 1)}
    return {"processes": len(procs), "ranks": sorted(pids), "agent": state,
            "agent_alive": agent_alive, "progress": progress,
            # JSON keys are strings: rank -> pid of each live rank of this node.
            "pids": {str(r): pids[r] for r in sorted(pids)},
            "launcher_pid": _live(state, "child_pid", procs),
            "fork_server_pid": _live(state, "zygote_pid", procs)}


def _live(state: Any, key: str, procs: dict[int, dict[bytes, bytes]]) -> int | None:
    """The agent's recorded pid of ``key`` while that process still runs for the job."""
    pid = state.get(key) if isinstance(state, dict) else None
    return pid if isinstance(pid, int) and pid in procs else None
