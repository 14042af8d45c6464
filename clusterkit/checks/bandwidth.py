"""``clusterkit doctor --bandwidth``: a short all_reduce plus pairwise tests, one rank per node.

The node side is :mod:`clusterkit.node.facts.bw_worker` (shipped on stdin, needs only
torch on the node). NCCL when every node has GPUs, gloo otherwise. Numbers use
the nccl-tests definitions (GB = 1e9 bytes):

* all_reduce: ``algbw = bytes / time`` with the slowest rank's time,
  ``busbw = algbw × 2(n−1)/n`` (what each link carried; comparable across n);
* pairs (point-to-point exchange, both directions at once): ``algbw = bytes / time``
  per direction, ``busbw = algbw``.

Each node's score is the median algbw of its pairs; a node below
``STRAGGLER_FRACTION`` × the median score is flagged as a straggler.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from clusterkit.checks.doctor import DoctorReport
from clusterkit.checks.findings import Finding, Status
from clusterkit.checks.fixenv import recommended_env
from clusterkit.checks.invoke import ProbeOutputError, parse_probe_stdout
from clusterkit.errors import TransportError
from clusterkit.remote.base import CommandResult, SSHTarget, Transport
from clusterkit.remote.fanout import fan_out
from clusterkit.ship import bundle, node_command

DEFAULT_BYTES = 4 << 20  # 4 MiB: long enough to see bandwidth, short enough for a pre-flight
DEFAULT_ITERS = 5
STRAGGLER_FRACTION = 0.7
WORKER_TIMEOUT_S = 120.0  # torch import + rendezvous + n-1 rounds on a slow cluster
GB = 1e9


def worker_source() -> bytes:
    """What the worker's argv expects on stdin (see :mod:`clusterkit.ship`)."""
    return bundle("facts.bw_worker")


def busbw_allreduce(algbw: float, n: int) -> float:
    return algbw * 2 * (n - 1) / n if n > 1 else 0.0


@dataclass(frozen=True)
class PairResult:
    a: str
    b: str
    time_s: float
    algbw_gbs: float  # per direction; busbw == algbw for a pairwise exchange


@dataclass(frozen=True)
class BandwidthResult:
    backend: str
    nbytes: int
    hosts: tuple[str, ...]
    allreduce_s: float | None = None
    algbw_gbs: float | None = None
    busbw_gbs: float | None = None
    pairs: tuple[PairResult, ...] = ()
    scores: Mapping[str, float] = field(default_factory=dict)  # host -> median pair algbw
    stragglers: tuple[str, ...] = ()
    errors: Mapping[str, str] = field(default_factory=dict)  # host -> why its rank failed

    def summary(self) -> str:
        if self.algbw_gbs is None:
            return f"bandwidth: not measured ({'; '.join(self.errors.values()) or 'no result'})"
        ranking = ", ".join(f"{h} {self.scores[h]:.2f}" for h in self.ranking())
        return (f"bandwidth ({self.backend}, {self.nbytes / 2**20:g} MiB, {len(self.hosts)} "
                f"nodes): all_reduce algbw {self.algbw_gbs:.2f} GB/s, busbw "
                f"{self.busbw_gbs:.2f} GB/s; pairwise GB/s by node: {ranking}")

    def ranking(self) -> list[str]:
        return sorted(self.scores, key=lambda h: -self.scores[h])

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "bytes": self.nbytes, "hosts": list(self.hosts),
            "allreduce": {"time_s": self.allreduce_s, "algbw_gbs": self.algbw_gbs,
                          "busbw_gbs": self.busbw_gbs},
            "pairs": [{"a": p.a, "b": p.b, "time_s": p.time_s, "algbw_gbs": p.algbw_gbs,
                       "busbw_gbs": p.algbw_gbs} for p in self.pairs],
            "ranking": [{"host": h, "median_pair_algbw_gbs": self.scores[h]}
                        for h in self.ranking()],
            "stragglers": list(self.stragglers), "errors": dict(self.errors),
            "summary": self.summary(),
        }


def analyze(hosts: Sequence[str], ranks: Mapping[str, Mapping[str, Any]], backend: str,
            nbytes: int, fraction: float = STRAGGLER_FRACTION) -> BandwidthResult:
    """Pure: the per-rank worker outputs (host -> JSON, rank = index in ``hosts``) in,
    bandwidth numbers, node ranking and stragglers out."""
    errors = {h: str(r.get("fatal") or "no result") for h, r in ranks.items()
              if "fatal" in r or "allreduce_s" not in r}
    errors.update({h: "no result" for h in hosts if h not in ranks})
    if errors:
        return BandwidthResult(backend, nbytes, tuple(hosts), errors=errors)
    n = len(hosts)
    t = max(float(r["allreduce_s"]) for r in ranks.values())
    algbw = nbytes / t / GB if t > 0 else 0.0
    seen: dict[tuple[int, int], float] = {}
    for i, host in enumerate(hosts):
        for p in ranks[host].get("pairs", []):
            key = (min(i, int(p["peer"])), max(i, int(p["peer"])))
            seen[key] = max(seen.get(key, 0.0), float(p["time_s"]))  # slower side counts
    pairs = tuple(PairResult(hosts[a], hosts[b], s, nbytes / s / GB if s > 0 else 0.0)
                  for (a, b), s in sorted(seen.items()))
    scores = {h: statistics.median([p.algbw_gbs for p in pairs if h in (p.a, p.b)])
              for h in hosts if any(h in (p.a, p.b) for p in pairs)}
    stragglers: tuple[str, ...] = ()
    if len(scores) > 2:  # with two nodes there is one pair: nobody to compare against
        mid = statistics.median(scores.values())
        stragglers = tuple(h for h in hosts if h in scores and scores[h] < fraction * mid)
    return BandwidthResult(backend, nbytes, tuple(hosts), t, algbw, busbw_allreduce(algbw, n),
                           pairs, scores, stragglers)


