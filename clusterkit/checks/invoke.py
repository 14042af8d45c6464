"""How the doctor runs the probe on a node: argv, stdin and reading the answer back.

Contract (see docs/doctor.md): the transport runs ``argv`` on the node with
``stdin=probe_source()`` — the node program :mod:`clusterkit.node.facts.probe`, shipped
by :mod:`clusterkit.ship` like every node program; the probe prints JSON
lines and exits 0; the LAST line is the result. Everything here is pure (the
source is read once from the installed package, never from the cwd).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clusterkit.node.protocol import ProtocolError, answer_of
from clusterkit.ship import bundle, node_command

FACTS_TIMEOUT_S = 45.0  # probe's own worst case: 15 s commands + 5 s resolution + slack


class ProbeOutputError(ValueError):
    """The probe's stdout held no JSON result line (wrong interpreter, crash, truncation)."""


def probe_source() -> bytes:
    """What the probe's argv expects on stdin (the bootstrap's bundle)."""
    return bundle("facts.probe")


def _probe(python: str, args: list[str]) -> list[str]:
    return node_command(python, "facts.probe", args).argv


def facts_argv(python: str, *, workdir: str | None = None,
               ckpt_dirs: Sequence[str] = (), peers: Sequence[str] = (),
               master: str | None = None, master_wait: float = 0.0) -> list[str]:
    argv = ["facts"]
    if master:
        argv += ["--master", master, "--master-wait", f"{master_wait:g}"]
    if workdir:
        argv += ["--workdir", workdir]
    for d in ckpt_dirs:
        argv += ["--ckpt-dir", d]
    for p in peers:
        argv += ["--peer", p]
    return _probe(python, argv)


def listen_argv(python: str, port: int, seconds: float, bind: str = "0.0.0.0",
                expect: int = 0) -> list[str]:
    argv = ["listen", str(port), f"{seconds:g}", "--bind", bind]
    return _probe(python, [*argv, "--expect", str(expect)] if expect else argv)


def connect_argv(python: str, host: str, port: int, timeout: float = 3.0,
                 hello: str | None = None) -> list[str]:
    argv = ["connect", host, str(port), "--timeout", f"{timeout:g}"]
    return _probe(python, [*argv, "--hello", hello] if hello else argv)


def parse_probe_stdout(stdout: str) -> dict[str, Any]:
    """The last JSON object line of the probe's stdout.

    Login banners or a noisy ``.bashrc`` may print before the probe starts; they
    are skipped instead of failing the whole node.
    """
    try:
        return answer_of(stdout, "the probe")
    except ProtocolError as exc:
        raise ProbeOutputError(str(exc)) from None
