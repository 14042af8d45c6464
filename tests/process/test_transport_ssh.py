"""SSHTransport against a throwaway real sshd on 127.0.0.1 (no namespaces, no $HOME).

The fixture starts ``sshd -D -e`` with its own host key and authorized_keys on a
random high port. OpenSSH needs its privilege-separation directory /run/sshd; when
the machine lacks it we start sshd in a private mount namespace with a tmpfs on
/run instead of creating it, so the test leaves no trace outside tmp_path.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
import pytest

from clusterkit.errors import TransportError
from clusterkit.remote.base import SSHTarget
from clusterkit.remote.ssh import SSHTransport
from tests.helpers import free_port

SSHD = "/usr/sbin/sshd"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None,
    reason="needs root, /usr/sbin/sshd and ssh-keygen",
)


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "clusterkit-test", "-f", str(path)],
        check=True,
    )



@dataclasses.dataclass
class Sshd:
    dir: Path
    port: int
    proc: subprocess.Popen[bytes]
    host_key: Path
    client_key: Path
    other_key: Path  # a key sshd does not accept

    def known_hosts_line(self) -> str:
        key = paramiko.PKey.from_path(str(self.host_key))
        return f"[127.0.0.1]:{self.port} {key.get_name()} {key.get_base64()}\n"

    def session_pids(self) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]


def _start_sshd(d: Path) -> Sshd:
    for name in ("host", "client", "other"):
        _keygen(d / name)
    (d / "authorized_keys").write_text((d / "client.pub").read_text())
    port = free_port()
    (d / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {d / 'host'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\n"
        "UsePAM no\nStrictModes no\nPidFile none\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
        "AllowTcpForwarding yes\nSubsystem sftp internal-sftp\nLogLevel ERROR\n"
        "MaxStartups 100\nMaxSessions 50\n"
    )
    argv = [SSHD, "-D", "-e", "-f", str(d / "sshd_config")]
    if not os.path.isdir("/run/sshd"):
        script = 'mount -t tmpfs tmpfs /run && mkdir -m 755 /run/sshd && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]
    log = open(d / "sshd.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(argv, stdout=log, stderr=log)
    log.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited: {(d / 'sshd.log').read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                if s.recv(4).startswith(b"SSH-"):
                    break
        except OSError:
            time.sleep(0.05)
    return Sshd(d, port, proc, d / "host", d / "client", d / "other")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    server = _start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        server.proc.terminate()
        try:
            server.proc.wait(5)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
        for pid in server.session_pids():  # per-connection children of our sshd
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _no_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


@pytest.fixture
def known_hosts_file(tmp_path: Path, sshd: Sshd) -> Path:
    path = tmp_path / "known_hosts"
    path.write_text(sshd.known_hosts_line())
    return path


@pytest.fixture
def make_target(tmp_path: Path, sshd: Sshd, known_hosts_file: Path) -> Callable[..., SSHTarget]:
    config = tmp_path / "ssh_config"
    if not config.exists():
        config.write_text("")

    def make(name: str = "node1", **overrides: object) -> SSHTarget:
        base = SSHTarget(
            name=name,
            address="127.0.0.1",
            port=sshd.port,
            user="root",
            identity_file=str(sshd.client_key),
            config_file=str(config),
            known_hosts_file=str(known_hosts_file),
        )
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]

    return make


@pytest.fixture
def sshd_transport() -> Iterator[SSHTransport]:
    t = SSHTransport(connect_timeout=5, transfer_timeout=20)
    try:
        yield t
    finally:
        t.close()


def _error(fn: Callable[[], object]) -> tuple[TransportError, float]:
    start = time.monotonic()
    with pytest.raises(TransportError) as info:
        fn()
    return info.value, time.monotonic() - start


# ---------------------------------------------------------------------- commands


def test_run_returns_output_exit_code_and_duration(sshd_transport, make_target) -> None:
    target = make_target()
    result = sshd_transport.run(target, ["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (result.host, result.exit_code) == ("node1", 3)
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.argv == ("sh", "-c", "echo out; echo err >&2; exit 3")
    assert 0 < result.duration_s < 10
    assert sshd_transport.run(target, ["true"]).ok


NASTY = [
    "two words",
    'it\'s "quoted"',
    "$(touch {marker})",
    "`touch {marker}`",
    "line1\nline2",
    "semi; touch {marker}",
    "$HOME ${{PATH}} \\ * ?",
    "",
]


def test_argv_and_env_arrive_verbatim_and_execute_nothing(sshd_transport, make_target,
                                                           tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    values = [v.format(marker=marker) for v in NASTY]
    env = {f"V{i}": v for i, v in enumerate(values)}
    result = sshd_transport.run(make_target(), ["sh", "-c", 'printf "%s\\0" "$@"', "sh", *values])
    assert result.stdout.split("\0")[:-1] == values
    result = sshd_transport.run(make_target(), ["env", "-0"], env=env)
    seen = dict(item.split("=", 1) for item in result.stdout.split("\0") if "=" in item)
    assert {k: seen[k] for k in env} == env
    assert not marker.exists()


def test_bad_env_name_is_refused_before_connecting(sshd_transport, make_target) -> None:
    error, _ = _error(lambda: sshd_transport.run(make_target(), ["true"], env={"A B": "x"}))
    assert error.kind == "usage"


def test_stdin_is_delivered(sshd_transport, make_target) -> None:
    data = b"hello\n" * 50_000  # more than one SSH window
    result = sshd_transport.run(make_target(), ["wc", "-c"], stdin=data)
    assert result.stdout.strip() == str(len(data))


def test_command_timeout_closes_channel_and_connection_stays_usable(sshd_transport, make_target) -> None:
    target = make_target()
    error, elapsed = _error(lambda: sshd_transport.run(target, ["sleep", "30"], timeout=1))
    assert error.kind == "command-timeout"
    assert error.host == "node1"
    assert elapsed < 10
    assert sshd_transport.run(target, ["echo", "again"]).stdout == "again\n"


def test_connection_is_reused(sshd_transport, make_target, sshd: Sshd) -> None:
    target = make_target()
    before = set(sshd.session_pids())
    for _ in range(3):
        assert sshd_transport.run(target, ["true"]).ok
    assert len(set(sshd.session_pids()) - before) == 1
    sshd_transport.close()
    deadline = time.monotonic() + 5
    while set(sshd.session_pids()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(sshd.session_pids()) - before


# ---------------------------------------------------------------------- host keys


def test_unknown_host_key_is_refused_with_the_opt_in(
    sshd_transport, make_target, known_hosts_file: Path, sshd: Sshd
) -> None:
    known_hosts_file.write_text("")
    error, _ = _error(lambda: sshd_transport.run(make_target(), ["true"]))
    assert error.kind == "hostkey-unknown"
    assert f"[127.0.0.1]:{sshd.port}" in error.message
    assert "--accept-new-host-keys" in (error.hint or "")
    assert known_hosts_file.read_text() == ""


def test_accept_new_adds_the_key_then_proceeds(make_target, known_hosts_file: Path, sshd: Sshd) -> None:
    known_hosts_file.write_text("# mine\n")
    with SSHTransport(connect_timeout=5) as t:
        assert t.run(make_target(accept_new_host_keys=True), ["true"]).ok
    assert known_hosts_file.read_text() == "# mine\n" + sshd.known_hosts_line()
    with SSHTransport(connect_timeout=5) as t:  # now known: no opt-in needed
        assert t.run(make_target(), ["true"]).ok


def test_changed_host_key_is_refused_even_with_accept_new(
    sshd_transport, make_target, known_hosts_file: Path, sshd: Sshd
) -> None:
    other = paramiko.PKey.from_path(str(sshd.other_key))
    stale = f"[127.0.0.1]:{sshd.port} {other.get_name()} {other.get_base64()}\n"
    known_hosts_file.write_text(stale)
    error, _ = _error(lambda: sshd_transport.run(make_target(accept_new_host_keys=True), ["true"]))
    assert error.kind == "hostkey-changed"
    assert "ssh-keygen -R" in (error.hint or "")
    assert known_hosts_file.read_text() == stale


def test_hashed_known_hosts_entries_work(sshd_transport, make_target, known_hosts_file: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(known_hosts_file)], check=True, capture_output=True)
    assert known_hosts_file.read_text().startswith("|1|")
    assert sshd_transport.run(make_target(), ["true"]).ok


# ---------------------------------------------------------------------- connect errors


# Timing bounds are loose on purpose (the CI machine is shared and often loaded); the
# transports below use a 30 s connect/auth timeout, so "< 10 s" proves the failure
# came from the server's answer and not from waiting out a timeout.


def test_wrong_key_fails_auth_quickly(make_target, sshd: Sshd) -> None:
    with SSHTransport(connect_timeout=30) as t:
        error, elapsed = _error(lambda: t.run(make_target(identity_file=str(sshd.other_key)), ["true"]))
    assert error.kind == "auth"
    assert "authorized_keys" in (error.hint or "")
    assert elapsed < 10


def test_missing_identity_file_is_named(sshd_transport, make_target, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    error, _ = _error(lambda: sshd_transport.run(make_target(identity_file=str(missing)), ["true"]))
    assert error.kind == "auth"
    assert str(missing) in error.message


def test_refused_port(make_target) -> None:
    with SSHTransport(connect_timeout=30) as t:
        error, elapsed = _error(lambda: t.run(make_target(port=free_port()), ["true"]))
    assert error.kind == "refused"
    assert elapsed < 10


def test_name_that_does_not_resolve(sshd_transport, make_target) -> None:
    error, _ = _error(lambda: sshd_transport.run(make_target(address="no-such-host.invalid"), ["true"]))
    assert error.kind == "resolve" and error.host == "node1"
    # No host name or address inside the message: seven such hosts fold into one row.
    assert "no-such-host.invalid" not in error.message
    assert error.message.startswith("cannot resolve the host's address")


def test_silent_port_times_out_at_the_banner(make_target) -> None:
    # A listener that accepts but never speaks SSH: the banner timeout must fire.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with SSHTransport(connect_timeout=1) as t:
            error, elapsed = _error(lambda: t.run(make_target(port=port), ["true"]))
    assert error.kind == "timeout"
    assert 0.9 < elapsed < 10
    assert error.message.startswith(f"no SSH banner from port {port} within 1s")


def test_port_that_closes_at_once_is_not_called_a_banner_timeout(make_target) -> None:
    """Issue 25: "no SSH banner within 10s" came 0.7 s after the start, from an address
    that accepted TCP and closed it; the message says what happened, and when."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def close_at_once() -> None:
            # Read the client's banner line first: closing with unread bytes makes the
            # kernel send RST, which the transport reports as "reset" (seen once in CI).
            conn, _ = listener.accept()
            conn.settimeout(5)
            received = b""
            while b"\n" not in received:
                chunk = conn.recv(256)
                if not chunk:
                    break
                received += chunk
            conn.close()

        closer = threading.Thread(target=close_at_once, daemon=True)
        closer.start()
        with SSHTransport(connect_timeout=10) as t:
            error, elapsed = _error(lambda: t.run(make_target(port=port), ["true"]))
        closer.join(5)
    assert elapsed < 5
    assert error.kind == "channel"
    assert error.message.startswith(f"connection to port {port} was closed after "), error.message
    assert "without an SSH banner" in error.message and "within" not in error.message
    assert "not an SSH server" in (error.hint or "")


