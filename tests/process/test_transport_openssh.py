"""The OpenSSH fan-out (clusterkit/remote/openssh.py) without a test bed: its command
line, its reading of ssh's failures, and a stand-in ``ssh`` that runs the command here.

The test bed runs the real client: tests/bed/test_doctor_testbed.py (every doctor fault) and
tests/bed/test_transport_testbed.py.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from clusterkit.errors import TransportError
from clusterkit.remote.base import SSHTarget
from clusterkit.remote.local import LocalTransport
from clusterkit.remote.openssh import (
    FAST_KEX,
    OpenSSHTransport,
    _head_syntax_supported,
    classify_failure,
    with_openssh,
)

TARGET = SSHTarget(name="node3", address="10.0.0.3", user="root", port=22,
                   identity_file="/k/id", known_hosts_file="/k/known_hosts")

# A stand-in for ssh: announces the login like LogLevel=VERBOSE, then runs the command
# (the last argument, already quoted once) with sh, as sshd's login shell would.
FAKE_SSH = """#!/bin/sh
[ "$1" = "-G" ] && exit 0  # the one-time KexAlgorithms=^ syntax check
for last; do :; done
case "$FAKE_SSH_MODE" in
  refuse) echo "ssh: connect to host 10.0.0.3 port 22: Connection refused" >&2; exit 255;;
  hang) sleep 30; exit 255;;
  count) touch "$FAKE_SSH_DIR/$$"; ls "$FAKE_SSH_DIR" | wc -l >> "$FAKE_SSH_LOG"; sleep 0.2
         rm "$FAKE_SSH_DIR/$$";;
