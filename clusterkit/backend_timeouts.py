"""Backend timeouts that fail fast, matched to the launcher's hang timeout (issue 14).

A rank that stops without dying blocks every other rank in its collective until the
process group's timeout: 30 minutes by default in torch 2.x (gloo and NCCL), 10 in
DeepSpeed 0.19's ``init_distributed``. The launcher's progress watchdog
(``launch --hang-timeout S``) should see the stall first, collect every rank's
stacks and tear the job down; the backend's timeout is the second line, for when
no watchdog runs (the launcher lost behind a partition, a script started by hand):
``S`` plus a margin for the watchdog's stack collection, never below a floor that
leaves room for a first collective behind a JIT op build.

Bottom layer, standard library only: the plan renders :func:`timeout_env` into every
rank's environment and the bundled workload reads :func:`pg_timeout_from_env`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from clusterkit.node.contract import ENV_PG_TIMEOUT_S

# The job contract: seconds a user script should pass to init_process_group(timeout=...).
PG_TIMEOUT_ENV = ENV_PG_TIMEOUT_S
# The watchdog fires at S, then waits up to 30 s for the stacks and tears down: the
# backend must not fail first, or the stacks are lost to a timeout traceback.
WATCHDOG_MARGIN_S = 120
# DeepSpeed's first collective can wait behind a JIT op build (~40 s on CPU, minutes
# with CUDA ops): shorter process-group timeouts kill healthy starts.
MIN_PG_TIMEOUT_S = 300
# Flight-recorder entries per rank (torch keeps the last N collectives).
TRACE_BUFFER_ENTRIES = 2000


def pg_timeout_s(hang_timeout_s: float) -> int | None:
    """The process-group timeout for a hang timeout; None when the watchdog is off."""
    if hang_timeout_s <= 0:
        return None
    return max(MIN_PG_TIMEOUT_S, math.ceil(hang_timeout_s) + WATCHDOG_MARGIN_S)


def timeout_env(hang_timeout_s: float, *, gpu: bool, job_dir: str) -> dict[str, str]:
    """Variables every rank gets (docs/launch.md "Backend timeouts" lists who reads each).

    Empty when the watchdog is off: the backends' own defaults then apply.
    """
    pg = pg_timeout_s(hang_timeout_s)
    if pg is None:
        return {}
    env = {
        PG_TIMEOUT_ENV: str(pg),
        # deepspeed/constants.py: default_pg_timeout = DEEPSPEED_TIMEOUT minutes
        "DEEPSPEED_TIMEOUT": str(math.ceil(pg / 60)),
    }
    if gpu:
        env.update({
            # torch >= 2.2: a timed-out collective aborts the communicator and ends
            # the process, so the agent sees a dead rank instead of a hung one.
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            # torch >= 2.2: the flight recorder (last N collectives per rank; 2.7+ also
            # reads TORCH_FR_BUFFER_SIZE) and its dump on a timeout, into the job dir.
            "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_BUFFER_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{job_dir.rstrip('/')}/nccl_trace_rank_",
        })
    return env


def pg_timeout_from_env(environ: Mapping[str, str], default: float) -> float:
    """``CLUSTERKIT_PG_TIMEOUT_S`` when the launcher set a valid one, else ``default``."""
    text = environ.get(PG_TIMEOUT_ENV, "").strip()
    try:
        value = float(text)
    except ValueError:
        return default
    return value if math.isfinite(value) and value > 0 else default