# ---------------------------------------------------------------------- config + jump


def test_ssh_config_alias_user_port_identity(sshd_transport, make_target, sshd: Sshd, tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host mynode\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n"
        f"  IdentityFile {sshd.client_key}\n"
    )
    target = make_target(address="mynode", port=None, user=None, identity_file=None)
    assert sshd_transport.run(target, ["id", "-u"]).stdout == "0\n"


def test_proxyjump_through_a_bastion(sshd_transport, make_target, sshd: Sshd) -> None:
    target = make_target(proxy_jump=f"root@127.0.0.1:{sshd.port}")
    assert sshd_transport.run(target, ["echo", "via"]).stdout == "via\n"
    assert sshd_transport.run(make_target("node2", proxy_jump=target.proxy_jump), ["true"]).ok


def test_proxyjump_from_ssh_config(sshd_transport, make_target, sshd: Sshd, tmp_path: Path) -> None:
    (tmp_path / "ssh_config").write_text(
        f"Host bastion\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n"
        f"Host inner\n  HostName 127.0.0.1\n  ProxyJump bastion\n"
    )
    target = make_target(address="inner")
    assert sshd_transport.run(target, ["echo", "ok"]).stdout == "ok\n"


def test_errors_behind_the_bastion_are_classified(sshd_transport, make_target, sshd: Sshd) -> None:
    jump = f"root@127.0.0.1:{sshd.port}"
    refused, _ = _error(lambda: sshd_transport.run(make_target(proxy_jump=jump, port=free_port()), ["true"]))
    assert refused.kind == "refused"
    unknown, _ = _error(lambda: sshd_transport.run(make_target(proxy_jump=jump, address="nope.invalid"),
                                                   ["true"]))
    assert unknown.kind == "resolve"
    bad_bastion, _ = _error(
        lambda: sshd_transport.run(make_target(proxy_jump=f"root@127.0.0.1:{free_port()}"), ["true"])
    )
    assert bad_bastion.kind == "refused"
    assert "via jump host" in bad_bastion.message


