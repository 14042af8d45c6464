"""``clusterkit doctor`` orchestration: plan → one SSH session per node → facts → rules → report.

:func:`~clusterkit.checks.doctor_plan.plan_doctor` is pure (inventory hosts and the
launching machine's facts in, a :class:`DoctorPlan` out; ``checks/doctor_plan.py``).
:func:`run_doctor` executes it over a transport:

1. every selected node runs the probe (``<python> - facts``, probe on stdin) in
   parallel, each on its own SSH connection; a node that cannot be reached
   becomes an ``unreachable`` fact with the transport's error kind, the others
   go on;
2. the master-port phase reuses those connections: ``listen`` on the master,
   ``connect`` from every reachable node, then a ``!done`` hello ends the
   listener (so the port is free again right after doctor);
3. the shared-storage phase (``checks/doctor_storage.py``): a token written into each
   ``checkpoint.local_dir`` and looked for from the others, then removed;
4. the pure rules turn facts into findings.

Nothing here prints; the CLI renders :class:`DoctorReport`. The master-port phase
is ``checks/doctor_port.py``, ``--fix-env`` is ``checks/fixenv.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterkit.checks.doctor_plan import DoctorPlan
from clusterkit.checks.doctor_port import Listener, master_port_findings, probe_budget
from clusterkit.checks.doctor_storage import shared_dir_tokens
from clusterkit.checks.facts import NodeFacts, from_probe_json, unreachable
from clusterkit.checks.findings import (
    Finding,
    FindingGroup,
    Measure,
    Status,
    group_findings,
    worst,
)
from clusterkit.checks.invoke import (
    ProbeOutputError,
    parse_probe_stdout,
    probe_source,
)
from clusterkit.checks.rules import run_rules
from clusterkit.checks.rules_base import DoctorContext
from clusterkit.checks.rules_env import env_parity
from clusterkit.checks.rules_storage import check_shared_dirs
from clusterkit.errors import TransportError
from clusterkit.hostrange import fold
from clusterkit.remote.base import (
    CommandResult,
    SSHTarget,
    Transport,
)
from clusterkit.remote.dispatch import DispatchTransport
from clusterkit.remote.fanout import fan_out
from clusterkit.remote.openssh import with_openssh

SLOW_STARTUP_S = 5.0  # remote start-up (shell + interpreter) above this is worth a warning
# A remote shell that cannot exec the interpreter exits 126/127 before the probe runs.
_NO_INTERPRETER = (126, 127)


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class DoctorReport:
    plan: DoctorPlan
    facts: Mapping[str, NodeFacts]
    findings: tuple[Finding, ...]
    timings: Mapping[str, float] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)  # e.g. bandwidth results

    @property
    def hosts(self) -> tuple[str, ...]:
        return self.plan.ctx.hosts

    @property
    def status(self) -> Status:
        return worst(self.findings)

    def groups(self, *, include_pass: bool = False) -> list[FindingGroup]:
        shown = [f for f in self.findings if include_pass or f.status is not Status.PASS]
        groups = group_findings(shown, self.hosts)
        # Worst first; within a severity keep the rules' order (stable sort).
        return sorted(groups, key=lambda g: -int(g.status))

    def clean_hosts(self) -> list[str]:
        bad = {f.host for f in self.findings if f.status is not Status.PASS}
        if "" in bad:  # a cluster-wide problem concerns everybody, but no node in particular
            bad.discard("")
        return [h for h in self.hosts if h not in bad]

    def exit_code(self, *, strict: bool = False) -> int:
        if self.status is Status.FAIL:
            return 2
        if self.status is Status.WARN and strict:
            return 1
        return 0

    def verdict(self, *, strict: bool = False) -> str:
        fails = [f for f in self.findings if f.status is Status.FAIL]
        warns = [f for f in self.findings if f.status is Status.WARN]
        clean = self.clean_hosts()
        n = len(self.hosts)
        where = fold(sorted({f.host for f in fails + warns if f.host},
                            key=self.hosts.index)) or "cluster-wide"
        spares = self.plan.ctx.spares
        spare = f"; spare{'s' * (len(spares) > 1)} {fold(spares)} checked too" if spares else ""
        if not fails and not warns:
            return f"PASS: all {n} nodes ready ({fold(self.hosts)}{spare})"
        head = "FAIL" if fails else ("WARN (--strict)" if strict else "PASS with warnings")
        counts = ", ".join(p for p in (_plural(len(fails), "failure"),
                                       _plural(len(warns), "warning")) if p)
        bad = [h for h in spares if any(f.host == h for f in fails)]
        if bad:  # launch --replace would run a lost node's ranks there, and fail its gate
            spare = (f"; spare{'s' * (len(bad) > 1)} {fold(bad)} would fail the launch's "
                     "gate: no spare until fixed")
        return f"{head}: {counts} on {where}; {len(clean)} of {n} nodes clean{spare}"

    def to_json(self, *, strict: bool = False) -> dict[str, Any]:
        return {
            "verdict": self.verdict(strict=strict),
            "status": str(self.status),
            "exit_code": self.exit_code(strict=strict),
            "hosts": list(self.hosts),
            "clean_hosts": self.clean_hosts(),
            "groups": [
                {"status": str(g.status), "check": g.check, "hosts": list(g.hosts),
                 "host_range": g.host_range, "detail": g.detail, "fix": g.fix}
                for g in self.groups(include_pass=True)
            ],
            "findings": [
                {"status": str(f.status), "check": f.check, "host": f.host, "detail": f.detail,
                 "fix": f.fix} for f in self.findings
            ],
            "unreachable": {h: {"kind": f.error_kind, "error": f.probe_error}
                            for h, f in self.facts.items() if not f.ok},
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
            **dict(self.extra),
        }


def _plural(n: int, word: str) -> str:
    return "" if n == 0 else f"{n} {word}" + ("" if n == 1 else "s")


# ----------------------------------------------------------------------------- execution


def run_doctor(plan: DoctorPlan, transport: Transport, *, ssh_client: str | None = None,
               clock: Callable[[], float] = time.time) -> DoctorReport:
    """Facts and master port in one round: the master's listener starts alongside the
    probes, and each probe ends by connecting to it (one SSH session per node).

    ``ssh_client`` names what carries the SSH sessions for the report (``openssh`` or
    ``paramiko``: :func:`fanout_transport` says which), None: not said.
    """
    started = time.monotonic()
    # ~0.1 s of hashing, while the nodes work (result() re-raises its error, if any)
    digest_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="doctor-digest")
    own_digest = digest_pool.submit(_local_digest)
    digest_pool.shutdown(wait=False)
    master = plan.master
    listener = (Listener.start_async(transport, master, plan.master_port)
                if master is not None and plan.master_port else None)
    try:
        stats: dict[str, float] = {}
        startup: dict[str, float] = {}
        facts, windows, connects = collect_facts(plan, transport, clock=clock, stats=stats,
                                                 startup=startup)
        t_facts = time.monotonic() - started
        port_findings = (master_port_findings(plan, transport, listener, facts, connects,
                                              stats=stats)
                         if listener is not None else [])
        stats["port"] = time.monotonic() - started - t_facts
        t_storage = time.monotonic()
        tokens = shared_dir_tokens({n.host: (n.target, n.python) for n in plan.nodes},
                                   plan.ctx.local_dirs, facts, transport, plan.ctx.storage)
        stats["storage"] = time.monotonic() - t_storage
    finally:
        if listener is not None:
            listener.close()
    t_rules = time.monotonic()
    findings = (run_rules(facts, _with_windows(plan.ctx, windows)) + port_findings
                + startup_findings(startup) + clusterkit_parity(facts, own_digest.result())
                + check_shared_dirs(tokens, plan.ctx) + env_parity(facts))
    timings = {"facts": t_facts, **stats, "rules": time.monotonic() - t_rules,
               "total": time.monotonic() - started}
    extra = {"ssh_client": ssh_client} if ssh_client else {}
    return DoctorReport(plan, facts, tuple(findings), timings, extra)


def fanout_transport(plan: DoctorPlan,
                     transport: DispatchTransport) -> tuple[Transport, str | None]:
    """The real transport's commands over the system ``ssh`` when one is installed, and
    the client's name for the report (None: every node is local, no SSH at all).

    paramiko's handshakes are Python work in this process, serialised by the GIL: at
    128 nodes they cost ~10 s of the launcher's CPU (docs/doctor.md, "Measured"); ``ssh``
    does them in C, in parallel processes. Typed DispatchTransport, so no type probe:
    only the real transport is offered (tests hand run_doctor their fakes directly).
    """
    if all(n.target.local for n in plan.nodes):
        return transport, None
    fast = with_openssh(transport, connect_timeout=plan.connect_timeout_s)
    return fast, "paramiko" if fast is transport else "openssh"


def _local_digest() -> str:
    from clusterkit.provision.install import local_digest

    return local_digest()


def clusterkit_parity(facts: Mapping[str, NodeFacts], digest: str | None = None) -> list[Finding]:
    """Each reachable node's clusterkit against the launcher's (same sources, or not).

    WARN, not FAIL: only the bundled workload needs clusterkit on the nodes.
    """
    from clusterkit.provision.install import local_digest

    want = digest or local_digest()
    out = []
    for f in facts.values():
        if not f.ok or f.probe_ms is None:
            continue
        if f.clusterkit_digest == want:
            out.append(Finding("version.clusterkit", Status.PASS, f.host,
                               "same clusterkit as the launcher"))
        elif f.clusterkit_digest is None:
            out.append(Finding("version.clusterkit", Status.WARN, f.host,
                               "clusterkit is not installed (only the bundled workload needs it)",
                               "`clusterkit nodes install` (a wheel of this clusterkit, offline)"))
        else:
            out.append(Finding("version.clusterkit", Status.WARN, f.host,
                               f"clusterkit {f.clusterkit_version} here is not the launcher's "
                               "(other sources)", "`clusterkit nodes install`"))
    return out


def _with_windows(ctx: DoctorContext, windows: Mapping[str, tuple[float, float]]) -> DoctorContext:
    return dataclasses.replace(ctx, probe_windows=dict(windows))


Collected = tuple[dict[str, NodeFacts], dict[str, tuple[float, float]],
                  dict[str, Mapping[str, Any]]]  # facts, clock windows, master connects


def collect_facts(plan: DoctorPlan, transport: Transport, *,
                  clock: Callable[[], float] = time.time,
                  stats: dict[str, float] | None = None,
                  startup: dict[str, float] | None = None) -> Collected:
    """Run the facts probe on every node at once; one result per node, never an exception."""
    windows: dict[str, tuple[float, float]] = {}
    phases: dict[str, tuple[float, float]] = {}  # host -> (ssh set-up s, command s)
    by_name = {n.host: n for n in plan.nodes}
    stdin = probe_source()

    def work(target: SSHTarget) -> CommandResult:
        node = by_name[target.name]
        t0 = time.monotonic()
        marks: list[float] = []

        def connected() -> None:  # SSH set-up stays out of the clock window
            marks.extend((time.monotonic(), clock()))

        result = transport.run_connected(target, node.argv, timeout=plan.probe_timeout_s,
                                         env=node.env or None, stdin=stdin,
                                         on_connected=connected)
        t1, sent = marks if marks else (t0, clock())
        windows[node.host] = (sent, clock())
        phases[node.host] = (t1 - t0, time.monotonic() - t1)
        return result

    group = fan_out([n.target for n in plan.nodes], work,
                    per_host_budget_s=probe_budget(plan, plan.probe_timeout_s),
                    max_parallel=plan.max_parallel)
    facts: dict[str, NodeFacts] = {}
    connects: dict[str, Mapping[str, Any]] = {}
    for hr in group:
        facts[hr.host], raw = _facts_of(hr.host, hr.result, hr.error, by_name[hr.host].python)
        if isinstance(raw.get("master_port"), Mapping):
            connects[hr.host] = raw["master_port"]
    if stats is not None:
        stats.update(_phase_stats(phases, facts))
    if startup is not None:
        # Command time minus the probe's own work: channel, login shell, interpreter start.
        startup.update({h: p[1] - (facts[h].probe_ms or 0.0) / 1000
                        for h, p in phases.items() if facts[h].ok})
    return facts, windows, connects


def startup_findings(startup: Mapping[str, float],
                     limit_s: float = SLOW_STARTUP_S) -> list[Finding]:
    """A slow remote start-up is paid by every launcher (pdsh, DeepSpeed's runner) too."""
    return [Finding.measured("ssh.startup", Status.WARN, host, Measure(
                "{} s passed on the node before the probe ran (login shell ~/.bashrc, "
                "interpreter start-up, or an overloaded node)", secs),
                "keep ~/.bashrc fast for non-interactive shells: put `[[ $- != *i* ]] "
                "&& return` above slow lines such as `pyenv init`/`conda init`")
            for host, secs in startup.items() if secs > limit_s]


def _phase_stats(phases: Mapping[str, tuple[float, float]],
                 facts: Mapping[str, NodeFacts]) -> dict[str, float]:
    """Where the time went: SSH set-up (TCP + kex + auth) vs. the remote command
    (login shell + .bashrc + interpreter start + probe + master connect)."""
    if not phases:
        return {}
    out = {"ssh_setup_max": max(p[0] for p in phases.values()),
           "command_max": max(p[1] for p in phases.values()),
           "command_median": statistics.median(p[1] for p in phases.values())}
    probe_ms = [f.probe_ms for f in facts.values() if f.probe_ms is not None]
    if probe_ms:
        out["probe_work_max"] = max(probe_ms) / 1000
    return out


def _facts_of(host: str, result: CommandResult | None, error: TransportError | None,
              python: str) -> tuple[NodeFacts, dict[str, Any]]:
    """The node's facts and its raw probe JSON ({} when it did not answer)."""
    if error is not None or result is None:
        err = error or TransportError("no result", kind="error", host=host)
        return unreachable(host, err.message, err.kind, err.hint), {}
    try:
        raw = parse_probe_stdout(result.stdout)
    except ProbeOutputError as exc:
        if result.exit_code in _NO_INTERPRETER:
            why = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}"])[-1]
            return unreachable(host, f"cannot run {python}: {why}", "interpreter"), {}
        return unreachable(host, f"{exc} (exit {result.exit_code}, stderr: "
                                 f"{result.stderr.strip()[-200:]!r})", "probe"), {}
    return from_probe_json(host, raw), raw
