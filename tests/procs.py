"""Local processes in tests: whether one still runs."""

from __future__ import annotations


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a process here that has not exited: gone or a zombie is
    not alive (the state field follows the parenthesised command name, which may hold
    spaces)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False
