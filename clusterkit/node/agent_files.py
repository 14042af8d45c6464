"""The job's files on one node: the job-dir token and atomic writes.

Part of the node agent (:mod:`clusterkit.node.agent`; node program ``agent``, whose
module list in :mod:`clusterkit.node.ship` names this file). Its own module because
every part of the agent writes files (the job's files, ``agent.json``, the stack dumps)
or expands the launcher's ``@JOB_DIR@`` token, and none of them should own the rule.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import os
import secrets
import socket

from clusterkit.node.contract import expand_job_dir


def write_atomic(path: str, text: str) -> None:
    # The job dir may be on a shared filesystem that every node's agent writes at once,
    # and pids repeat across hosts (and PID namespaces): the temp name must be unique.
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def expand(value: str, job_dir: str) -> str:
    """``value`` with the launcher's job-dir token replaced by this node's job dir."""
    return expand_job_dir(value, job_dir)