# ---------------------------------------------------------------------- fan-out


def test_run_all_keeps_order_and_never_stops_at_a_failure(sshd_transport, make_target) -> None:
    targets = [
        make_target("a"),
        make_target("dead", port=free_port()),
        make_target("b"),
        make_target("ghost", address="ghost.invalid"),
        make_target("c"),
    ]
    group = sshd_transport.run_all(targets, ["hostname"], timeout=10, max_parallel=2)
    assert [r.host for r in group] == ["a", "dead", "b", "ghost", "c"]
    assert [r.host for r in group.succeeded] == ["a", "b", "c"]
    assert group["dead"].error is not None and group["dead"].error.kind == "refused"
    assert group["ghost"].error is not None and group["ghost"].error.kind == "resolve"


def test_run_all_per_host_commands(sshd_transport, make_target) -> None:
    targets = [make_target("a"), make_target("b")]
    group = sshd_transport.run_all(targets, {"a": ["echo", "A"], "b": ["echo", "B"]})
    assert [r.result.stdout for r in group if r.result] == ["A\n", "B\n"]


# ---------------------------------------------------------------------- streaming


def test_start_streams_lines_live(sshd_transport, make_target) -> None:
    proc = sshd_transport.start(
        make_target(), ["sh", "-c", 'echo one; echo two >&2; sleep 2; printf "last"; exit 4']
    )
    lines = proc.lines()
    assert next(lines) in {("stdout", "one"), ("stderr", "two")}
    first_seen = time.monotonic()
    rest = list(lines)
    assert {("stdout", "last")} <= set(rest)
    assert proc.wait(10) == 4
    assert time.monotonic() - first_seen > 1.5  # the first line came before the sleep
    assert proc.poll() == 4


