"""Run a node program on one Slurm node through Slurm itself, not SSH.

Many sites allow no SSH to compute nodes outside an allocation, but ``srun`` always
reaches them. collect-ckpt (docs/collect-ckpt.md, "Slurm jobs") runs its node
program as one Slurm task whose stdin/stdout carry the same stream an ``ssh``
session carries:

* the job still runs: a step inside it on that node
  (``srun --jobid=J --overlap --nodelist=NODE -N1 -n1 ...``), no new allocation;
* the job has ended (or waits in the queue): a one-task allocation on exactly that
  node (``srun --nodelist=NODE -N1 -n1 --immediate=S ...``) in the job's partition,
  account, QOS and reservation, given up when the program exits.

``srun`` runs the program's argv as given (no shell on either side), so the words
are quoted nowhere. Every call has a timeout: ``--immediate`` bounds the wait for
an allocation, and the caller bounds the rest.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clusterkit.hostrange import HostRangeError, expand_list
from clusterkit.slurm.client import HINTS, SlurmClient, SlurmError

# Seconds an allocation may wait for its node before srun gives up (--immediate).
ALLOC_WAIT_S = 30
# The #SBATCH options a helper allocation on the job's nodes must repeat: without the
# job's partition the node may not be in the default one; account, QOS and
# reservation decide whether we may run there at all.
SITE_KEYS = {"partition": "p", "account": "A", "qos": "q", "reservation": None}
# srun's own words for why a step or allocation was refused -> what to do.
SRUN_HINTS: tuple[tuple[str, str], ...] = (
    ("Required node not available", "the node is down, drained or reserved (`sinfo -N -n "
                                     "NODE` says which); its checkpoint is on its disk, so "
                                     "bring it back (`scontrol update NodeName=NODE "
                                     "State=RESUME`) and run collect-ckpt again"),
    ("Unable to allocate resources: Requested nodes are busy",
     "another job holds the node; collect-ckpt waited --slurm-wait seconds: run it again "
     "later or with a larger --slurm-wait"),
    ("Job/step already completing or completed", "the job ended while collecting; run "
                                                 "collect-ckpt again (it uses an allocation now)"),
    ("Immediate execution impossible", "the node did not become free within --slurm-wait "
                                       "seconds; run again later or with a larger --slurm-wait"),
    ("Invalid partition name", "the job's partition is gone (`sinfo -s` lists them): edit "
                               "#SBATCH --partition in JOBDIR/sbatch.sh and run again"),
    ("Requested reservation is invalid", "the job's reservation is over: remove #SBATCH "
                                         "--reservation from JOBDIR/sbatch.sh and run again"),
    ("Unable to allocate resources: Access/permission denied", "your account may not use the "
     "job's partition: fix #SBATCH --account/--qos/--partition in JOBDIR/sbatch.sh"),
)
# Environment that would make srun join another allocation (collect-ckpt started
# inside `salloc`, or from a batch script) instead of the one we name.
_JOB_ENV = re.compile(r"^(SLURM_|SRUN_|SALLOC_|SBATCH_)")
_KEEP_ENV = frozenset({"SLURM_CONF", "SLURM_CLUSTERS"})


@dataclass(frozen=True)
class SlurmPlace:
    """Where one node program runs through Slurm: ``node``, inside the running job
    ``job_id`` (a step) or, with ``job_id`` None, in an allocation of its own."""

    node: str
    job_id: str | None = None
    site: tuple[str, ...] = ()  # --partition=... etc. for an allocation of its own
    wait_s: int = ALLOC_WAIT_S
    job_name: str = "clusterkit-collect"

    def argv(self, program: Sequence[str]) -> list[str]:
        """The srun command line running ``program`` (an argv, not a shell line) there."""
        common = [f"--nodelist={self.node}", "--nodes=1", "--ntasks=1", "--chdir=/", "--quiet",
                  "--kill-on-bad-exit=1"]
        if self.job_id is not None:
            # --overlap: the job's own step holds every CPU; ours only reads files.
            return ["srun", f"--jobid={self.job_id}", "--overlap", *common, *program]
        return ["srun", *common, f"--immediate={self.wait_s}", f"--job-name={self.job_name}",
                *self.site, *program]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment without the variables of an allocation it may run in."""
        src = os.environ if base is None else base
        return {k: v for k, v in src.items() if k in _KEEP_ENV or not _JOB_ENV.match(k)}

    @property
    def startup_s(self) -> float:
        """How long the program may take to start: the allocation's wait on top."""
        return 0.0 if self.job_id is not None else float(self.wait_s)

    def describe(self) -> str:
        return (f"a step of running job {self.job_id}" if self.job_id is not None
                else "an allocation of its own")


def srun_hint(message: str) -> str | None:
    """What to do about srun's (or slurmctld's) words in ``message``; None if unknown."""
    low = message.lower()
    for needle, hint in (*SRUN_HINTS, *HINTS):
        if needle.lower() in low:
            return hint
    return None


