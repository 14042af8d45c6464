"""The job's files on one node: the job-dir token.

Part of the node agent (:mod:`clusterkit.node.agent.core`; node program ``agent.core``, whose
module list in :mod:`clusterkit.ship` names this file). Its own module because
every part of the agent expands the launcher's ``@JOB_DIR@`` token, and none of them
should own the rule.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

from clusterkit.node.contract import expand_job_dir


def expand(value: str, job_dir: str) -> str:
    """``value`` with the launcher's job-dir token replaced by this node's job dir."""
    return expand_job_dir(value, job_dir)
