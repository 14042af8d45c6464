"""Bounded parallel fan-out over hosts with an overall deadline.

Each host runs in a worker thread under its own connect/command timeouts; the
caller additionally waits at most ``deadline_s`` in total, so a wedged host can
never make ``run_all`` join forever (the fabric ThreadingGroup pitfall). Results
come back in the order the targets were given, one per target, and a failure on
one host never stops the others.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from clusterkit.errors import TransportError
from clusterkit.remote.base import CommandResult, GroupResult, HostResult, SSHTarget


class _Runs(Protocol):
    def run(self, target: SSHTarget, argv: Sequence[str], *, timeout: float = ...,
            env: Mapping[str, str] | None = ..., stdin: bytes | None = ...) -> CommandResult: ...

# Added to each wave's budget: thread start-up, key loading, result collection.
_SLACK_S = 5.0


def argv_for(argv: Sequence[str] | Mapping[str, Sequence[str]], target: SSHTarget) -> list[str]:
    """The command for one host: a shared argv, or a per-host mapping by target name."""
    if isinstance(argv, Mapping):
        if target.name not in argv:
            raise TransportError("no command given for this host", kind="usage", host=target.name)
        return list(argv[target.name])
    return list(argv)


def run_all(
    transport: _Runs,
    targets: Sequence[SSHTarget],
    argv: Sequence[str] | Mapping[str, Sequence[str]],
    *,
    timeout: float,
    env: Mapping[str, str] | None,
    max_parallel: int,
    stdin: bytes | None,
    connect_budget_s: float,
) -> GroupResult:
    """The one ``run_all``: ``transport.run`` on every target, bounded and in order."""

    def work(target: SSHTarget) -> CommandResult:
        return transport.run(target, argv_for(argv, target), timeout=timeout, env=env, stdin=stdin)

    return fan_out(targets, work, per_host_budget_s=connect_budget_s + timeout,
                   max_parallel=max_parallel)


class DeadlineError(TransportError):
    """A host's worker had no result within the fan-out's overall deadline (``kind``
    ``timeout``, as before): it may have connected and hung in its command, so this is
    not "the host did not answer" (remote/unanswered.py does not remember it)."""


def as_transport_error(exc: Exception, host: str) -> TransportError:
    if isinstance(exc, TransportError):
        return exc
    # An unexpected exception in one host's worker must not abort the fan-out.
    return TransportError(f"{type(exc).__name__}: {exc}", kind="error", host=host)


def fan_out(
    targets: Sequence[SSHTarget],
    work: Callable[[SSHTarget], CommandResult],
    *,
    per_host_budget_s: float,
    max_parallel: int,
) -> GroupResult:
    """Run ``work(target)`` for every target, at most ``max_parallel`` at a time."""
    if not targets:
        return GroupResult(())
    workers = max(1, min(max_parallel, len(targets)))
    waves = math.ceil(len(targets) / workers)
    deadline_s = waves * (per_host_budget_s + _SLACK_S)
    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="clusterkit-fanout")
    try:
        futures = [pool.submit(work, t) for t in targets]
        cf.wait(futures, timeout=deadline_s)
        results = tuple(
            _collect(target, future, deadline_s) for target, future in zip(targets, futures, strict=True)
        )
    finally:
        # Never join stragglers: they end on their own timeouts.
        pool.shutdown(wait=False, cancel_futures=True)
    return GroupResult(results)


def _collect(target: SSHTarget, future: cf.Future[CommandResult], deadline_s: float) -> HostResult:
    if not future.done():
        future.cancel()
        return HostResult(
            host=target.name,
            error=DeadlineError(
                f"no result within the overall deadline of {deadline_s:.0f}s",
                kind="timeout",
                host=target.name,
                hint="the host hung past its own timeouts; check it by hand",
            ),
        )
    exc = future.exception()
    if exc is not None:
        if not isinstance(exc, Exception):
            raise exc
        return HostResult(host=target.name, error=as_transport_error(exc, target.name))
    return HostResult(host=target.name, result=future.result())
