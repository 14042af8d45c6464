"""The same operations on this machine via subprocess (virtual nodes, unit tests).

Kept deliberately close to what SSH does so code that works against local
targets works against real hosts: commands start in the home directory, a
missing program exits 127 like a remote shell would, the command gets its own
process group (killed as a whole on timeout), and file copies are atomic.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, TypeVar

from clusterkit.errors import TransportError
from clusterkit.node.hashing import sha256_file
from clusterkit.remote.base import (
    DEFAULT_COMMAND_TIMEOUT_S,
    DEFAULT_MAX_PARALLEL,
    CommandResult,
    FileStat,
    GroupResult,
    SSHTarget,
)
from clusterkit.remote.command import check_argv, check_env
from clusterkit.remote.fanout import run_all
from clusterkit.remote.streams import LineQueue

_T = TypeVar("_T")
_TERM_GRACE_S = 2.0


def _home() -> str:
    return os.path.expanduser("~")


def _environ(env: Mapping[str, str] | None, host: str) -> dict[str, str]:
    merged = dict(os.environ)
    merged.update(check_env(env, host))
    return merged


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class LocalTransport:
    """The :class:`~clusterkit.remote.base.Transport` for ``SSHTarget.local`` hosts."""

    def __init__(self, *, cwd: str | None = None) -> None:
        # None: the home directory, like an SSH login.
        self.cwd = cwd

    def _popen(
        self,
        target: SSHTarget,
        words: tuple[str, ...],
        env: Mapping[str, str] | None,
        stdin: int,
    ) -> subprocess.Popen[bytes] | None:
        try:
            return subprocess.Popen(
                list(words),
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=_environ(env, target.name),
                cwd=self.cwd or _home(),
                start_new_session=True,  # own process group: timeouts kill children too
            )
        except (FileNotFoundError, PermissionError, NotADirectoryError):
            return None  # reported as exit 127/126 like a shell would

    def run_connected(
        self,
        target: SSHTarget,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        on_connected: Callable[[], None] | None = None,
    ) -> CommandResult:
        """``run``; there is no login here, so ``on_connected`` is called at once."""
        if on_connected is not None:
            on_connected()
        return self.run(target, argv, timeout=timeout, env=env, stdin=stdin)

    def run(
        self,
        target: SSHTarget,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> CommandResult:
        words = check_argv(argv, target.name)
        started = time.monotonic()
        proc = self._popen(target, words, env, subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
        if proc is None:
            return _not_found(target, words, started)
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGKILL)
            _reap(proc)
            raise TransportError(
                f"command did not finish within {timeout:g}s (killed)",
                kind="command-timeout",
                host=target.name,
                hint="raise the timeout, or check the command by hand",
            ) from None
        return CommandResult(
            host=target.name,
            argv=words,
            exit_code=proc.returncode,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            duration_s=time.monotonic() - started,
        )

    def run_all(
        self,
        targets: Sequence[SSHTarget],
        argv: Sequence[str] | Mapping[str, Sequence[str]],
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        max_parallel: int = DEFAULT_MAX_PARALLEL,
        stdin: bytes | None = None,
    ) -> GroupResult:
        return run_all(self, targets, argv, timeout=timeout, env=env, max_parallel=max_parallel,
                       stdin=stdin, connect_budget_s=0.0)

    def start(
        self,
        target: SSHTarget,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
    ) -> LocalProcess:
        words = check_argv(argv, target.name)
        proc = self._popen(target, words, env, subprocess.PIPE)
        if proc is None:
            raise TransportError(f"command not found: {words[0]}", kind="usage", host=target.name)
        return LocalProcess(target.name, proc)

    # ------------------------------------------------------------------ files

    def put(self, target: SSHTarget, local_path: str, remote_path: str) -> None:
        _file_op(target, local_path, "copy", lambda: _atomic_copy(local_path, remote_path))

    def get(self, target: SSHTarget, remote_path: str, local_path: str) -> None:
        _file_op(target, remote_path, "copy", lambda: _atomic_copy(remote_path, local_path))

    def stat(self, target: SSHTarget, path: str) -> FileStat | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TransportError(f"stat: {exc.strerror}", kind="file", host=target.name, path=path) from exc
        return FileStat(
            path=path,
            size=st.st_size,
            mtime=st.st_mtime,
            mode=st.st_mode & 0o7777,
            is_dir=os.path.isdir(path),
        )

    def listdir(self, target: SSHTarget, path: str) -> list[str]:
        return _file_op(target, path, "list", lambda: sorted(os.listdir(path)))

    def makedirs(self, target: SSHTarget, path: str) -> None:
        _file_op(target, path, "mkdir", lambda: os.makedirs(path, exist_ok=True))

    def sha256(self, target: SSHTarget, path: str, *, timeout: float = 600.0) -> str:
        return _file_op(target, path, "sha256", lambda: sha256_file(path))

    def close(self) -> None:
        """Nothing to close; present for the Transport protocol."""

    def __enter__(self) -> LocalTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalProcess:
    """A streamed local child (:class:`~clusterkit.remote.base.RemoteProcess`)."""

    def __init__(self, host: str, proc: subprocess.Popen[bytes]) -> None:
        self.host = host
        self.dropped = False  # never: there is no connection to lose
        self._proc = proc
        self._lines = LineQueue()
        self._readers = [
            threading.Thread(
                target=self._pump, args=(name, pipe), daemon=True, name=f"clusterkit-local-{host}-{name}"
            )
            for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr))
            if pipe is not None
        ]
        for reader in self._readers:
            reader.start()

    def _pump(self, stream: str, pipe: IO[bytes]) -> None:
        try:
            while chunk := os.read(pipe.fileno(), 65536):
                self._lines.feed(stream, chunk)
        except OSError:
            pass
        finally:
            self._lines.close(stream)

    def lines(self) -> Iterator[tuple[str, str]]:
        return self._lines.lines()

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.host}: still running after {timeout}s") from None
        for reader in self._readers:
            reader.join(timeout=1.0)  # output written before exit is delivered first
        return code

    def write_stdin(self, data: bytes) -> None:
        if self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise TransportError(
                "the process no longer reads its stdin", kind="channel", host=self.host
            ) from exc

    def close_stdin(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()

    def terminate(self) -> None:
        """SIGTERM the process group; SIGKILL what is left after a short grace."""
        if self._proc.poll() is not None:
            return
        _kill_group(self._proc, signal.SIGTERM)
        try:
            self._proc.wait(_TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(self._proc, signal.SIGKILL)
            self._proc.wait()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Collect a killed child; a daemon that left the group may still hold the pipes."""
    try:
        proc.communicate(timeout=_TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr, proc.stdin):
            if pipe is not None:
                pipe.close()
        proc.wait()


def _not_found(target: SSHTarget, words: tuple[str, ...], started: float) -> CommandResult:
    # A remote shell says this and exits 127; keep results identical across transports.
    return CommandResult(
        host=target.name,
        argv=words,
        exit_code=127,
        stdout="",
        stderr=f"{words[0]}: command not found\n",
        duration_s=time.monotonic() - started,
    )


def _file_op(target: SSHTarget, path: str, what: str, fn: Callable[[], _T]) -> _T:
    try:
        return fn()
    except FileNotFoundError as exc:
        raise TransportError(
            f"{what}: no such file or directory",
            kind="file",
            host=target.name,
            path=exc.filename or path,
        ) from exc
    except OSError as exc:
        raise TransportError(
            f"{what}: {exc.strerror or exc}",
            kind="file",
            host=target.name,
            path=exc.filename or path,
        ) from exc


def _atomic_copy(src: str, dst: str) -> None:
    """Copy to a temp name beside ``dst`` then rename: readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(directory):
        raise FileNotFoundError(2, "no such directory", directory)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dst)}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        shutil.copymode(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
