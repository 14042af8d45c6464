"""The replicated environment's digest in the launch gate and doctor; doctor's stale build lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from clusterkit.checks.facts import from_probe_json
from clusterkit.checks.findings import Status
from clusterkit.checks.invoke import facts_argv, parse_probe_stdout, probe_source
from clusterkit.checks.rules import ALL_RULES
from clusterkit.checks.rules_base import DoctorContext
from clusterkit.checks.rules_env import check_jit_locks, env_parity
from clusterkit.launch.gate import judge
from clusterkit.node.facts import envfacts

OURS = {"prefix": "/opt/env", "digest": "a" * 64, "stale": False,
        "groups": {"bin/python": "1", "lib/python3.11/site-packages/torch": "2"}}


def _here(prefix: str) -> dict[str, Any]:
    return dict(OURS) if prefix == "/opt/env" else {"prefix": prefix, "digest": None}


def test_env_problems_one_text_per_kind_so_they_fold() -> None:
    facts = {"n1": {"env": dict(OURS)}, "n2": {"env": dict(OURS)},
             "n3": {"env": {**OURS, "digest": "b" * 64}}, "n4": {"env": {**OURS, "digest": "b" * 64}},
             "n5": {"env": {"prefix": "/opt/env", "digest": None}},
             "n6": {"env": {**OURS, "stale": True}},
             "n7": {"env": {"prefix": "/other", "digest": "c" * 64}}}
    out = envfacts.env_problems(facts, _here)
    assert set(out) == {"n3", "n4", "n5", "n6"}  # n7: never replicated from here
    assert out["n3"] == out["n4"] and "differs from the launcher's (digest bbbbbbbbbbbb != " \
        "aaaaaaaaaaaa)" in out["n3"] and "clusterkit nodes env" in out["n3"]
    assert "was not replicated here" in out["n5"]
    assert "changed on this node since it was replicated" in out["n6"]
    stale_here = envfacts.env_problems({"n1": {"env": dict(OURS)}},
                                       lambda p: {**OURS, "stale": True})
    assert "changed on the launcher" in stale_here["n1"]


def test_the_gate_refuses_a_node_whose_environment_differs(tmp_path: Path) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    rec = envfacts.write_record(str(env), envfacts.local_manifest(str(env)), {"env_digest": "d1"})
    same = {"prefix": str(env), "digest": "d1", "stale": False}
    facts: dict[str, dict[str, object]] = {
        n: {"python": "/p", "version": "3.11.7", "env": dict(same)} for n in ("a", "b", "c")}
    facts["c"]["env"] = {**same, "digest": "d2"}
    res = judge(facts, {}, ["a", "b", "c"])
    assert list(res.problems) == ["c"] and "environment " in res.problems["c"]
    assert rec["digest"] and envfacts.env_state(str(env))["digest"] == "d1"


def _probe_facts(host: str, env: dict[str, Any], locks: list[dict[str, Any]] | None = None) -> Any:
    return from_probe_json(host, {"host": {"hostname": host},
                                  "envstate": {"env": env, "jit_locks": locks or []},
                                  "probe": {"elapsed_ms": 1.0}})


def test_doctor_env_parity_says_identical_or_names_what_differs() -> None:
    facts = {"n1": _probe_facts("n1", dict(OURS)),
             "n2": _probe_facts("n2", {**OURS, "digest": "b" * 64,
                                 "groups": {**OURS["groups"],
                                            "lib/python3.11/site-packages/torch": "9"}}),
             "n3": _probe_facts("n3", {**OURS, "changed": ["lib/python3.11/site-packages/x.py"]})}
    found = {f.host: f for f in env_parity(facts, _here)}
    assert found["n1"].status is Status.PASS and "identical to the launcher's" in found["n1"].detail
    assert found["n2"].status is Status.FAIL
    assert "differs in lib/python3.11/site-packages/torch" in found["n2"].detail
    assert found["n3"].status is Status.FAIL and "site-packages/x.py" in found["n3"].detail


def test_doctor_finds_a_stale_build_lock_with_the_real_probe(tmp_path: Path) -> None:
    lock = tmp_path / "ext" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    old = time.time() - 3600  # a killed build's, an hour ago (a young one is waited for)
    os.utime(lock, (old, old))
    argv = facts_argv(sys.executable)
    res = subprocess.run(argv, input=probe_source(), capture_output=True, timeout=120,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")},
                         check=False)
    facts = {"n1": from_probe_json("n1", parse_probe_stdout(res.stdout.decode()))}
    assert [lk["path"] for lk in facts["n1"].jit_locks] == [str(lock)]
    assert check_jit_locks in ALL_RULES
    (finding,) = check_jit_locks(facts, DoctorContext(hosts=("n1",)))
    assert finding.status is Status.FAIL and str(lock) in finding.detail
    assert f"rm {lock}" in finding.fix and "no build runs" in finding.fix


def test_a_held_lock_is_no_finding_of_failure() -> None:
    facts = {"n1": _probe_facts("n1", {}, [{"path": "/x/lock", "age_s": 5.0, "holders": [42]}])}
    (finding,) = check_jit_locks(facts, DoctorContext(hosts=("n1",)))
    assert finding.status is Status.PASS and "pid 42" in finding.detail


def test_record_json_is_small_and_sorted(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("x")
    envfacts.write_record(str(tmp_path), envfacts.local_manifest(str(tmp_path)))
    small = json.loads((tmp_path / ".clusterkit" / envfacts.DIGEST_FILE).read_text())
    assert set(small) >= {"digest", "fingerprint", "groups", "files"}


def test_a_record_without_an_environment_digest_is_not_judged(tmp_path: Path) -> None:
    """A venv's base or an editable tree gets a record too (the cache of its sha256s):
    jobs whose interpreter is that base are not judged by it (it was never replicated
    as an environment), nor does doctor stat it on every run."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("x")
    envfacts.write_record(str(tmp_path), envfacts.local_manifest(str(tmp_path)))
    assert envfacts.env_state(str(tmp_path), changes=True) == {
        "prefix": str(tmp_path), "digest": None}
