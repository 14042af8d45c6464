"""The probe, run for real as a subprocess: the node bootstrap with the probe's source on stdin."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterkit.checks.facts import from_probe_json
from clusterkit.checks.invoke import (
    ProbeOutputError,
    connect_argv,
    facts_argv,
    listen_argv,
    parse_probe_stdout,
    probe_source,
)
from clusterkit.node.facts import probe
from tests.helpers import free_port

OLD_PYTHONS = [p for p in ("/root/.pyenv/versions/3.7.16/bin/python3.7",
                           "/root/.pyenv/versions/3.8.18/bin/python3.8") if os.path.exists(p)]


def _run_probe(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, input=probe_source(), capture_output=True, timeout=timeout,
                          check=False)



def test_facts_are_valid_json_fast_and_never_import_torch(tmp_path: Path) -> None:
    argv = facts_argv(sys.executable, workdir=str(tmp_path),
                      ckpt_dirs=[str(tmp_path / "ckpt" / "not-yet")], peers=["localhost"])
    t0 = time.perf_counter()
    res = _run_probe(argv)
    wall = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr
    data = parse_probe_stdout(res.stdout.decode())
    assert data["schema"] == probe.SCHEMA_VERSION and data["errors"] == {}
    assert data["probe"]["heavy_modules_imported"] == []
    assert wall < 5.0  # measured ~60 ms incl. interpreter start; generous for a busy 2-core box
    f = from_probe_json("node1", data)
    assert f.ok and f.python_executable == sys.executable
    assert f.workdir_exists and f.workdir_writable
    (st,) = f.storage
    assert not st.exists and st.writable and (st.free_bytes or 0) > 0  # measured at the parent
    assert f.forward["localhost"]
    assert f.nofile_soft is None or f.nofile_soft > 0
    assert f.freeze and f.freeze_sha256


def test_importtime_shows_no_torch() -> None:
    argv = facts_argv(sys.executable)
    res = _run_probe([argv[0], "-X", "importtime", *argv[1:]])
    modules = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.decode().splitlines()
               if line.startswith("import time:")}
    assert "json" in modules  # sanity: importtime output was captured
    assert not {m for m in modules if m.split(".")[0] in probe.HEAVY_MODULES}


@pytest.mark.parametrize("python", OLD_PYTHONS)
def test_probe_runs_on_old_interpreters(python: str) -> None:
    data = parse_probe_stdout(_run_probe(facts_argv(python)).stdout.decode())
    assert data["errors"] == {} and data["python"]["executable"] == python


def test_a_broken_section_is_reported_as_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> dict[str, object]:
        raise PermissionError("no /dev/shm here")

    monkeypatch.setattr(probe, "section_shm", boom)
    facts = probe.collect_facts(None, [], [])
    assert facts["errors"] == {"shm": "PermissionError: no /dev/shm here"}
    assert facts["shm"] == {} and facts["python"]["executable"] == sys.executable


def test_listen_then_connect_counts_the_hello() -> None:
    port = free_port()
    listener = subprocess.Popen(listen_argv(sys.executable, port, 3, bind="127.0.0.1"),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert listener.stdin is not None and listener.stdout is not None
        listener.stdin.write(probe_source())
        listener.stdin.close()
        ready = json.loads(listener.stdout.readline())
        assert ready["event"] == "ready" and ready["port"] == port
        ok = parse_probe_stdout(_run_probe(connect_argv(sys.executable, "127.0.0.1", port)).stdout
                                .decode())
        assert ok["ok"] is True and ok["error_kind"] is None
        result = parse_probe_stdout(listener.stdout.read().decode())
    finally:
        listener.kill()
        listener.wait()
    assert result["bound"] and result["accepted"] == 1
    assert result["hellos"] == [{"addr": "127.0.0.1", "hello": socket.gethostname()}]


def test_listen_on_busy_port_and_connect_refused() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = parse_probe_stdout(_run_probe(listen_argv(sys.executable, port, 1, "127.0.0.1")).stdout
                                 .decode())
    assert res["bound"] is False and res["errno"] == 98
    refused = parse_probe_stdout(_run_probe(connect_argv(sys.executable, "127.0.0.1", free_port()))
                                 .stdout.decode())
    assert refused["ok"] is False and refused["error_kind"] == "refused"


def test_output_parsing_skips_banners_and_reports_garbage() -> None:
    assert parse_probe_stdout('Welcome to node7\n{"mode": "facts"}\n') == {"mode": "facts"}
    with pytest.raises(ProbeOutputError, match="SyntaxError"):
        parse_probe_stdout("  File \"<stdin>\", line 3\nSyntaxError: invalid syntax\n")


def test_probe_source_is_the_module_file_and_imports_only_stdlib() -> None:
    source = Path(probe.__file__).read_bytes()
    assert probe_source().endswith(source)  # shipped as is, after the bundle header
    tree = ast.parse(source)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    # ... and the node modules shipped beside it (clusterkit.ship bundles them).
    imported -= {"clusterkit"} if any(isinstance(n, ast.ImportFrom) and (n.module or "")
                                      .startswith("clusterkit.node") for n in ast.walk(tree)) else set()
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
