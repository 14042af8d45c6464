"""A host that did not answer is not dialled again in the same recovery.

A server lost for good costs every contact the connect timeout (10 s by default: no
answer to the TCP connect). After an attempt fails, the launcher used to reach every
node of the attempt three times in a row: the teardown's out-of-band sweep
(``Orchestrator._verify_gone``), the restart's gate round (``launch.gate.run_gate``)
and the gate's token round (``drop_tokens``): 30 s for a dead node, where the first
10 s had told already. :class:`NoRedial` wraps a transport for one scope (launch/run.py:
one attempt and the recovery after it). A host whose connection could not be made for
want of an answer (``TransportError.kind == "timeout"``: the TCP connect, no route to
it, no SSH banner, a handshake or a jump host's tunnel that did not finish) is
remembered with the time it was seen, and every later call to that host through the
same wrapper fails at once with that failure, said as such::

    node6: timeout: unreachable (no answer from port 22 within 10s, at 09:10:26; not dialled again)

Anything else (refused, a command that failed or ran out of time, a dropped session,
the fan-out's overall deadline, which may have connected) is dialled again as before.
Results stay per host and in order; one host's memory never stops another host's call.
The memory is the wrapper's, so its scope is the caller's: the next attempt (or the next
launch) gets a fresh one and dials a node that came back (a healed partition, a
rebooted server) again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from clusterkit.errors import TransportError
from clusterkit.remote.base import (
    DEFAULT_COMMAND_TIMEOUT_S,
    DEFAULT_MAX_PARALLEL,
    CommandResult,
    FileStat,
    GroupResult,
    HostResult,
    RemoteProcess,
    SSHTarget,
    Transport,
)
from clusterkit.remote.fanout import DeadlineError

T = TypeVar("T")


def no_answer(error: TransportError) -> bool:
    """The host did not answer the connect (its failure is worth remembering)."""
    return error.kind == "timeout" and not isinstance(error, DeadlineError)


def known_failure(error: TransportError, seen_at: float) -> TransportError:
    """The remembered failure, as a later call reports it: what was seen, and when."""
    clock = time.strftime("%H:%M:%S", time.localtime(seen_at))
    return TransportError(f"unreachable ({error.message}, at {clock}; not dialled again)",
                          kind=error.kind, host=error.host, path=error.path, hint=error.hint)


class NoRedial:
    """A :class:`~clusterkit.remote.base.Transport` over ``inner`` that dials a host
    which did not answer only once (module doc). ``clock``: the wall clock of the
    "at HH:MM:SS" in the message. Closing it leaves ``inner`` to its owner."""

    def __init__(self, inner: Transport, *, clock: Callable[[], float] = time.time) -> None:
        self.inner = inner
        self._clock = clock
        self._lock = threading.Lock()
        self._down: dict[SSHTarget, tuple[TransportError, float]] = {}

    def known(self, target: SSHTarget) -> TransportError | None:
        """The failure a call to ``target`` gets without dialling; None: dial it."""
        with self._lock:
            seen = self._down.get(target)
        return None if seen is None else known_failure(*seen)

    def note(self, target: SSHTarget, error: TransportError) -> None:
        """Remember ``error`` of ``target`` when it says the host did not answer."""
        if target.local or not no_answer(error):
            return
        with self._lock:
            self._down.setdefault(target, (error, self._clock()))

    def _call(self, target: SSHTarget, call: Callable[[], T]) -> T:
        known = self.known(target)
        if known is not None:
            raise known
        try:
            return call()
        except TransportError as exc:
            self.note(target, exc)
            raise

    def run(self, target: SSHTarget, argv: Sequence[str], *,
            timeout: float = DEFAULT_COMMAND_TIMEOUT_S, env: Mapping[str, str] | None = None,
            stdin: bytes | None = None) -> CommandResult:
        return self._call(target, lambda: self.inner.run(target, argv, timeout=timeout, env=env,
                                                         stdin=stdin))

    def run_connected(self, target: SSHTarget, argv: Sequence[str], *,
                      timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
                      env: Mapping[str, str] | None = None, stdin: bytes | None = None,
                      on_connected: Callable[[], None] | None = None) -> CommandResult:
        return self._call(target, lambda: self.inner.run_connected(
            target, argv, timeout=timeout, env=env, stdin=stdin, on_connected=on_connected))

    def run_all(self, targets: Sequence[SSHTarget],
                argv: Sequence[str] | Mapping[str, Sequence[str]], *,
                timeout: float = DEFAULT_COMMAND_TIMEOUT_S, env: Mapping[str, str] | None = None,
                max_parallel: int = DEFAULT_MAX_PARALLEL, stdin: bytes | None = None
                ) -> GroupResult:
        """The inner fan-out over the hosts not known to be down; the known ones get
        their failure in their place. Learns from the per-host results it gets."""
        known = [self.known(t) for t in targets]
        ask = [t for t, k in zip(targets, known, strict=True) if k is None]
        asked = self.inner.run_all(ask, argv, timeout=timeout, env=env,
                                   max_parallel=max_parallel, stdin=stdin) if ask else GroupResult()
        for target, result in zip(ask, asked, strict=True):  # one result per host, in order
            if result.error is not None:
                self.note(target, result.error)
        answers = iter(asked)
        return GroupResult(tuple(next(answers) if k is None else HostResult(t.name, error=k)
                                 for t, k in zip(targets, known, strict=True)))

    def start(self, target: SSHTarget, argv: Sequence[str], *,
              env: Mapping[str, str] | None = None) -> RemoteProcess:
        return self._call(target, lambda: self.inner.start(target, argv, env=env))

    def put(self, target: SSHTarget, local_path: str, remote_path: str) -> None:
        self._call(target, lambda: self.inner.put(target, local_path, remote_path))

    def get(self, target: SSHTarget, remote_path: str, local_path: str) -> None:
        self._call(target, lambda: self.inner.get(target, remote_path, local_path))

    def stat(self, target: SSHTarget, path: str) -> FileStat | None:
        return self._call(target, lambda: self.inner.stat(target, path))

    def listdir(self, target: SSHTarget, path: str) -> list[str]:
        return self._call(target, lambda: self.inner.listdir(target, path))

    def makedirs(self, target: SSHTarget, path: str) -> None:
        self._call(target, lambda: self.inner.makedirs(target, path))

    def sha256(self, target: SSHTarget, path: str, *, timeout: float = 600.0) -> str:
        return self._call(target, lambda: self.inner.sha256(target, path, timeout=timeout))

    def close(self) -> None:
        """Nothing of its own to close: ``inner`` belongs to whoever made it."""
