"""Commands over the system OpenSSH client (``ssh``): the fast path of doctor's fan-out.

Why: on a small launcher, paramiko's handshake is Python work in the launcher's
own process (~0.08 s of CPU per node, serialised by the GIL) and importing it
costs 0.2–0.8 s; ``ssh`` does the same in C, in its own process, and with
curve25519 key exchange first it needs ~0.02 s of CPU per connection (OpenSSH
9's default ``sntrup761x25519`` costs ~0.1 s of client CPU). Measured in
docs/doctor.md ("Measured").

The host is reached exactly as the paramiko transport reaches it: the target's
own fields are the one ssh_config mapping (:meth:`SSHTarget.options`), passed as
``-o``, and ``ssh`` reads ``-F config_file`` or ``~/.ssh/config`` and
``/etc/ssh/ssh_config`` itself — the resolution :mod:`clusterkit.remote.sshconfig`
imitates (``ssh -G`` is its oracle). Policy is paramiko's: key authentication
only (``BatchMode``), known_hosts enforced unless the target accepts new keys.

Only ``run`` and ``start`` go through ``ssh``; files (SFTP) and local targets go
to the wrapped transport. Failures become the same :class:`TransportError`
kinds as paramiko's (refused, timeout, resolve, auth, hostkey-unknown,
hostkey-changed, channel, command-timeout), read from ssh's messages.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from clusterkit.errors import TransportError
from clusterkit.remote.base import (
    DEFAULT_COMMAND_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_PARALLEL,
    CommandResult,
    FileStat,
    GroupResult,
    RemoteProcess,
    SSHTarget,
    Transport,
)
from clusterkit.remote.command import check_argv, check_env, remote_command
from clusterkit.remote.fanout import run_all
from clusterkit.remote.local import LocalProcess
from clusterkit.remote.sshconfig import ConfigCache, lookup

# Key exchange tried first when the user's ssh config does not choose one: classic
# X25519, no post-quantum KEM (its key generation is most of ssh's client CPU).
FAST_KEX = "curve25519-sha256,curve25519-sha256@libssh.org"
SERVER_ALIVE_S = 5  # like the paramiko transport's keepalive
# ssh -o LogLevel=VERBOSE says this once the login succeeded: the command goes out now.
_AUTHENTICATED = "Authenticated to "
# Lines LogLevel=VERBOSE (or accept-new) adds that are not the command's stderr.
_OUR_NOISE = (_AUTHENTICATED, "Transferred: sent ", "Bytes per second: ",
              "Warning: Permanently added ")
_DROPPED = re.compile(r"^(Connection to .* closed by remote host|client_loop: |"
                      r"Timeout, server .* not responding|packet_write_wait: |Broken pipe)")
_READ = 65536
# SSH logins in progress at once (connect, key exchange, authentication); commands
# after the login all run in parallel. The set-up is the CPU burst on both ends (sshd
# re-executes itself per connection); 128 at once on a loaded machine made sshd miss
# the 10 s banner timeout on half the nodes, which pdsh's fan-out of 32 never did.
MAX_HANDSHAKES = 32


class OpenSSHTransport:
    """:class:`~clusterkit.remote.base.Transport` whose commands run through ``ssh``."""

    def __init__(self, fallback: Transport, *, ssh: str = "ssh",
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 max_handshakes: int = MAX_HANDSHAKES) -> None:
        self.fallback = fallback
        self.client = ssh
        self.connect_timeout = connect_timeout
        self._configs = ConfigCache()
        self._handshakes = threading.BoundedSemaphore(max(1, max_handshakes))

    @property
    def connect_budget_s(self) -> float:
        """Worst case before the command starts: TCP + banner (ConnectTimeout), kex, auth."""
        return 4 * self.connect_timeout

    def argv(self, target: SSHTarget, command: str) -> list[str]:
        """The ``ssh`` command line for ``command`` (already quoted once) on ``target``."""
        extra = {"LogLevel": "VERBOSE"}  # "Authenticated to": the login is done
        if self._fast_kex_allowed(target):
            extra["KexAlgorithms"] = f"^{FAST_KEX}"
        return openssh_argv(target, command, client=self.client,
                            connect_timeout=self.connect_timeout, extra=extra)

    def _fast_kex_allowed(self, target: SSHTarget) -> bool:
        # A site that lists KexAlgorithms in its ssh config keeps its list (-o would win).
        try:
            chosen = "kexalgorithms" in lookup(self._configs, target)
        except TransportError:
            chosen = True  # ssh itself will report the config problem
        return not chosen and _head_syntax_supported(self.client)

    # ------------------------------------------------------------------ commands

    def run(self, target: SSHTarget, argv: Sequence[str], *,
            timeout: float = DEFAULT_COMMAND_TIMEOUT_S, env: Mapping[str, str] | None = None,
            stdin: bytes | None = None) -> CommandResult:
        return self.run_connected(target, argv, timeout=timeout, env=env, stdin=stdin)

    def run_connected(self, target: SSHTarget, argv: Sequence[str], *,
                      timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
                      env: Mapping[str, str] | None = None, stdin: bytes | None = None,
                      on_connected: Callable[[], None] | None = None) -> CommandResult:
        """``run``, calling ``on_connected`` once the login succeeded (the command is sent
        then): doctor's clock window and set-up time start there, as with paramiko."""
        if target.local:
            if on_connected is not None:
                on_connected()
            return self.fallback.run(target, argv, timeout=timeout, env=env, stdin=stdin)
        words = check_argv(argv, target.name)
        command = remote_command(words, check_env(env, target.name))
        started = time.monotonic()
        slot = _Slot(self._handshakes)  # the set-up deadline starts once we have one
        try:
            proc = _spawn(self.argv(target, command), stdin is not None)
            session = _Session(proc, target, stdin or b"", slot.then(on_connected),
                               self.connect_timeout)
            code, out, err = session.communicate(self.connect_budget_s, timeout)
        finally:
            slot.release()
        return CommandResult(host=target.name, argv=words, exit_code=code,
                             stdout=out.decode("utf-8", "replace"),
                             stderr=err, duration_s=time.monotonic() - started)

    def run_all(self, targets: Sequence[SSHTarget],
                argv: Sequence[str] | Mapping[str, Sequence[str]], *,
                timeout: float = DEFAULT_COMMAND_TIMEOUT_S, env: Mapping[str, str] | None = None,
                max_parallel: int = DEFAULT_MAX_PARALLEL,
                stdin: bytes | None = None) -> GroupResult:
        return run_all(self, targets, argv, timeout=timeout, env=env, max_parallel=max_parallel,
                       stdin=stdin, connect_budget_s=self.connect_budget_s)

    def start(self, target: SSHTarget, argv: Sequence[str], *,
              env: Mapping[str, str] | None = None) -> RemoteProcess:
        """A streamed command; ``terminate`` ends the local ``ssh``, which closes the
        channel (the remote command sees its stdout go away)."""
        if target.local:
            return self.fallback.start(target, argv, env=env)
        words = check_argv(argv, target.name)
        command = remote_command(words, check_env(env, target.name))
        return LocalProcess(target.name, _spawn(self.argv(target, command), True))

    # ------------------------------------------------------------------ files: the fallback's

    def put(self, target: SSHTarget, local_path: str, remote_path: str) -> None:
        self.fallback.put(target, local_path, remote_path)

    def get(self, target: SSHTarget, remote_path: str, local_path: str) -> None:
        self.fallback.get(target, remote_path, local_path)

    def stat(self, target: SSHTarget, path: str) -> FileStat | None:
        return self.fallback.stat(target, path)

    def listdir(self, target: SSHTarget, path: str) -> list[str]:
        return self.fallback.listdir(target, path)

    def makedirs(self, target: SSHTarget, path: str) -> None:
        self.fallback.makedirs(target, path)

    def sha256(self, target: SSHTarget, path: str, *, timeout: float = 600.0) -> str:
        return self.fallback.sha256(target, path, timeout=timeout)

    def close(self) -> None:
        self.fallback.close()


