"""A scripted fake transport: per-host behaviour for the failure paths, no test bed.

``FakeTransport({"node1": ok("out"), "node2": timeout(), "node3": dropped()})``
answers ``run`` from the script and ``run_all`` through the real fan-out
(:func:`clusterkit.remote.fanout.run_all`), so deadlines, ordering and
per-host error capture are the production code's. Every call is recorded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from clusterkit.errors import TransportError
from clusterkit.remote.base import CommandResult, GroupResult, SSHTarget
from clusterkit.remote.fanout import run_all

Behaviour = Callable[[SSHTarget, Sequence[str], float], CommandResult]


def ok(stdout: str = "", stderr: str = "") -> Behaviour:
    def run(target: SSHTarget, argv: Sequence[str], timeout: float) -> CommandResult:
        return CommandResult(target.name, tuple(argv), 0, stdout, stderr, 0.01)
    return run


def exits(code: int, stderr: str = "") -> Behaviour:
    def run(target: SSHTarget, argv: Sequence[str], timeout: float) -> CommandResult:
        return CommandResult(target.name, tuple(argv), code, "", stderr, 0.01)
    return run


def fails(kind: str, message: str, hint: str | None = None) -> Behaviour:
    """What the SSH transport raises: ``refused``, ``resolve``, ``auth``, ``dropped``..."""
    def run(target: SSHTarget, argv: Sequence[str], timeout: float) -> CommandResult:
        raise TransportError(message, kind=kind, host=target.name, hint=hint)
    return run


def timeout() -> Behaviour:
    """The command ran past its timeout (the transport killed it)."""
    def run(target: SSHTarget, argv: Sequence[str], timeout_s: float) -> CommandResult:
        raise TransportError(f"command did not finish within {timeout_s:g}s (killed)",
                             kind="command-timeout", host=target.name)
    return run


def dropped() -> Behaviour:
    return fails("dropped", "the SSH connection dropped while the command ran")


def hangs(release: threading.Event) -> Behaviour:
    """Never returns by itself (past every timeout): only the fan-out deadline ends it."""
    def run(target: SSHTarget, argv: Sequence[str], timeout_s: float) -> CommandResult:
        release.wait(60)
        raise TransportError("released", kind="error", host=target.name)
    return run


@dataclass
class FakeTransport:
    script: Mapping[str, Behaviour]
    calls: list[tuple[str, tuple[str, ...], bytes | None]] = field(default_factory=list)
    connect_budget_s: float = 0.0

    def run(self, target: SSHTarget, argv: Sequence[str], *, timeout: float = 60.0,
            env: Mapping[str, str] | None = None, stdin: bytes | None = None) -> CommandResult:
        self.calls.append((target.name, tuple(argv), stdin))
        time.sleep(0)  # let other fan-out workers interleave
        return self.script[target.name](target, argv, timeout)

    def run_connected(self, target: SSHTarget, argv: Sequence[str], *, timeout: float = 60.0,
                      env: Mapping[str, str] | None = None, stdin: bytes | None = None,
                      on_connected: Callable[[], None] | None = None) -> CommandResult:
        if on_connected is not None:  # no login to wait for
            on_connected()
        return self.run(target, argv, timeout=timeout, env=env, stdin=stdin)

    def run_all(self, targets: Sequence[SSHTarget],
                argv: Sequence[str] | Mapping[str, Sequence[str]], *, timeout: float = 60.0,
                env: Mapping[str, str] | None = None, max_parallel: int = 64,
                stdin: bytes | None = None) -> GroupResult:
        return run_all(self, targets, argv, timeout=timeout, env=env, max_parallel=max_parallel,
                       stdin=stdin, connect_budget_s=self.connect_budget_s)

    def close(self) -> None:
        pass


def targets(names: Sequence[str]) -> list[SSHTarget]:
    return [SSHTarget(name=n, address=n) for n in names]
