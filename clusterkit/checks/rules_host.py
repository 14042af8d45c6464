"""Doctor rules: checkpoint storage, /dev/shm and open-file limits, clock skew."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from clusterkit.checks.facts import NodeFacts
from clusterkit.checks.findings import Finding, Measure, Status
from clusterkit.checks.rules_base import (
    DoctorContext,
    GiB,
    gib,
    ok_nodes,
)

SHM_MIN_BYTES = 1 * GiB
STORAGE_MIN_FREE_BYTES = 64 * 1024**2  # below this a checkpoint dir counts as full
NOFILE_MIN = 65536
SKEW_WARN_S = 2.0
SKEW_FAIL_S = 30.0


# ----------------------------------------------------------------------------- storage and limits


def check_storage(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in ok_nodes(facts):
        for s in f.storage:
            check = f"storage:{s.path}"
            need, what = _need(ctx, f.host, s.path)
            if not s.writable:
                out.append(Finding(check, Status.FAIL, f.host, f"{s.path} is not writable",
                                   "create it with the right owner (mkdir -p; chown)"))
            elif s.free_bytes is not None and s.free_bytes < STORAGE_MIN_FREE_BYTES:
                out.append(Finding(check, Status.FAIL, f.host,
                                   f"{s.path}: full ({s.free_bytes // 1024**2} MiB free)",
                                   "free space or point the checkpoint dir at a bigger volume"))
            elif need is None or s.free_bytes is None:
                out.append(Finding(check, Status.PASS, f.host, f"{s.path} writable"))
            elif s.free_bytes < need:
                out.append(Finding(check, Status.FAIL, f.host,
                                   f"{s.path}: {gib(s.free_bytes)} free < {gib(need)} for {what}",
                                   "free space or point the checkpoint dir at "
                                   "a bigger volume"))
            elif s.free_bytes < 2 * need:
                out.append(Finding(check, Status.WARN, f.host,
                                   f"{s.path}: {gib(s.free_bytes)} free, room for only one "
                                   f"{gib(need)} save ({what})", "free space before the second save"))
            else:
                out.append(Finding(check, Status.PASS, f.host,
                                   f"{s.path}: room for 2+ checkpoints"))
    return out


def _need(ctx: DoctorContext, host: str, path: str) -> tuple[int | None, str]:
    """Bytes one save takes in ``path``, and what they are: a node-local dir also holds
    the copies of K other nodes' checkpoints (``--replicas``, docs/lost-a-node.md)."""
    need = ctx.checkpoint_bytes
    if need is None or not ctx.replicas or ctx.local_dirs.get(host) != path:
        return need, "one checkpoint"
    return need * (1 + ctx.replicas), f"one checkpoint + {ctx.replicas} replica(s)"


def check_limits(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    out = []
    for f in ok_nodes(facts):
        if f.shm_total_bytes is not None:
            if f.shm_total_bytes < SHM_MIN_BYTES:
                out.append(Finding("shm", Status.WARN, f.host,
                                   f"/dev/shm is {f.shm_total_bytes // 2**20} MiB (< 1 GiB): "
                                   "NCCL/dataloader shared memory will fail",
                                   "docker run --shm-size=16g, or `mount -o remount,size=16G "
                                   "/dev/shm`"))
            else:
                out.append(Finding("shm", Status.PASS, f.host, "/dev/shm >= 1 GiB"))
        if f.nofile_soft is not None and f.nofile_soft < NOFILE_MIN:
            out.append(Finding("ulimit.nofile", Status.WARN, f.host,
                               f"ulimit -n is {f.nofile_soft} (< {NOFILE_MIN})",
                               "add `* soft nofile 1048576` to /etc/security/limits.conf "
                               "(applied to new ssh sessions via pam_limits)"))
        elif f.nofile_soft is not None or f.shm_total_bytes is not None:
            out.append(Finding("ulimit.nofile", Status.PASS, f.host, f"ulimit -n >= {NOFILE_MIN}"))
    return out


def _clock_offset(t: float, window: tuple[float, float] | None) -> float:
    """How far the node's clock is outside the local send/receive window (0 inside).

    The probe read its clock somewhere between sending and receiving; only a time
    outside that window is provably skew, so slow SSH under load is never blamed.
    """
    if window is None:
        return t
    start, end = window
    return t - start if t < start else t - end if t > end else 0.0


def check_clock(facts: Mapping[str, NodeFacts], ctx: DoctorContext) -> list[Finding]:
    offsets: dict[str, float] = {}
    for f in ok_nodes(facts):
        if f.time is not None:
            offsets[f.host] = _clock_offset(f.time, ctx.probe_windows.get(f.host))
    if len(offsets) < 2:
        return []
    mid = statistics.median(offsets.values())
    out = []
    for host, off in offsets.items():
        skew = off - mid
        status = (Status.FAIL if abs(skew) > SKEW_FAIL_S else
                  Status.WARN if abs(skew) > SKEW_WARN_S else Status.PASS)
        if status is Status.PASS:
            out.append(Finding("clock", status, host, f"clock within {SKEW_WARN_S:g} s of median"))
        else:
            out.append(Finding.measured(
                "clock", status, host, Measure("clock {} s from the cluster median", skew,
                                               "+.1f"),
                "enable NTP: `timedatectl set-ntp true` (chrony or systemd-timesyncd)"))
    return out
