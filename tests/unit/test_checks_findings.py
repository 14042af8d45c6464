"""Folding findings into host-range rows, including findings that differ only in a
measured number (issue 15): one row with the range of values, ClusterShell-style."""

from __future__ import annotations

from clusterkit.checks.doctor import startup_findings
from clusterkit.checks.findings import Finding, Measure, Status, group_findings

TEMPLATE = "{} s passed on the node before the probe ran"
FIX = "keep ~/.bashrc fast"


def startup(host: str, secs: float) -> Finding:
    return Finding.measured("ssh.startup", Status.WARN, host, Measure(TEMPLATE, secs), FIX)


def test_measured_detail_is_the_value_on_its_own() -> None:
    f = startup("node1", 5.24)
    assert f.detail == "5.2 s passed on the node before the probe ran"


def test_rows_differing_only_in_the_measure_fold_into_one_range_row() -> None:
    hosts = [f"node{i}" for i in range(1, 61)]
    values = {f"node{i}": 5.2 + (i % 7) * 0.5 for i in range(1, 41)} | {"node52": 8.7}
    groups = group_findings([startup(h, v) for h, v in values.items()], hosts)
    assert len(groups) == 1
    (g,) = groups
    assert g.host_range == "node[1-40,52]"
    assert g.detail == "5.2–8.7 s passed on the node before the probe ran"
    assert g.one_line() == ("WARN ssh.startup  node[1-40,52]: 5.2–8.7 s passed on the node "
                            "before the probe ran — fix: keep ~/.bashrc fast")


def test_range_is_exact_on_the_shown_precision() -> None:
    # 5.24 and 5.21 both show as 5.2: one value, not a range of one.
    (g,) = group_findings([startup("node1", 5.24), startup("node2", 5.21)])
    assert g.detail.startswith("5.2 s ")
    (g,) = group_findings([startup("node1", 5.26), startup("node2", 5.21)])
    assert g.detail.startswith("5.2–5.3 s ")


def test_signed_values_sort_numerically() -> None:
    m = [Finding.measured("clock", Status.WARN, h, Measure("clock {} s from median", v, "+.1f"))
         for h, v in (("a", 2.5), ("b", -3.1), ("c", 10.0))]
    (g,) = group_findings(m, ["a", "b", "c"])
    assert g.detail == "clock -3.1–+10.0 s from median"
    assert g.hosts == ("a", "b", "c")


def test_different_status_fix_or_template_do_not_fold() -> None:
    fail = Finding.measured("clock", Status.FAIL, "n1", Measure("clock {} s", 40.0), "ntp")
    warn = Finding.measured("clock", Status.WARN, "n2", Measure("clock {} s", 3.0), "ntp")
    other_fix = Finding.measured("clock", Status.WARN, "n3", Measure("clock {} s", 4.0), "x")
    other_text = Finding.measured("clock", Status.WARN, "n4", Measure("skew {} s", 4.0), "ntp")
    groups = group_findings([fail, warn, other_fix, other_text])
    assert [g.hosts for g in groups] == [("n1",), ("n2",), ("n3",), ("n4",)]


def test_plain_numbers_in_details_never_fold() -> None:
    # Versions differ only in digits, but they are not measurements.
    a = Finding("version.torch", Status.FAIL, "n1", "torch 2.3.1 ≠ 2.4.0", "pip")
    b = Finding("version.torch", Status.FAIL, "n2", "torch 2.3.2 ≠ 2.4.0", "pip")
    assert len(group_findings([a, b])) == 2


def test_measured_and_plain_findings_with_the_same_text_stay_apart() -> None:
    plain = Finding("x", Status.WARN, "n1", "5.0 s", None)
    measured = Finding.measured("x", Status.WARN, "n2", Measure("{} s", 5.0))
    assert len(group_findings([plain, measured])) == 2


def test_a_host_is_listed_once() -> None:
    (g,) = group_findings([startup("n1", 6.0), startup("n1", 7.0)])
    assert g.hosts == ("n1",)
    assert g.detail.startswith("6.0–7.0 s ")


def test_startup_findings_fold_at_128_nodes() -> None:
    hosts = [f"node{i}" for i in range(1, 129)]
    secs = {h: 5.1 + (i % 49) / 10 for i, h in enumerate(hosts)} | {"node1": 0.3}
    groups = group_findings(startup_findings(secs), hosts)
    assert len(groups) == 1
    assert groups[0].host_range == "node[2-128]"
    assert groups[0].detail.startswith("5.1–9.9 s passed on the node")
