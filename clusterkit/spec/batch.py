"""The batch policy when a job resumes on a different number of ranks (pure).

A shrink (a node lost for good, issue 22) resumes a checkpoint saved by ``old_world``
ranks on ``new_world`` ranks. The global batch (micro × grad accum × world) is what
the optimizer and the lr schedule were tuned for, so it is kept when it can be:

1. same micro batch, grad accumulation scaled: ``ga' = global / (micro × new_world)``;
2. else a smaller micro batch (never a larger one: more activation memory per rank),
   the largest ``micro' < micro`` that makes ``ga'`` integral;
3. else micro and grad accumulation stay and the global batch changes; the schedule
   (warm-up, cosine) counts optimizer steps, so the lr at step s is unchanged and each
   remaining step sees the new number of samples.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    micro: int
    grad_accum: int
    global_batch: int
    kept: bool  # the global batch is the old one
    note: str  # one line for the console: what changed and why


def shrink_batch(old_world: int, micro: int, grad_accum: int, new_world: int) -> BatchPlan:
    """The micro batch and grad accumulation for ``new_world`` ranks (see the module doc)."""
    if min(old_world, micro, grad_accum, new_world) < 1:
        raise ValueError(f"batch sizes and world sizes must be >= 1: old_world={old_world} "
                         f"micro={micro} grad_accum={grad_accum} new_world={new_world}")
    old_global = micro * grad_accum * old_world
    before = f"micro {micro}, grad accum {grad_accum}"
    for m in range(micro, 0, -1):
        if old_global % (m * new_world) == 0:
            ga = old_global // (m * new_world)
            after = "unchanged" if (m, ga) == (micro, grad_accum) else f"micro {m}, grad accum {ga}"
            return BatchPlan(m, ga, old_global, True,
                             f"global batch {old_global} kept ({before} -> {after})")
    new_global = micro * grad_accum * new_world
    return BatchPlan(micro, grad_accum, new_global, False,
                     f"global batch changes from {old_global} to {new_global} ({old_global} "
                     f"samples do not split evenly over {new_world} ranks; {before} kept; the "
                     f"lr schedule counts optimizer steps, so each remaining step sees "
                     f"{new_global} samples instead of {old_global})")
