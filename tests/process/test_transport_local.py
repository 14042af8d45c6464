"""LocalTransport (virtual nodes) and the dispatching transport: no root, no sshd."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from clusterkit.errors import TransportError
from clusterkit.remote.base import SSHTarget
from clusterkit.remote.dispatch import DispatchTransport, transport_for
from clusterkit.remote.local import LocalTransport
from tests.procs import pid_alive

NODE = SSHTarget(name="v1", address="localhost", local=True)


@pytest.fixture
def local(tmp_path: Path) -> LocalTransport:
    return LocalTransport(cwd=str(tmp_path))


def test_run_output_exit_code(local: LocalTransport) -> None:
    r = local.run(NODE, ["sh", "-c", "echo out; echo err >&2; exit 5"])
    assert (r.host, r.exit_code, r.stdout, r.stderr) == ("v1", 5, "out\n", "err\n")
    assert r.argv == ("sh", "-c", "echo out; echo err >&2; exit 5")
    assert not r.ok and r.duration_s >= 0


def test_default_cwd_is_home_like_ssh() -> None:
    r = LocalTransport().run(NODE, ["pwd"])
    assert r.stdout.strip() == os.path.realpath(os.path.expanduser("~"))


def test_env_values_verbatim(local: LocalTransport, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    env = {"A": f"$(touch {marker})", "B": "x y\n'z\"", "C": ""}
    r = local.run(NODE, ["env", "-0"], env=env)
    seen = dict(item.split("=", 1) for item in r.stdout.split("\0") if "=" in item)
    assert {k: seen[k] for k in env} == env
    assert not marker.exists()


def test_bad_env_name_and_string_command_are_usage_errors(local: LocalTransport) -> None:
    with pytest.raises(TransportError) as info:
        local.run(NODE, ["true"], env={"1X": "y"})
    assert info.value.kind == "usage"
    with pytest.raises(TransportError) as info:
        local.run(NODE, "echo hi")  # a string is not a list of words
    assert info.value.kind == "usage"


def test_missing_program_exits_127_like_a_shell(local: LocalTransport) -> None:
    r = local.run(NODE, ["definitely-not-a-program-xyz"])
    assert r.exit_code == 127
    assert "command not found" in r.stderr


def test_stdin(local: LocalTransport) -> None:
    assert local.run(NODE, ["cat"], stdin=b"abc").stdout == "abc"


def test_timeout_kills_the_whole_group(local: LocalTransport, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    start = time.monotonic()
    with pytest.raises(TransportError) as info:
        local.run(NODE, ["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"], timeout=0.5)
    assert info.value.kind == "command-timeout"
    assert time.monotonic() - start < 5
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child)


def test_run_all_order_mapping_and_failures(local: LocalTransport) -> None:
    nodes = [SSHTarget(name=f"v{i}", address="localhost", local=True) for i in range(5)]
    argv = {n.name: ["sh", "-c", f"echo {n.name}; exit {i % 2}"] for i, n in enumerate(nodes)}
    group = local.run_all(nodes, argv, max_parallel=2)
    assert [r.host for r in group] == [n.name for n in nodes]
    assert [r.result.stdout for r in group if r.result] == [f"{n.name}\n" for n in nodes]
    assert [r.host for r in group.failed] == ["v1", "v3"]
    missing = local.run_all(nodes[:2], {"v0": ["true"]})
    assert missing["v0"].ok
    assert missing["v1"].error is not None and missing["v1"].error.kind == "usage"


def test_run_all_timeouts_are_per_host(local: LocalTransport) -> None:
    nodes = [SSHTarget(name=f"v{i}", address="localhost", local=True) for i in range(3)]
    argv = {"v0": ["true"], "v1": ["sleep", "30"], "v2": ["true"]}
    start = time.monotonic()
    group = local.run_all(nodes, argv, timeout=0.5)
    assert time.monotonic() - start < 5
    assert [r.ok for r in group] == [True, False, True]
    assert group["v1"].error is not None and group["v1"].error.kind == "command-timeout"


def test_start_streams_and_exit_code(local: LocalTransport) -> None:
    proc = local.start(NODE, ["sh", "-c", "echo a; echo b >&2; sleep 2; printf tail; exit 3"])
    lines = proc.lines()
    first = next(lines)
    first_seen = time.monotonic()
    assert first in {("stdout", "a"), ("stderr", "b")}
    rest = set(lines)
    assert ("stdout", "tail") in rest
    assert proc.wait(10) == 3 and proc.poll() == 3
    assert time.monotonic() - first_seen > 1.5  # the first line came before the sleep


def test_start_stdin_terminate(local: LocalTransport) -> None:
    proc = local.start(NODE, ["cat"])
    proc.write_stdin(b"hello\n")
    assert next(proc.lines()) == ("stdout", "hello")
    with pytest.raises(TimeoutError):
        proc.wait(0.1)
    proc.terminate()
    assert proc.wait(5) < 0
    proc = local.start(NODE, ["cat"])
    proc.write_stdin(b"x")
    proc.close_stdin()
    assert list(proc.lines()) == [("stdout", "x")]
    assert proc.wait(5) == 0


def test_put_get_atomic_and_helpers(local: LocalTransport, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"new" * 1000)
    src.chmod(0o600)
    dest_dir = tmp_path / "a" / "b"
    local.makedirs(NODE, str(dest_dir))
    dest = dest_dir / "f"
    dest.write_bytes(b"old")
    with open(dest, "rb") as reader:
        local.put(NODE, str(src), str(dest))
        assert reader.read() == b"old"  # replaced, not truncated in place
    assert dest.read_bytes() == src.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o600
    assert local.listdir(NODE, str(dest_dir)) == ["f"]
    st = local.stat(NODE, str(dest))
    assert st is not None and (st.size, st.is_dir, st.mode) == (3000, False, 0o600)
    assert local.stat(NODE, str(dest_dir / "missing")) is None
    assert local.sha256(NODE, str(dest)) == hashlib.sha256(b"new" * 1000).hexdigest()
    back = tmp_path / "back"
    local.get(NODE, str(dest), str(back))
    assert back.read_bytes() == src.read_bytes()


def test_file_errors_name_the_path(local: LocalTransport, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_text("x")
    with pytest.raises(TransportError) as info:
        local.put(NODE, str(src), str(tmp_path / "no" / "f"))
    assert info.value.kind == "file" and info.value.host == "v1"
    with pytest.raises(TransportError) as info:
        local.get(NODE, str(tmp_path / "missing"), str(tmp_path / "out"))
    assert info.value.kind == "file" and "missing" in (info.value.path or "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no temp files left


def test_dispatch_routes_local_without_creating_ssh(tmp_path: Path) -> None:
    t = transport_for([NODE])
    assert isinstance(t, DispatchTransport)
    assert t.run(NODE, ["echo", "hi"]).stdout == "hi\n"
    group = t.run_all([NODE, SSHTarget(name="v2", address="x", local=True)], ["true"])
    assert [r.ok for r in group] == [True, True]
    assert t._ssh is None  # paramiko never touched for local-only work
    t.close()


def test_dispatch_mixes_local_and_ssh_errors(tmp_path: Path) -> None:
    empty = tmp_path / "cfg"
    empty.write_text("")
    remote = SSHTarget(
        name="r1",
        address="unresolvable.invalid",
        config_file=str(empty),
        known_hosts_file=str(tmp_path / "kh"),
        identity_file=str(tmp_path / "none"),
    )
    with DispatchTransport(connect_timeout=5) as t:
        group = t.run_all([NODE, remote], ["true"])
    assert group[NODE.name].ok
    error = group["r1"].error
    assert error is not None and error.kind == "resolve"