esac
echo 'Authenticated to 10.0.0.3 ([10.0.0.3]:22) using "publickey".' >&2
sh -c "$last"
code=$?
echo "Transferred: sent 1, received 2 bytes, in 0.0 seconds" >&2
exit $code
"""


@pytest.fixture
def fake_ssh(tmp_path: Path) -> str:
    path = tmp_path / "ssh"
    path.write_text(FAKE_SSH)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _openssh_transport(ssh: str, timeout: float = 2.0) -> OpenSSHTransport:
    return OpenSSHTransport(LocalTransport(), ssh=ssh, connect_timeout=timeout)


def test_argv_carries_the_targets_options_and_our_policy(tmp_path: Path) -> None:
    t = OpenSSHTransport(LocalTransport(), ssh="ssh", connect_timeout=2.5)
    argv = t.argv(TARGET, "echo hi")
    assert argv[:4] == ["ssh", "-T", "-x", "-a"]
    assert argv[-3:] == ["--", "10.0.0.3", "echo hi"]
    opts = [argv[i + 1] for i, w in enumerate(argv) if w == "-o"]
    for want in ("BatchMode=yes", "StrictHostKeyChecking=yes", "ConnectTimeout=3",
                 "LogLevel=VERBOSE", "User=root", "Port=22", "IdentityFile=/k/id",
                 "UserKnownHostsFile=/k/known_hosts"):
        assert want in opts


def test_accept_new_host_keys_replaces_strict_checking() -> None:
    from dataclasses import replace

    argv = _openssh_transport("ssh").argv(replace(TARGET, accept_new_host_keys=True), "true")
    opts = [argv[i + 1] for i, w in enumerate(argv) if w == "-o"]
    assert "StrictHostKeyChecking=accept-new" in opts
    assert "StrictHostKeyChecking=yes" not in opts


@pytest.mark.skipif(not _head_syntax_supported("ssh"), reason="ssh older than 8.7 / missing")
def test_fast_kex_first_unless_the_config_chooses(tmp_path: Path) -> None:
    from dataclasses import replace

    plain = tmp_path / "plain"
    plain.write_text("Host *\n  User root\n")
    chosen = tmp_path / "chosen"
    chosen.write_text("Host 10.0.0.*\n  KexAlgorithms ecdh-sha2-nistp256\n")
    t = _openssh_transport("ssh")
    assert f"KexAlgorithms=^{FAST_KEX}" in t.argv(replace(TARGET, config_file=str(plain)), "x")
    assert not any(w.startswith("KexAlgorithms")
                   for w in t.argv(replace(TARGET, config_file=str(chosen)), "x"))


# Real OpenSSH 9.2 messages (stderr of ssh -o LogLevel=VERBOSE, exit 255).
MESSAGES = {
    "refused": "ssh: connect to host 10.213.1.13 port 2222: Connection refused\n",
    "resolve": "ssh: Could not resolve hostname nosuch: Name or service not known\n",
    "timeout": "ssh: connect to host 10.213.1.250 port 22: Connection timed out\n",
    "hostkey-unknown": "No ED25519 host key is known for 10.213.1.13 and you have requested "
                       "strict checking.\nHost key verification failed.\n",
    "hostkey-changed": "@@@@@@@@@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n"
                       "@@@@@@@@@@@\nIT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!\n"
                       "Host key for 10.213.1.13 has changed and you have requested strict "
                       "checking.\nHost key verification failed.\n",
    "auth": "root@10.213.1.13: Permission denied (publickey).\n",
    "channel": "kex_exchange_identification: read: Connection reset by peer\n"
               "Connection reset by 10.213.1.13 port 22\n",
}


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_ssh_failures_map_to_the_transports_kinds(kind: str) -> None:
    err = classify_failure(MESSAGES[kind], TARGET, 2.0)
    assert err.kind == kind
    assert err.host == "node3"
    assert "10.213" not in err.message  # equal failures on many hosts fold into one row
    assert err.hint


def test_unreachable_is_a_timeout_kind_like_paramiko() -> None:
    err = classify_failure("ssh: connect to host 10.0.0.9 port 22: No route to host\n",
                           TARGET, 2.0)
    assert (err.kind, err.message) == ("timeout", "port 22 is unreachable (No route to host)")


def test_timeout_message_names_the_connect_timeout() -> None:
    assert "within 2s" in classify_failure(MESSAGES["timeout"], TARGET, 2.0).message


def test_banner_timeout_is_not_called_no_answer() -> None:
    """Issue 25: say what happened. OpenSSH 9.2 on an address whose TCP port accepts but
    sends no banner: "Connection timed out during banner exchange"."""
    err = classify_failure("Connection timed out during banner exchange\n"
                           "Connection to 10.255.255.1 port 22 timed out\n", TARGET, 5.0)
    assert err.kind == "timeout"
    assert err.message == ("no SSH banner from port 22 within 5s (the TCP connection was "
                           "accepted)")
    assert classify_failure(MESSAGES["timeout"], TARGET, 5.0).message == \
        "no answer from port 22 within 5s"


def test_unknown_message_is_kept() -> None:
    err = classify_failure("ssh: something new\n", TARGET, 2.0)
    assert (err.kind, err.message) == ("ssh", "ssh failed: ssh: something new")


def test_run_passes_stdin_output_and_exit_code(fake_ssh: str) -> None:
    seen: list[float] = []
    res = _openssh_transport(fake_ssh).run_connected(
        TARGET, ["sh", "-c", "cat; echo oops >&2; exit 3"], stdin=b"x" * 300_000,
        on_connected=lambda: seen.append(time.monotonic()))
    assert (res.exit_code, len(res.stdout), res.stderr) == (3, 300_000, "oops\n")
    assert len(seen) == 1  # the login line, once


def test_exit_255_after_login_is_the_commands(fake_ssh: str) -> None:
    res = _openssh_transport(fake_ssh).run(TARGET, ["sh", "-c", "exit 255"])
    assert res.exit_code == 255


def test_env_is_quoted_into_the_remote_command(fake_ssh: str) -> None:
    res = _openssh_transport(fake_ssh).run(TARGET, ["sh", "-c", 'printf %s "$X"'], env={"X": "a b $(y)"})
    assert res.stdout == "a b $(y)"


def test_failure_before_login_raises_its_kind(fake_ssh: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_SSH_MODE", "refuse")
    with pytest.raises(TransportError) as exc:
        _openssh_transport(fake_ssh).run(TARGET, ["true"])
    assert exc.value.kind == "refused"


def test_command_timeout_kills_ssh(fake_ssh: str) -> None:
    started = time.monotonic()
    with pytest.raises(TransportError) as exc:
        _openssh_transport(fake_ssh).run(TARGET, ["sleep", "30"], timeout=0.5)
    assert exc.value.kind == "command-timeout"
    assert time.monotonic() - started < 10


def test_setup_timeout_when_the_login_never_comes(fake_ssh: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_SSH_MODE", "hang")
    with pytest.raises(TransportError) as exc:
        _openssh_transport(fake_ssh, timeout=0.25).run(TARGET, ["true"], timeout=60)
    assert exc.value.kind == "timeout"
    assert "set-up" in exc.value.message


def test_fan_out_returns_one_result_per_host_in_order(fake_ssh: str) -> None:
    from dataclasses import replace

    targets = [replace(TARGET, name=f"n{i}") for i in range(12)]
    group = _openssh_transport(fake_ssh).run_all(targets, ["echo", "ok"], max_parallel=4)
    assert [r.host for r in group] == [t.name for t in targets]
    assert all(r.result is not None and r.result.stdout == "ok\n" for r in group)


def test_start_streams_and_terminates(fake_ssh: str) -> None:
    proc = _openssh_transport(fake_ssh).start(TARGET, ["sh", "-c", "echo ready; sleep 30"])
    first = next(line for stream, line in proc.lines() if stream == "stdout")
    assert first.strip() == "ready"
    proc.terminate()
    assert proc.wait(5) != 0


def test_local_targets_use_the_wrapped_transport(fake_ssh: str) -> None:
    from dataclasses import replace

    res = _openssh_transport("/nonexistent/ssh").run(replace(TARGET, local=True), ["echo", "here"])
    assert res.stdout == "here\n"


def test_with_openssh_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    base = LocalTransport()
    monkeypatch.setenv("CLUSTERKIT_SSH_CLIENT", "paramiko")
    assert with_openssh(base) is base
    monkeypatch.setenv("CLUSTERKIT_SSH_CLIENT", "")
    monkeypatch.setenv("PATH", os.devnull)
    assert with_openssh(base) is base  # no ssh installed


def test_at_most_max_handshakes_logins_at_once(fake_ssh: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    (tmp_path / "in-setup").mkdir()
    log = tmp_path / "log"
    monkeypatch.setenv("FAKE_SSH_MODE", "count")
    monkeypatch.setenv("FAKE_SSH_DIR", str(tmp_path / "in-setup"))
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    t = OpenSSHTransport(LocalTransport(), ssh=fake_ssh, connect_timeout=5, max_handshakes=2)
    targets = [replace(TARGET, name=f"n{i}") for i in range(8)]
    # The commands overlap (all 8 sleep at once after their login); the logins do not.
    group = t.run_all(targets, ["sleep", "0.5"], max_parallel=8)
    assert len(group.succeeded) == 8
    counts = [int(line) for line in log.read_text().split()]
    assert len(counts) == 8 and max(counts) <= 2
