"""The Slurm commands clusterkit runs: argv lists, a timeout on each, one error type.

``SlurmClient`` takes a ``runner`` so unit tests can answer for Slurm without a
cluster; the default runs the real binaries found on PATH (``SLURM_CONF`` and the
rest of the caller's environment apply, as for any Slurm client).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clusterkit.errors import LaunchError
from clusterkit.slurm.jobinfo import JobInfo, parse_job, parse_parsable, parse_sinfo_cpus

DEFAULT_TIMEOUT_S = 30.0
# Slurm's own message fragments -> what the user should do about them.
HINTS: tuple[tuple[str, str], ...] = (
    ("Invalid partition name", "list partitions with `sinfo -s` and pass --partition NAME"),
    ("Invalid account", "pass --account with one of `sacctmgr show assoc user=$USER format=account`"),
    ("Invalid qos", "pass a --qos your account may use (`sacctmgr show assoc`), or none"),
    ("Invalid generic resource", "the partition's nodes declare no GPUs (Gres=gpu:N); pick a GPU "
                                 "partition or drop --gpus-per-node"),
    ("Requested node configuration is not available",
     "no node has that many GPUs/CPUs; check `sinfo -o '%P %D %c %G'` against --gpus-per-node "
     "and --cpus-per-task"),
    ("Node count specification invalid", "the partition has fewer nodes than --nodes"),
    ("Invalid feature specification", "--constraint names a feature no node has; "
                                      "`sinfo -o '%N %f'` lists the nodes' features"),
    ("Requested time limit is invalid", "--time exceeds the partition's MaxTime (`sinfo -o '%P %l'`)"),
    ("Unable to contact slurm controller", "slurmctld is down or SLURM_CONF points elsewhere; "
                                           "`scontrol ping` says which"),
    ("Invalid job id", "the job finished more than MinJobAge ago (slurmctld forgot it) or never "
                       "existed; look at its output file"),
    ("Zero Bytes were transmitted or received", "munge/slurmctld authentication failed; "
                                                "is munged running on this host?"),
)


class SlurmError(LaunchError):
    """A Slurm command failed, timed out or is missing."""


Runner = Callable[[Sequence[str], float, Mapping[str, str] | None, str | None],
                  "subprocess.CompletedProcess[str]"]


def run_subprocess(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None,
                   cwd: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          env=dict(env) if env is not None else None, cwd=cwd,
                          stdin=subprocess.DEVNULL, check=False)


def _hint_for(message: str) -> str | None:
    return next((hint for needle, hint in HINTS if needle.lower() in message.lower()), None)


def _last_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}, no output"


@dataclass
class SlurmClient:
    """sbatch / scontrol / scancel with timeouts. ``env`` None: the caller's environment."""

    env: Mapping[str, str] | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    runner: Runner = field(default=run_subprocess)

    def _run(self, argv: Sequence[str], cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        try:
            proc = self.runner(argv, self.timeout_s, self.env, cwd)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]} not found on PATH: this machine is not a Slurm submit host",
                             key=argv[0], hint="run clusterkit on the cluster's login node, or "
                             "use --dry-run and copy the script there") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"`{argv[0]}` did not answer within {self.timeout_s:.0f} s",
                             key=argv[0], hint="slurmctld is busy or unreachable; "
                             "check `scontrol ping`") from None
        if proc.returncode != 0:
            message = _last_line(proc)
            raise SlurmError(f"`{' '.join(argv[:2])}` failed: {message}", key=argv[0],
                             hint=_hint_for(message))
        return proc

    def submit(self, script: str | Path, extra: Sequence[str] = ()) -> str:
        """``sbatch --parsable SCRIPT`` from the script's directory; returns the job id."""
        path = Path(script)
        proc = self._run(["sbatch", "--parsable", *extra, str(path)], cwd=str(path.parent))
        return parse_parsable(proc.stdout)

    def test_only(self, script: str | Path, extra: Sequence[str] = ()) -> str:
        """``sbatch --test-only``: Slurm validates the script and says where it would run."""
        path = Path(script)
        proc = self._run(["sbatch", "--test-only", *extra, str(path)], cwd=str(path.parent))
        return (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1]

    def node_cpus(self, partition: str | None = None, nodes: Sequence[str] = ()) -> int | None:
        """CPUs per node as Slurm counts them (``sinfo -h -o %c``), the smallest if the
        partition (or ``nodes``) mixes node types: the base of a --cpus-per-task default.
        None when sinfo lists no node."""
        argv = ["sinfo", "-h", "-o", "%c"]
        if partition is not None:
            argv.append(f"--partition={partition}")
        if nodes:
            argv.append(f"--nodes={','.join(nodes)}")
        return parse_sinfo_cpus(self._run(argv).stdout)

    def show(self, job_id: str) -> JobInfo:
        proc = self._run(["scontrol", "show", "job", "-o", job_id])
        return parse_job(proc.stdout, job_id)

    def cancel(self, job_id: str, *, signal: str | None = None, batch: bool = False,
               full: bool = False) -> None:
        """``scancel``. With ``signal``, only signal: the job's steps (default), its batch
        shell (``batch``) or both (``full``)."""
        argv = ["scancel"]
        if signal is not None:
            argv.append(f"--signal={signal}")
        if batch:
            argv.append("--batch")
        if full:
            argv.append("--full")
        self._run([*argv, job_id])

    def node_states(self, nodes: Sequence[str]) -> dict[str, tuple[str, str]]:
        """``{node: (state, reason)}`` from ``sinfo -N`` (state as sinfo's %T prints it,
        e.g. ``idle``, ``down*``, ``drained``; reason ``none`` when there is none)."""
        proc = self._run(["sinfo", "-h", "-N", f"--nodes={','.join(nodes)}", "-o", "%N|%T|%E"])
        out: dict[str, tuple[str, str]] = {}
        for line in proc.stdout.splitlines():
            name, _, rest = line.strip().partition("|")
            state, _, reason = rest.partition("|")
            if name:
                out.setdefault(name, (state, reason))
        return out