def openssh_argv(target: SSHTarget, command: str, *, client: str = "ssh",
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 extra: Mapping[str, str] | None = None) -> list[str]:
    """The one ``ssh`` command line for ``command`` (quoted once already) on ``target``.

    Every OpenSSH user in clusterkit builds its argv here (doctor's fan-out, collect's
    per-node sessions): key logins only, known_hosts enforced, connect and keepalive
    timeouts, then the caller's ``extra`` options, then the target's own fields (the one
    ssh_config mapping, :meth:`SSHTarget.options`, which paramiko and pdsh use too).
    ``-o`` is first-value-wins like ssh_config, so one dict keeps each keyword once;
    ssh then reads ``-F config_file`` or ~/.ssh/config and /etc/ssh/ssh_config itself.
    """
    opts = {"BatchMode": "yes", "StrictHostKeyChecking": "yes",
            "ConnectTimeout": str(max(1, math.ceil(connect_timeout))),
            "ServerAliveInterval": str(SERVER_ALIVE_S), "ServerAliveCountMax": "4",
            **(extra or {}), **target.options()}
    words = [client, "-T", "-x", "-a"]
    if target.config_file:
        words += ["-F", target.config_file]
    for key, value in opts.items():
        words += ["-o", f"{key}={value}"]
    return [*words, "--", target.address, command]