def run_step(place: SlurmPlace, program: Sequence[str], timeout: float
             ) -> subprocess.CompletedProcess[str]:
    """``program`` on ``place`` to its end (stdin closed); a timeout is exit 124."""
    argv = place.argv(program)
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=place.env(), stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"no answer within {timeout:.0f} s")
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", "srun not found on PATH")


def site_args(script: str) -> tuple[str, ...]:
    """The partition/account/QOS/reservation a batch script asks for (its ``#SBATCH``
    lines, last one wins, as sbatch reads them), as srun options."""
    found: dict[str, str] = {}
    for line in script.splitlines():
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.startswith("#"):
                break  # sbatch stops reading #SBATCH lines at the first command
            continue
        try:
            words = shlex.split(line[len("#SBATCH"):], comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words):
            key, value = _option(word, words[i + 1] if i + 1 < len(words) else None)
            if key is not None and value:
                found[key] = value
    return tuple(f"--{k}={found[k]}" for k in SITE_KEYS if k in found)


def _option(word: str, following: str | None) -> tuple[str | None, str | None]:
    for key, short in SITE_KEYS.items():
        if word.startswith(f"--{key}="):
            return key, word.split("=", 1)[1]
        if word == f"--{key}" or (short and word == f"-{short}"):
            return key, following
        if short and word.startswith(f"-{short}") and len(word) > 2:
            return key, word[2:]
    return None, None


@dataclass(frozen=True)
class JobNodes:
    """A Slurm job's nodes as collect-ckpt sees them: the places, and whether it runs."""

    places: tuple[SlurmPlace, ...]
    state: str  # JobState, or "UNKNOWN" once slurmctld has forgotten the job


def job_places(client: SlurmClient, slurm_job_id: str | None, first_nodes: str | None,
               site: Sequence[str], *, wait_s: int = ALLOC_WAIT_S,
               job_name: str = "clusterkit-collect") -> JobNodes:
    """The job's nodes, in Slurm's node order: ``first_nodes`` (the node list the job's
    first run recorded, where node-local checkpoints stay) or else what ``scontrol``
    says. A running job is reached with steps inside it; any other with allocations."""
    state, listed = "UNKNOWN", ""
    try:
        if slurm_job_id is not None:  # None: submitted by hand, only its node list is known
            info = client.show(slurm_job_id)
            state, listed = info.state, info.nodes
    except SlurmError as exc:
        if "invalid job id" not in str(exc).lower():
            raise  # slurmctld down, a timeout: the one line says which
    nodelist = first_nodes or (listed if listed not in ("", "(null)", "None") else "")
    if not nodelist:
        raise SlurmError(f"the nodes of Slurm job {slurm_job_id or '?'} are not known: "
                         "slurmctld does not know the job and its job dir has no slurm_nodes file",
                         key="JOB", hint="pass the nodes yourself: -i INVENTORY --include NODES "
                         "--dir CKPT_DIR --via slurm")
    try:
        names = expand_list(nodelist)
    except HostRangeError as exc:
        raise SlurmError(f"cannot read the node list {nodelist!r} of Slurm job "
                         f"{slurm_job_id}: {exc}", key="JOB") from None
    # A step can only run on the nodes the job holds now (a pinned requeue holds the same).
    running = state == "RUNNING" and set(names) <= set(_names(listed))
    if not running:
        check_available(client, names)
    return JobNodes(tuple(SlurmPlace(n, slurm_job_id if running else None, tuple(site),
                                     wait_s, job_name) for n in names), state)


# sinfo %T states in which no new allocation starts on a node (a trailing * means
# "not responding"): srun --immediate would only say "Requested nodes are busy".
_UNAVAILABLE = ("down", "drain", "fail", "unk", "future", "inval", "power", "maint")


def check_available(client: SlurmClient, nodes: Sequence[str]) -> None:
    """Refuse at once, naming them, when Slurm has nodes down or drained (best effort:
    a site whose sinfo cannot answer leaves it to srun)."""
    bad = unavailable(client, nodes)
    if not bad:
        return
    what = "; ".join(f"{n} {state}" + (f" (reason: {why})" if why and why != "none" else "")
                     for n, (state, why) in bad.items())
    first = next(iter(bad))
    raise SlurmError(f"Slurm cannot place a step on the job's node(s): {what}. Their node-local "
                     "checkpoint files are only on their disks", key="JOB",
                     hint=f"bring the node back (`scontrol update NodeName={first} "
                          "State=RESUME`, an admin's call once it is healthy), then run "
                          "collect-ckpt again")


def unavailable(client: SlurmClient, nodes: Sequence[str]) -> dict[str, tuple[str, str]]:
    """node -> (sinfo state, reason) of the nodes Slurm has down, drained or not
    responding; empty when all are usable or sinfo cannot answer (best effort)."""
    try:
        states = client.node_states(nodes)
    except SlurmError:
        return {}
    return {n: states[n] for n in nodes if n in states and (
        states[n][0].endswith("*") or any(w in states[n][0] for w in _UNAVAILABLE))}


def _names(nodelist: str) -> list[str]:
    try:
        return expand_list(nodelist) if nodelist not in ("", "(null)", "None") else []
    except HostRangeError:
        return []
