"""The console budgets (docs/launch.md, "What the console shows after a fault"), shared by
the real launches that measure them (tests/bed/test_console_budget_testbed.py, whose
docstring explains each number) and their recorded replays (tests/unit/test_console_replay.py)."""

from __future__ import annotations

import re

LOST, SPARE = "node2", "node4"  # node index 1; its ring successor node3 holds its copy
STEPS, SAVE_EVERY = 16, 8
# The training script's own progress: "[node1 r0] step 5 loss 0.123456" (not counted).
SCRIPT_STEP = re.compile(r"^\[node\d+ r0\] step \d+ loss ")
CLEAN_BUDGET = 20  # lines besides the step lines, a clean run
LOSS_BUDGET = 40  # the same through a lost node and the restart onto the spare
# What the node-loss console must say, each once at least.
NEEDED_AFTER_LOSS = (LOST,  # the lost node,
                     f"{LOST} -> {SPARE}",  # the spare taking its place,
                     f"of node index 1 ({LOST}) onto {SPARE}",  # what was restored,
                     "replica on node3",  # ... from where,
                     "attempt 2 of 2",  # the attempt,
                     f"resumed from step{SAVE_EVERY}",  # the resumed tag,
                     "checkpoints replicated: ")  # the end


def counted(text: str) -> list[str]:
    """The console's lines that count toward a budget: all but the script's step lines."""
    return [ln for ln in text.splitlines() if ln.strip() and not SCRIPT_STEP.match(ln)]


def folded_groups_name_their_logs(lines: list[str]) -> None:
    """Every folded group (collateral, teardown, replica copies) says where its text is."""
    for ln in lines:
        if re.search(r"\] (collateral|teardown): |\] replicas \S+: \d+/\d+ nodes", ln):
            assert re.search(r"/nodes/<node>/\S+\.log|launcher\.log", ln), ln
