"""Running the ``clusterkit`` command line as a user does, for any tier that may start a
process (tests/process and above)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# The CLI as a user runs it with this interpreter (for a Popen that watches it live too).
CLI = (sys.executable, "-m", "clusterkit")


def clusterkit_cli(*argv: str, cwd: Path | str | None = None,
                   env: Mapping[str, str] | None = None, timeout: float = 300
                   ) -> subprocess.CompletedProcess[str]:
    """``python -m clusterkit ARGV`` as a user runs it (this interpreter), in ``cwd`` (this
    process's when None) with ``env`` (this process's when None); its exit code and output
    kept, never raised."""
    return subprocess.run([*CLI, *argv], cwd=cwd,
                          env=None if env is None else dict(env), capture_output=True, text=True,
                          timeout=timeout, check=False)


def home_env(home: Path | str) -> dict[str, str]:
    """This process's environment with ``CLUSTERKIT_HOME`` set to ``home``."""
    return {**os.environ, "CLUSTERKIT_HOME": str(home)}