def test_start_stdin_and_terminate(sshd_transport, make_target) -> None:
    proc = sshd_transport.start(make_target(), ["cat"])
    proc.write_stdin(b"echoed\n")
    assert next(proc.lines()) == ("stdout", "echoed")
    assert proc.poll() is None
    with pytest.raises(TimeoutError):
        proc.wait(0.1)
    proc.terminate()
    assert proc.wait(5) == -1
    proc2 = sshd_transport.start(make_target(), ["cat"])
    proc2.write_stdin(b"x\n")
    proc2.close_stdin()
    assert list(proc2.lines()) == [("stdout", "x")]
    assert proc2.wait(5) == 0


def test_dropped_connection_ends_process_with_minus_one(sshd_transport, make_target, sshd: Sshd) -> None:
    target = make_target()
    before = set(sshd.session_pids())
    proc = sshd_transport.start(target, ["sleep", "30"])
    for pid in set(sshd.session_pids()) - before:  # the sshd serving our connection
        os.kill(pid, signal.SIGKILL)
    assert proc.wait(10) == -1
    assert proc.dropped  # type: ignore[attr-defined]
    # The next call notices the dead cached connection and reconnects.
    assert sshd_transport.run(target, ["true"]).ok


# ---------------------------------------------------------------------- files


def test_put_get_roundtrip_and_helpers(sshd_transport, make_target, tmp_path: Path) -> None:
    target = make_target()
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    src.chmod(0o640)
    remote_dir = tmp_path / "remote" / "deep"
    sshd_transport.makedirs(target, str(remote_dir))
    sshd_transport.put(target, str(src), str(remote_dir / "shard.bin"))
    assert (remote_dir / "shard.bin").read_bytes() == src.read_bytes()
    assert (remote_dir / "shard.bin").stat().st_mode & 0o777 == 0o640
    assert sshd_transport.listdir(target, str(remote_dir)) == ["shard.bin"]  # no temp left
    st = sshd_transport.stat(target, str(remote_dir / "shard.bin"))
    assert st is not None and (st.size, st.is_dir, st.mode) == (300_000, False, 0o640)
    assert sshd_transport.stat(target, str(remote_dir / "missing")) is None
    dir_stat = sshd_transport.stat(target, str(remote_dir))
    assert dir_stat is not None and dir_stat.is_dir
    import hashlib

    expected = hashlib.sha256(src.read_bytes()).hexdigest()
    assert sshd_transport.sha256(target, str(remote_dir / "shard.bin")) == expected
    back = tmp_path / "back.bin"
    sshd_transport.get(target, str(remote_dir / "shard.bin"), str(back))
    assert back.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_put_replaces_atomically(sshd_transport, make_target, tmp_path: Path) -> None:
    target = make_target()
    dest = tmp_path / "dest"
    dest.write_bytes(b"old" * 1000)
    src = tmp_path / "src"
    src.write_bytes(b"new" * 1000)
    with open(dest, "rb") as reader:  # a reader holding the old file sees it whole
        sshd_transport.put(target, str(src), str(dest))
        assert reader.read() == b"old" * 1000
    assert dest.read_bytes() == b"new" * 1000


