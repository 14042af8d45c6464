"""``clusterkit nodes env``: the pure refusals, the manifest/record and the verify step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit.errors import ClusterkitError
from clusterkit.node.facts import envfacts
from clusterkit.provision.envcopy import Part, describe_local, editable_trees, refusal, unchanged

HERE = {"machine": "x86_64", "glibc": "2.35", "os": "ubuntu 22.04",
        "paths": {"/opt/env": {"state": "env"}}}
PARTS = (Part("/opt/env", "environment"),)


def _there(**kw: object) -> dict[str, object]:
    return {**HERE, "paths": {"/opt/env": {"state": "absent"}}, **kw}


def test_same_machine_and_absent_path_is_copied() -> None:
    assert refusal(HERE, _there(), PARTS) == (None, [])


@pytest.mark.parametrize(("there", "words"), [
    (_there(machine="aarch64"), "CPU architecture aarch64 here, x86_64 on the launcher"),
    (_there(glibc="2.31"), "glibc 2.31 here is older than the launcher's 2.35"),
    (_there(glibc=None), "glibc not found here is older"),
    (_there(paths={"/opt/env": {"state": "other", "what": "not a directory"}}),
     "/opt/env exists and is not a Python environment (not a directory): move it away"),
])
def test_refused_with_one_line_and_the_fix(there: dict[str, object], words: str) -> None:
    why, _ = refusal(HERE, there, PARTS)
    assert why is not None and words in why and "\n" not in why


def test_newer_glibc_and_existing_env_are_fine_another_os_warns() -> None:
    why, warnings = refusal(HERE, _there(glibc="2.39", os="rocky 9.3",
                                         paths={"/opt/env": {"state": "env"}}), PARTS)
    assert why is None
    assert warnings and "OS release rocky 9.3 here, ubuntu 22.04 on the launcher" in warnings[0]


def test_os_base_is_checked_not_copied() -> None:
    parts = (*PARTS, Part("/usr", "base interpreter", copy=False))
    why, _ = refusal(HERE, _there(), parts)
    assert why is not None and "the base interpreter /usr" in why
    assert refusal(HERE, _there(paths={"/usr": {"state": "env"}}), parts)[0] is None


def _venv(root: Path) -> Path:
    env = root / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    pkg = env / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (pkg / "tiny").mkdir(parents=True, exist_ok=True)
    (pkg / "tiny" / "__init__.py").write_text("X = 1\n")
    (pkg / "tiny" / "__pycache__").mkdir()
    (pkg / "tiny" / "__pycache__" / "x.pyc").write_bytes(b"node's own")
    return env


def test_manifest_links_files_and_record(tmp_path: Path) -> None:
    env = _venv(tmp_path)
    m = envfacts.local_manifest(str(env))
    assert m["bin/python"][0] == "l" and m["lib64"] == ["l", "lib"]
    assert not any("__pycache__" in rel for rel in m)
    rec = envfacts.write_record(str(env), m)
    assert envfacts.read_digest(str(env))["digest"] == rec["digest"] == envfacts.digest(m)
    assert envfacts.path_state(str(env))["state"] == "env"
    # the record is not part of the manifest; a changed byte changes the digest
    init = next(env.rglob("tiny/__init__.py"))
    init.write_text("X = 2\n")
    assert envfacts.digest(envfacts.local_manifest(str(env))) != rec["digest"]


def test_finish_makes_links_names_the_files_that_differ_and_records_only_when_equal(
        tmp_path: Path) -> None:
    src = _venv(tmp_path)
    want = envfacts.local_manifest(str(src))
    dst = tmp_path / "copy"
    # what the file transfer brings: regular files only
    for rel, e in want.items():
        if e[0] == "f":
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / rel).write_bytes((src / rel).read_bytes())
            os.chmod(dst / rel, e[2])
    (dst / "bin" / "stale-link").symlink_to("nowhere")
    wrong = next(p for p in dst.rglob("tiny/__init__.py"))
    wrong.write_text("X = 9\n")
    out = envfacts.finish(str(dst), want)
    assert out["ndiffer"] == 1 and out["differ"][0].endswith("tiny/__init__.py")
    assert envfacts.read_digest(str(dst)) is None
    wrong.write_bytes(next(src.rglob("tiny/__init__.py")).read_bytes())
    out = envfacts.finish(str(dst), want, {"env_digest": "e"})
    assert out["record"]["digest"] == envfacts.digest(want)
    assert os.readlink(dst / "bin" / "python") == os.readlink(src / "bin" / "python")
    assert not (dst / "bin" / "stale-link").is_symlink()
    assert envfacts.read_digest(str(dst))["env_digest"] == "e"


def test_path_states(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").write_text("x")
    (tmp_path / "file").write_text("x")
    states = envfacts.facts([str(tmp_path / n) for n in ("empty", "data", "file", "none")])
    assert [s["state"] for s in states["paths"].values()] == ["empty", "other", "other", "absent"]
    assert states["machine"] == os.uname().machine


def test_the_test_override_replaces_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envfacts.TEST_OVERRIDE_ENV, "machine=aarch64,glibc=2.17")
    got = envfacts.facts([])
    assert (got["machine"], got["glibc"]) == ("aarch64", "2.17")


def test_unchanged_compares_the_nodes_record() -> None:
    there = {"paths": {"/opt/env": {"state": "env", "record": {"digest": "d1"}}}}
    assert unchanged({"/opt/env": "d1"}, there, PARTS[0])
    assert not unchanged({"/opt/env": "d2"}, there, PARTS[0])


def _editable(env: Path, name: str, src: Path) -> None:
    site = next(env.rglob("site-packages"))
    d = site / f"{name}-1.0.dist-info"
    d.mkdir()
    (d / "direct_url.json").write_text(json.dumps({"url": f"file://{src}",
                                                   "dir_info": {"editable": True}}))


def test_editable_sources_travel_or_are_refused(tmp_path: Path) -> None:
    env = _venv(tmp_path)
    src = tmp_path / "mypkg"
    src.mkdir()
    _editable(env, "mypkg", src)
    assert editable_trees(str(env)) == [("mypkg", str(src.resolve()))]
    source = describe_local(str(env / "bin" / "python"))
    assert [p.role for p in source.parts] == ["environment", "base interpreter",
                                              "editable source of mypkg"]
    _editable(env, "whole", tmp_path)  # holds the environment itself
    with pytest.raises(ClusterkitError, match="cannot travel as a source tree"):
        describe_local(str(env / "bin" / "python"))


PYTHONS = [p for p in ("/root/.pyenv/versions/3.8.18/bin/python3.8", sys.executable)
           if os.path.exists(p)]


@pytest.mark.parametrize("python", PYTHONS)
def test_envfacts_runs_shipped_on_a_bare_python(python: str, tmp_path: Path) -> None:
    from clusterkit.ship import node_command

    src = _venv(tmp_path)
    want = envfacts.local_manifest(str(src))
    cmd = node_command(python, "facts.envfacts", ["facts", str(src), str(tmp_path / "none")])
    res = subprocess.run(cmd.argv, input=cmd.stdin, capture_output=True, timeout=60, check=True)
    facts = json.loads(res.stdout.decode().splitlines()[-1])
    assert [s["state"] for s in facts["paths"].values()] == ["env", "absent"]
    cmd = node_command(python, "facts.envfacts", ["finish", str(src)],
                       payload=(json.dumps({"entries": want}) + "\n").encode())
    res = subprocess.run(cmd.argv, input=cmd.stdin, capture_output=True, timeout=60, check=True)
    assert json.loads(res.stdout.decode().splitlines()[-1])["record"]["digest"] == \
        envfacts.digest(want)


def test_a_part_the_node_shares_with_the_launcher_is_left_alone() -> None:
    from clusterkit.provision.envcopy import shared_here

    there = {"paths": {"/opt/env": {"state": "env", "record": {"digest": "d", "token": "t1"}}}}
    assert shared_here("t1", there, PARTS[0])
    assert not shared_here("t2", there, PARTS[0]) and not shared_here("", there, PARTS[0])


def test_drivers_are_not_the_environment_but_said_when_they_differ() -> None:
    from clusterkit.cli.cmd_nodes import driver_note

    order = ["n1", "n2", "n3"]
    assert driver_note({"n1": "535.1", "n2": "535.1", "n3": None}, order) is None
    note = driver_note({"n1": "535.1", "n2": "535.1", "n3": "550.5"}, order)
    assert note is not None and note.startswith("GPU drivers differ (535.1 on n[1-2], 550.5 on n3)")
    assert "not copied" in note
