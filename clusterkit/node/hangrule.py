"""The progress watchdog's rule, one for both paths (issue 25; issue 31 item 5).

``launch``'s watchdog (:mod:`clusterkit.launch.watchdog`, fed by the node agents'
progress reports) and the batch script's (:mod:`clusterkit.node.slurm.watch`, which
reads file times on the batch host) gather progress differently; whether the job
hangs they judge here, with :func:`judge`, so both give the same start-up allowance
and the same messages (docs/launch.md and docs/sbatch.md, "Hangs").

**The rule.** The clock starts when the ranks are started. For the first
``allowance_s`` (:func:`allowance`: ``STARTUP_FACTOR`` x ``--hang-timeout``) nothing
fires: imports, DeepSpeed's op builds (fused_adam compiling for a minute on a loaded
node) and a checkpoint load print nothing for long stretches. The allowance ends early
at the first sign of training: a rank's output line that reads as a step
(:func:`step_of`) or a heartbeat. After it, the job hangs when no rank made progress for
more than ``--hang-timeout`` seconds. Exactly at a limit is not over it.

Standard library only (shipped with slurmwatch; Python >= 3.8 on the node).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STARTUP_FACTOR = 2.0  # the start-up allowance, in units of --hang-timeout

# A rank's output line that reports a training step (the console's status line reads
# the same: "step 10/30 | loss 4.8", "step=10", "Step: 10").
STEP_LINE = re.compile(r"\bstep[ =:]+(\d+)(?:\s*/\s*(\d+))?", re.IGNORECASE)

# Verdict.limit: which limit applied.
HANG_TIMEOUT = "hang-timeout"
STARTUP = "start-up allowance"
OFF = "off"


def step_of(text: str) -> int | None:
    """The step number a rank's line reports, or None."""
    m = STEP_LINE.search(text)
    return int(m.group(1)) if m else None


def allowance(hang_timeout_s: float) -> float:
    """The start-up allowance for ``--hang-timeout`` (the same for launch and sbatch)."""
    return STARTUP_FACTOR * hang_timeout_s


@dataclass(frozen=True)
class Verdict:
    """:func:`judge`'s answer: ``hung``, the limit that applied (``limit``: HANG_TIMEOUT,
    STARTUP or OFF, and ``limit_s``), how long every rank had been silent, and, when
    hung, the one-line reason both watchdogs print."""

    hung: bool
    limit: str
    limit_s: float
    idle_s: float
    reason: str = ""


def judge(now: float, started_at: float, last_progress: float | None, training: bool,
          hang_timeout_s: float, allowance_s: float) -> Verdict:
    """Does the job hang at ``now``? All times on one clock.

    ``started_at``: when the ranks were started; ``last_progress``: the newest progress
    of any rank since then (None: none at all since they started); ``training``: a
    sign of training was seen (a step line or a heartbeat); ``hang_timeout_s`` 0: off.
    """
    since = max(0.0, now - started_at)
    idle = since if last_progress is None else min(since, max(0.0, now - last_progress))
    t = hang_timeout_s
    if t <= 0:
        return Verdict(False, OFF, 0.0, idle)
    if not training and since < allowance_s:
        return Verdict(False, STARTUP, allowance_s, idle)  # idle <= since < the allowance
    if idle <= t:
        return Verdict(False, HANG_TIMEOUT, t, idle)
    if training:
        return Verdict(True, HANG_TIMEOUT, t, idle,
                       f"no progress on any rank for {idle:.0f} s (--hang-timeout {t:g})")
    startup = f"the start-up allowance of {allowance_s:g} s" + (
        f" ({STARTUP_FACTOR:g} \u00d7 --hang-timeout {t:g})" if allowance_s == allowance(t) else "")
    if last_progress is None:
        return Verdict(True, STARTUP, allowance_s, idle,
                       f"no sign of training within {startup}: no output or heartbeat from "
                       f"any rank since they started {idle:.0f} s ago")
    return Verdict(True, STARTUP, allowance_s, idle,
                   f"no progress on any rank for {idle:.0f} s (--hang-timeout {t:g}; {startup} "
                   "passed with no step line or heartbeat)")
