"""The one error base of clusterkit.

Every failure a user can cause or fix (bad inventory, unreachable host, missing
shard) is a :class:`ClusterkitError` with structured fields. The CLI turns it into
exactly one line plus an exit code in one place (``clusterkit.cli.main``); nothing
else prints tracebacks for these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class ClusterkitError(Exception):
    """A user-facing failure.

    ``message`` says what is wrong; ``hint`` says what to do about it. The location
    fields (``path``/``line``/``key``/``host``) are optional and rendered in front of
    the message so the user can jump straight to the cause.
    """

    message: str
    host: str | None = None
    path: str | None = None
    line: int | None = None
    key: str | None = None
    hint: str | None = None
    exit_code: int = 2

    def __post_init__(self) -> None:
        # dataclass does not call Exception.__init__; keep args meaningful for pickling/repr.
        Exception.__init__(self, self.message)

    def location(self) -> str:
        parts: list[str] = []
        if self.path is not None:
            parts.append(self.path if self.line is None else f"{self.path}:{self.line}")
        if self.host is not None:
            parts.append(self.host)
        if self.key is not None:
            parts.append(self.key)
        return ": ".join(parts)

    def one_line(self) -> str:
        where = self.location()
        text = f"{where}: {self.message}" if where else self.message
        if self.hint:
            text = f"{text} — {self.hint}"
        return " ".join(text.split("\n"))

    def __str__(self) -> str:
        return self.one_line()


class InventoryError(ClusterkitError):
    """The inventory file (or a hostfile being imported) is invalid."""


class SelectionError(ClusterkitError):
    """--nodes/--include/--exclude name hosts or slots that do not exist."""


class TransportError(ClusterkitError):
    """A remote operation failed. ``kind`` classifies the failure for reports."""

    kind: str = "error"

    def __init__(
        self,
        message: str,
        *,
        kind: str = "error",
        host: str | None = None,
        path: str | None = None,
        hint: str | None = None,
        exit_code: int = 2,
    ) -> None:
        super().__init__(message, host=host, path=path, hint=hint, exit_code=exit_code)
        self.kind = kind


class RenderError(ClusterkitError):
    """A value cannot be rendered safely into an artifact (env file, script, config)."""


class CheckpointError(ClusterkitError):
    """A checkpoint is incomplete, inconsistent or corrupt."""


class LaunchError(ClusterkitError):
    """A job could not be started, or failed."""


class UsageError(ClusterkitError):
    """The command line itself is wrong (unknown flag, bad value, missing argument).

    ``prog`` is the command whose help describes the right spelling (``clusterkit
    launch``); the one line ends by pointing at it instead of dumping the usage."""

    def __init__(self, message: str, *, key: str | None = None, hint: str | None = None,
                 prog: str = "clusterkit", unknown: str | None = None) -> None:
        super().__init__(message, key=key, hint=hint)
        self.prog = prog
        self.unknown = unknown  # the flag this command does not have, if that is the error

    def one_line(self) -> str:
        return f"{super().one_line()} (see `{self.prog} --help`)"