def bandwidth_findings(res: BandwidthResult, fraction: float = STRAGGLER_FRACTION
                       ) -> list[Finding]:
    if res.errors:
        return [Finding("bandwidth", Status.FAIL, h, f"rank did not finish: {why}",
                        "run the job's collective by hand on this node; check "
                        "NCCL/GLOO_SOCKET_IFNAME and the firewall between nodes")
                for h, why in res.errors.items()]
    out = [Finding("bandwidth.allreduce", Status.PASS, "",
                   f"all_reduce {res.nbytes / 2**20:g} MiB over {len(res.hosts)} nodes: "
                   f"busbw {res.busbw_gbs:.2f} GB/s")]
    mid = statistics.median(res.scores.values()) if res.scores else 0.0
    for h in res.hosts:
        if h in res.stragglers:
            out.append(Finding("bandwidth.pairs", Status.WARN, h,
                               f"straggler: pairwise {res.scores[h]:.2f} GB/s < "
                               f"{fraction:g} × median {mid:.2f} GB/s",
                               "check the NIC's link speed (`ethtool <iface>`), errors "
                               "(`ip -s link`), and that NCCL uses the right interface/HCA"))
        elif h in res.scores:
            out.append(Finding("bandwidth.pairs", Status.PASS, h,
                               f"pairwise within {fraction:g} × median"))
    return out


def run_bandwidth(report: DoctorReport, transport: Transport, *, nbytes: int = DEFAULT_BYTES,
                  iters: int = DEFAULT_ITERS, port: int | None = None,
                  timeout: float = WORKER_TIMEOUT_S) -> BandwidthResult | None:
    """One rank per reachable node (rank order = inventory order); None if < 2 nodes."""
    nodes = [n for n in report.plan.nodes if report.facts[n.host].ok]
    if len(nodes) < 2:
        return None
    gpus = all((report.facts[n.host].gpu_count or 0) > 0 for n in nodes)
    backend = "nccl" if gpus else "gloo"
    ifenv = {k: v for k, v in recommended_env(report).items() if k != "PATH"}
    base = {"WORLD_SIZE": str(len(nodes)), "MASTER_ADDR": nodes[0].address,
            "MASTER_PORT": str(port or (report.plan.master_port or 29500) + 1),
            "LOCAL_RANK": "0", **ifenv}
    envs = {n.host: {**n.env, **base, "RANK": str(i)} for i, n in enumerate(nodes)}
    by_name = {n.host: n for n in nodes}
    argv = ["--bytes", str(nbytes), "--iters", str(iters), "--backend", backend,
            "--timeout", f"{timeout / 2:g}"]

    def work(target: SSHTarget) -> CommandResult:
        node = by_name[target.name]
        return transport.run(target, node_command(node.python, "facts.bw_worker", argv).argv,
                             timeout=timeout,
                             env=envs[node.host], stdin=worker_source())

    group = fan_out([n.target for n in nodes], work,
                    per_host_budget_s=4 * report.plan.connect_timeout_s + timeout,
                    max_parallel=report.plan.max_parallel)
    ranks: dict[str, Mapping[str, Any]] = {}
    for hr in group:
        ranks[hr.host] = _rank_output(hr.result, hr.error)
    return analyze([n.host for n in nodes], ranks, backend, nbytes)


def _rank_output(result: CommandResult | None, error: TransportError | None) -> dict[str, Any]:
    if error is not None or result is None:
        return {"fatal": error.message if error else "no result"}
    try:
        return parse_probe_stdout(result.stdout)
    except ProbeOutputError:
        tail = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}"])[-1]
        return {"fatal": tail[:300]}


def add_bandwidth(report: DoctorReport, transport: Transport, *,
                  nbytes: int = DEFAULT_BYTES) -> DoctorReport:
    started = time.monotonic()
    res = run_bandwidth(report, transport, nbytes=nbytes)
    report = replace(report, timings={**report.timings, "bandwidth": time.monotonic() - started})
    if res is None:
        finding = Finding("bandwidth", Status.WARN, "", "not measured: fewer than 2 nodes "
                          "answered", None)
        return replace(report, findings=(*report.findings, finding))
    return replace(report, findings=(*report.findings, *bandwidth_findings(res)),
                   extra={**report.extra, "bandwidth": res.to_json()})
