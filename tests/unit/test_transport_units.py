"""Pure pieces of the transport: quoting, ssh_config resolution, fan-out, line splitting."""

from __future__ import annotations

import shlex
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clusterkit.errors import TransportError
from clusterkit.remote import fanout
from clusterkit.remote.base import CommandResult, SSHTarget
from clusterkit.remote.command import remote_command
from clusterkit.remote.sshconfig import ConfigCache, parse_jump_hop, resolve
from clusterkit.remote.streams import LineQueue

words = st.text(st.characters(blacklist_characters="\0"), max_size=20)


@given(
    st.lists(words, min_size=1, max_size=5),
    st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), words, max_size=3),
)
def test_remote_command_round_trips_through_a_posix_shell_parser(
    argv: list[str], env: dict[str, str]
) -> None:
    parsed = shlex.split(remote_command(argv, env))
    if env:
        assert parsed[0] == "env"
        assert parsed[1 : 1 + len(env)] == [f"{k}={v}" for k, v in env.items()]
        parsed = parsed[1 + len(env) :]
    assert parsed == argv


def test_remote_command_quotes_once() -> None:
    assert remote_command(["echo", "a b", "$(x)"]) == "echo 'a b' '$(x)'"
    assert remote_command(["true"], {"K": "v w"}) == "env 'K=v w' true"


def test_parse_jump_hop_forms() -> None:
    assert parse_jump_hop("bastion", "h") == (None, "bastion", None)
    assert parse_jump_hop("me@bastion:2222", "h") == ("me", "bastion", 2222)
    assert parse_jump_hop("ssh://me@bastion:2200", "h") == ("me", "bastion", 2200)
    assert parse_jump_hop("[fe80::1]:22", "h") == (None, "fe80::1", 22)
    with pytest.raises(TransportError) as info:
        parse_jump_hop("b:notaport", "h")
    assert info.value.kind == "config"


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return str(path)


def test_resolve_uses_config_and_explicit_fields_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    cfg = _config(
        tmp_path,
        "Host n1\n  HostName 10.0.0.1\n  User alice\n  Port 2200\n  IdentityFile ~/k1\n"
        "  ProxyJump bob@jump:2022,gw\n  UserKnownHostsFile /tmp/kh1 /tmp/kh2\n"
        "  StrictHostKeyChecking accept-new\n",
    )
    ep = resolve(ConfigCache(), SSHTarget(name="node-1", address="n1", config_file=cfg))
    assert (ep.hostname, ep.port, ep.user) == ("10.0.0.1", 2200, "alice")
    assert ep.identity_files[0].endswith("/k1")
    assert ep.known_hosts_file == "/tmp/kh1"
    assert ep.accept_new_host_keys
    assert ep.hostkey_name == "[10.0.0.1]:2200"
    assert ep.jump is not None
    assert (ep.jump.address, ep.jump.user, ep.jump.port) == ("gw", None, None)
    assert ep.jump.proxy_jump == "bob@jump:2022"  # earlier hops ride along
    explicit = SSHTarget(
        name="x", address="n1", user="root", port=22, config_file=cfg, identity_file="/id", proxy_jump="none"
    )
    ep = resolve(ConfigCache(), explicit)
    assert (ep.user, ep.port, ep.hostkey_name, ep.jump) == ("root", 22, "10.0.0.1", None)
    assert ep.identity_files[0] == "/id"


def test_resolve_refuses_proxycommand_and_missing_explicit_config(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "Host n1\n  ProxyCommand nc %h %p\n")
    with pytest.raises(TransportError) as info:
        resolve(ConfigCache(), SSHTarget(name="n1", address="n1", config_file=cfg))
    assert info.value.kind == "config" and "ProxyJump" in (info.value.hint or "")
    with pytest.raises(TransportError) as info:
        resolve(ConfigCache(), SSHTarget(name="n1", address="n1", config_file=str(tmp_path / "missing")))
    assert info.value.kind == "config"


def _ok(target: SSHTarget) -> CommandResult:
    return CommandResult(target.name, ("true",), 0, "", "", 0.0)


def test_fan_out_deadline_never_joins_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "_SLACK_S", 0.0)
    release = threading.Event()

    def work(target: SSHTarget) -> CommandResult:
        if target.name == "stuck":
            release.wait(30)  # ignores its own timeouts: the overall deadline must cut in
        if target.name == "boom":
            raise RuntimeError("unexpected")
        return _ok(target)

    targets = [SSHTarget(n, n) for n in ("a", "stuck", "boom", "b")]
    start = time.monotonic()
    group = fanout.fan_out(targets, work, per_host_budget_s=0.5, max_parallel=8)
    release.set()
    assert time.monotonic() - start < 3
    assert [r.host for r in group] == ["a", "stuck", "boom", "b"]
    assert [r.ok for r in group] == [True, False, False, True]
    assert group["stuck"].error is not None and group["stuck"].error.kind == "timeout"
    assert group["boom"].error is not None and "unexpected" in group["boom"].error.message


def test_fan_out_bounds_concurrency() -> None:
    running = 0
    peak = 0
    lock = threading.Lock()

    def work(target: SSHTarget) -> CommandResult:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return _ok(target)

    targets = [SSHTarget(f"h{i}", "x") for i in range(12)]
    group = fanout.fan_out(targets, work, per_host_budget_s=5, max_parallel=3)
    assert len(group.succeeded) == 12 and peak <= 3
    assert fanout.fan_out([], work, per_host_budget_s=1, max_parallel=3).results == ()


def test_line_queue_splits_across_chunks_and_flushes_partial_lines() -> None:
    q = LineQueue()
    q.feed("stdout", b"hel")
    q.feed("stdout", b"lo\nwor")
    q.feed("stderr", "é\r\n".encode()[:1])  # a UTF-8 sequence split across reads
    q.feed("stderr", "é\r\n".encode()[1:])
    q.close("stdout")
    q.close("stderr")
    assert list(q.lines()) == [("stdout", "hello"), ("stderr", "é"), ("stdout", "wor")]
    assert list(q.lines()) == []  # a second iteration ends at once


def test_match_exec_is_refused_only_where_it_would_run(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 'Match host other exec "false"\n  User x\nHost n1\n  User y\n')
    assert resolve(ConfigCache(), SSHTarget(name="n1", address="n1", config_file=cfg)).user == "y"
    cfg = _config(tmp_path, 'Match host n1 exec "true"\n  User x\n')
    with pytest.raises(TransportError, match="`Match exec` is not supported") as info:
        resolve(ConfigCache(), SSHTarget(name="n1", address="n1", config_file=cfg))
    assert info.value.kind == "config" and info.value.host == "n1"