def test_failed_put_leaves_destination_and_no_temp(
    sshd_transport, make_target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = make_target()
    dest = tmp_path / "dest"
    dest.write_bytes(b"old")
    src = tmp_path / "src"
    src.write_bytes(b"new")

    def boom(self: paramiko.SFTPClient, path: str, mode: int) -> None:
        raise PermissionError(13, "injected")

    monkeypatch.setattr(paramiko.SFTPClient, "chmod", boom)
    error, _ = _error(lambda: sshd_transport.put(target, str(src), str(dest)))
    assert error.kind == "file"
    assert dest.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["dest", "src", "known_hosts", "ssh_config"])


def test_file_errors(sshd_transport, make_target, tmp_path: Path) -> None:
    target = make_target()
    src = tmp_path / "src"
    src.write_text("x")
    error, _ = _error(lambda: sshd_transport.put(target, str(src), str(tmp_path / "no" / "dir")))
    assert error.kind == "file" and error.host == "node1"
    error, _ = _error(lambda: sshd_transport.get(target, str(tmp_path / "missing"), str(tmp_path / "x")))
    assert error.kind == "file"
    assert not (tmp_path / "x").exists()
    error, _ = _error(lambda: sshd_transport.sha256(target, str(tmp_path / "missing")))
    assert error.kind == "file"
    error, _ = _error(lambda: sshd_transport.listdir(target, str(tmp_path / "missing")))
    assert error.kind == "file"


def test_host_key_known_only_in_a_global_known_hosts_file_is_trusted(
        sshd_transport, make_target, sshd: Sshd, tmp_path: Path) -> None:
    """Clusters often ship host keys in /etc/ssh/ssh_known_hosts (GlobalKnownHostsFile)."""
    empty = tmp_path / "user_known_hosts"
    empty.write_text("")
    global_file = tmp_path / "global_known_hosts"
    global_file.write_text(sshd.known_hosts_line())
    config = tmp_path / "global-ssh-config"
    config.write_text(f"Host *\n  GlobalKnownHostsFile {global_file}\n")
    target = make_target(known_hosts_file=str(empty), config_file=str(config))
    assert sshd_transport.run(target, ["true"]).exit_code == 0
    assert empty.read_text() == ""  # trusted there, never copied into the user's file
