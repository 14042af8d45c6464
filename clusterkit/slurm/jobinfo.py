"""Pure parsers for what Slurm prints (no subprocess here)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from clusterkit.errors import ClusterkitError

# States after which nothing of the job runs any more (a requeued job leaves them).
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
})
# `scontrol show job -o`: KEY=VALUE words; values may contain spaces (Command=, WorkDir=),
# so a value runs until the next " Key=" whose key looks like a Slurm field name.
_FIELD = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_:/]*)=")
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")


class SlurmParseError(ClusterkitError):
    """Slurm printed something we do not understand."""


@dataclass(frozen=True)
class JobInfo:
    """One job as ``scontrol show job`` reports it."""

    job_id: str
    name: str
    state: str  # JobState, e.g. RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT
    reason: str
    exit_code: int  # ExitCode=N:S -> N (the batch script's exit status)
    exit_signal: int  # ... -> S (the signal that ended it, 0 if none)
    nodes: str  # NodeList (folded, e.g. node[1-7]) or "(null)" while pending
    stdout: str
    stderr: str
    restarts: int
    fields: Mapping[str, str] = field(default_factory=dict, hash=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def started_at(self) -> float | None:
        """StartTime as seconds since the epoch (the latest run's start after a requeue),
        None while unknown. scontrol prints the controller's local time."""
        try:
            return time.mktime(time.strptime(self.fields.get("StartTime", ""), "%Y-%m-%dT%H:%M:%S"))
        except (ValueError, OverflowError):
            return None

    @property
    def succeeded(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == 0

    def describe(self) -> str:
        """``FAILED (exit code 1)``, ``CANCELLED (signal 9)``, ``COMPLETED``."""
        detail = []
        if self.exit_code:
            detail.append(f"exit code {self.exit_code}")
        if self.exit_signal:
            detail.append(f"signal {self.exit_signal}")
        if self.reason not in ("", "None"):
            detail.append(f"reason {self.reason}")
        return f"{self.state} ({', '.join(detail)})" if detail else self.state


def parse_parsable(stdout: str) -> str:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER``."""
    text = stdout.strip().splitlines()
    first = text[-1].split(";", 1)[0].strip() if text else ""
    if not _JOB_ID.fullmatch(first):
        raise SlurmParseError(f"sbatch --parsable printed {stdout.strip()!r}, not a job id",
                              hint="is `sbatch` a wrapper that prints extra text? run it by hand")
    return first


def parse_fields(line: str) -> dict[str, str]:
    matches = list(_FIELD.finditer(line))
    out: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    return out


def _exit_pair(value: str) -> tuple[int, int]:
    code, _, sig = value.partition(":")
    try:
        return int(code), int(sig or 0)
    except ValueError:
        raise SlurmParseError(f"ExitCode={value!r} is not N:S", key="ExitCode") from None


def parse_job(stdout: str, job_id: str) -> JobInfo:
    """The first record of ``scontrol show job -o JOBID`` (an array job prints several)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise SlurmParseError(f"scontrol printed nothing for job {job_id}")
    f = parse_fields(lines[0])
    if "JobState" not in f or "JobId" not in f:
        raise SlurmParseError(f"no JobId/JobState in scontrol output for job {job_id}: "
                              f"{lines[0][:200]!r}")
    code, sig = _exit_pair(f.get("ExitCode", "0:0"))
    return JobInfo(job_id=f["JobId"], name=f.get("JobName", ""), state=f["JobState"],
                   reason=f.get("Reason", ""), exit_code=code, exit_signal=sig,
                   nodes=f.get("NodeList", ""), stdout=f.get("StdOut", ""),
                   stderr=f.get("StdErr", ""), restarts=int(f.get("Restarts", "0") or 0), fields=f)


def parse_sinfo_cpus(stdout: str) -> int | None:
    """The fewest CPUs per node in ``sinfo -h -o %c`` output (one line per node group;
    ``4+`` means "4 or more"); None when sinfo listed no node."""
    counts = []
    for line in stdout.split():
        m = re.fullmatch(r"([0-9]+)\+?", line.strip())
        if not m:
            raise SlurmParseError(f"sinfo -o %c printed {line!r}, not a CPU count", key="sinfo")
        counts.append(int(m.group(1)))
    return min(counts) if counts else None


def status_line(info: JobInfo) -> str:
    """`clusterkit sbatch status JOBID`'s line: state, exit code, nodes, output file."""
    where = f" on {info.nodes}" if info.nodes and info.nodes != "(null)" else ""
    return f"job {info.job_id} ({info.name}): {info.describe()}{where}; output {info.stdout}"


def output_hint(info: JobInfo) -> str:
    """Where to read more: the job's output files that exist here, never a name that does
    not (a relative StdOut, a file on a node's own disk)."""
    paths = [p for p in dict.fromkeys((info.stdout, info.stderr)) if p]
    found = [p for p in paths if os.path.isfile(p)]
    if found:
        return "see " + " and ".join(found)
    if paths:
        return (f"its output ({', '.join(paths)}) is not on this machine: look on "
                f"{info.fields.get('BatchHost') or 'the batch host'}")
    return "Slurm names no output file for it"