def with_openssh(transport: Transport, *,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> Transport:
    """``transport`` with its commands over the system ``ssh`` when one is installed
    (``$CLUSTERKIT_SSH_CLIENT=paramiko`` keeps paramiko for everything)."""
    if os.environ.get("CLUSTERKIT_SSH_CLIENT", "").lower() == "paramiko":
        return transport
    ssh = shutil.which("ssh")
    if ssh is None:
        return transport
    return OpenSSHTransport(transport, ssh=ssh, connect_timeout=connect_timeout)


_HEAD_SYNTAX: dict[str, bool] = {}
_HEAD_SYNTAX_LOCK = threading.Lock()


def _head_syntax_supported(ssh: str) -> bool:
    """``KexAlgorithms=^...`` (put these first, keep the defaults) exists since OpenSSH 8.7;
    an older ssh rejects the option, so ask this one once (under a lock: every fan-out
    thread asks at the same moment)."""
    with _HEAD_SYNTAX_LOCK:
        if ssh not in _HEAD_SYNTAX:
            _HEAD_SYNTAX[ssh] = _ask_head_syntax(ssh)
        return _HEAD_SYNTAX[ssh]


def _ask_head_syntax(ssh: str) -> bool:
    try:
        res = subprocess.run([ssh, "-G", "-F", "/dev/null", "-o", f"KexAlgorithms=^{FAST_KEX}",
                              "localhost"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0


class _Slot:
    """One of the handshake slots, given back once: at the login, or when ssh ends."""

    def __init__(self, pool: threading.BoundedSemaphore) -> None:
        pool.acquire()
        self._pool: threading.BoundedSemaphore | None = pool
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.release()

    def then(self, callback: Callable[[], None] | None) -> Callable[[], None]:
        def connected() -> None:
            self.release()
            if callback is not None:
                callback()
        return connected


def _spawn(argv: list[str], with_stdin: bool) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(argv, stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)  # a Ctrl-C reaches us, not 128 ssh's
    except OSError as exc:
        raise TransportError(f"cannot start {argv[0]}: {exc.strerror}", kind="config") from exc


class _Session:
    """One ``ssh`` process: feed stdin, collect stdout/stderr, notice the login, enforce
    the set-up and command deadlines, and classify ssh's own failures."""

    def __init__(self, proc: subprocess.Popen[bytes], target: SSHTarget, stdin: bytes,
                 on_connected: Callable[[], None] | None, connect_timeout: float) -> None:
        self.proc = proc
        self.connect_timeout = connect_timeout
        self.target = target
        self.pending = memoryview(stdin)
        self.on_connected = on_connected
        self.connected_at: float | None = None
        self.out = bytearray()
        self.err = bytearray()
        self.setup_s = 0.0

    def communicate(self, setup_s: float, timeout: float) -> tuple[int, bytes, str]:
        self.setup_s = setup_s
        sel = selectors.DefaultSelector()
        try:
            self._register(sel)
            self._loop(sel, time.monotonic() + setup_s, timeout)
        finally:
            sel.close()
            _reap(self.proc)
        code = self.proc.returncode
        err = _clean_stderr(self.err.decode("utf-8", "replace"))
        if code == 255:
            self._raise_if_ssh_failed(err)
        return code, bytes(self.out), err

    def _register(self, sel: selectors.BaseSelector) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        sel.register(self.proc.stdout, selectors.EVENT_READ, self.out)
        sel.register(self.proc.stderr, selectors.EVENT_READ, self.err)
        if self.proc.stdin is not None:
            os.set_blocking(self.proc.stdin.fileno(), False)
            if self.pending:
                sel.register(self.proc.stdin, selectors.EVENT_WRITE)
            else:
                self.proc.stdin.close()

    def _loop(self, sel: selectors.BaseSelector, setup_deadline: float, timeout: float) -> None:
        while sel.get_map():
            deadline = (setup_deadline if self.connected_at is None
                        else self.connected_at + timeout)
            left = deadline - time.monotonic()
            if left <= 0:
                self._expire(timeout)
            for key, _ in sel.select(min(left, 1.0)):
                if key.events & selectors.EVENT_WRITE:
                    self._write(sel, key.fileobj)
                else:
                    self._read(sel, key)

    def _write(self, sel: selectors.BaseSelector, pipe: Any) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            sent = os.write(stdin.fileno(), self.pending[:_READ])
        except BlockingIOError:
            return
        except OSError:  # ssh gave up reading: its own message says why
            sent = len(self.pending)
        self.pending = self.pending[sent:]
        if not self.pending:
            sel.unregister(pipe)
            with contextlib.suppress(OSError):
                stdin.close()

    def _read(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        data = os.read(key.fileobj.fileno(), _READ)  # type: ignore[union-attr]
        if not data:
            sel.unregister(key.fileobj)
            return
        key.data.extend(data)
        if key.data is self.out:
            self._mark_connected()  # output means the login happened
        elif self.connected_at is None and _AUTHENTICATED.encode() in self.err:
            self._mark_connected()

    def _mark_connected(self) -> None:
        if self.connected_at is None:
            self.connected_at = time.monotonic()
            if self.on_connected is not None:
                self.on_connected()

    def _expire(self, timeout: float) -> None:
        _kill(self.proc)
        if self.connected_at is None:
            raise TransportError(
                f"SSH connection set-up (TCP, key exchange, login) did not finish within "
                f"{self.setup_s:.0f}s", kind="timeout", host=self.target.name,
                hint="the host or its sshd is overloaded (MaxStartups), or the network drops "
                     "packets")
        raise TransportError(f"command did not finish within {timeout:g}s (ssh killed)",
                             kind="command-timeout", host=self.target.name,
                             hint="raise the timeout, or check the command by hand on that host")

    def _raise_if_ssh_failed(self, err: str) -> None:
        """Exit 255 is ssh's own failure — or the command's exit 255: tell them apart."""
        lines = [line for line in err.splitlines() if line.strip()]
        if self.connected_at is not None:
            if lines and _DROPPED.match(lines[-1]):
                raise TransportError(f"connection dropped ({lines[-1].strip()})", kind="channel",
                                     host=self.target.name,
                                     hint="the host rebooted, sshd restarted, or the network "
                                          "went away; retry")
            return  # the command itself exited 255
        raise classify_failure(err, self.target, self.connect_timeout)


# ssh's messages before the login, in the order they are tested: (words, kind).
_FAILURES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("remote host identification has changed", "has changed and you have requested"),
     "hostkey-changed"),
    (("host key verification failed", "host key is known for"), "hostkey-unknown"),
    (("connection refused",), "refused"),
    (("could not resolve hostname", "name or service not known",
      "temporary failure in name resolution"), "resolve"),
    # TCP was accepted, then no banner: not "no answer" (issue 25: say what happened).
    (("timed out during banner exchange",), "banner"),
    (("timed out",), "timeout"),
    (("no route to host", "network is unreachable"), "unreachable"),
    (("permission denied",), "auth"),
    (("connection closed", "connection reset", "kex_exchange_identification"), "channel"),
)


def classify_failure(stderr: str, target: SSHTarget, connect_timeout: float) -> TransportError:
    """ssh's message before the login → the paramiko transport's error kinds and wording
    (no host name or address in the message, so equal failures fold into one row)."""
    text = stderr.lower()
    port_match = re.search(r"port (\d+)", stderr)
    port = port_match.group(1) if port_match else str(target.port or 22)
    last = (stderr.strip().splitlines() or ["ssh exited 255 without a message"])[-1].strip()
    for words, kind in _FAILURES:
        if any(w in text for w in words):
            message, hint = _failure_text(kind, port, last, connect_timeout)
            return TransportError(message, kind="timeout" if kind in ("unreachable", "banner")
                                  else kind, host=target.name, hint=hint)
    return TransportError(f"ssh failed: {last[:300]}", kind="ssh", host=target.name)


def _failure_text(kind: str, port: str, last: str, connect_timeout: float) -> tuple[str, str]:
    where = f"port {port}"
    texts = {
        "hostkey-changed": ("HOST KEY CHANGED: the host's key does not match known_hosts",
                            "the node was reinstalled, or someone is in the middle: verify, "
                            "then `ssh-keygen -R <address>`"),
        "hostkey-unknown": ("unknown host key; not in known_hosts",
                            "verify the fingerprint, then add it (ssh once, or "
                            "--accept-new-host-keys)"),
        "refused": (f"connection refused on {where}",
                    f"is sshd running and listening on port {port}?"),
        "resolve": (f"cannot resolve the host's address ({last.rsplit(':', 1)[-1].strip()})",
                    "check the address in the inventory or HostName in ~/.ssh/config, and "
                    "/etc/hosts or DNS"),
        "timeout": (f"no answer from {where} within {connect_timeout:g}s",
                    "the host is down, firewalled, or the address is wrong"),
        "banner": (f"no SSH banner from {where} within {connect_timeout:g}s (the TCP "
                   "connection was accepted)",
                   "is this port an SSH server? (sshd overloaded: MaxStartups)"),
        "unreachable": (f"{where} is unreachable ({last.rsplit(':', 1)[-1].strip()})",
                        "the host is down or there is no route to it"),
        "auth": ("authentication failed (the host refused every key offered)",
                 "add your public key to ~/.ssh/authorized_keys there, or set identity_file "
                 "(IdentityFile) to the right key; passwords are never tried"),
        "channel": (f"connection to {where} closed during the SSH handshake",
                    "sshd refused us early: check its log (MaxStartups, AllowUsers, "
                    "tcp wrappers)"),
    }
    return texts[kind]


def _clean_stderr(err: str) -> str:
    return "".join(line for line in err.splitlines(keepends=True)
                   if not line.startswith(_OUR_NOISE))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()
