"""The conversion step of a node-local ``clusterkit sbatch`` job on another number of nodes.

Run by the batch script on the batch host (``python -m clusterkit.jobs.slurm_reshard
RUN_DIR DS_CONFIG NEW_WORLD MARKERS``; docs/sbatch.md, "Another number of nodes") after
``slurm.replica gather`` put every part of the plan's tag into ``RUN_DIR/gather``: it
converts it with DeepSpeed's own converter (checkpoints/convert/universal.py, launch's
reshard path) and writes the converted tag's name to ``RUN_DIR/universal``, which
``slurm.replica spread`` copies to every node. A user's own script (``MARKERS`` 0, no
completion markers) also gets launch's next-attempt settings: ``DS_CONFIG`` rewritten
with ``checkpoint.load_universal`` and the batch policy (the plain file kept beside it as
``DS_CONFIG.plain``, which the script puts back when the run ends), and the tag to load
in ``RUN_DIR/resume_tag`` (the script exports ``CLUSTERKIT_RESUME_TAG``).

Needs clusterkit and DeepSpeed importable with the job's python on the batch host.
"""

from __future__ import annotations

import json
import os
import sys

from clusterkit.checkpoints.collectplan import WithoutMarkers
from clusterkit.checkpoints.convert.universal import convert_to_universal, user_resume
from clusterkit.errors import ClusterkitError
from clusterkit.fsutil import atomic_write_text

GATHER_DIR = "gather"  # node/slurm/replica.py's names in the run dir
UNIVERSAL_FILE = "universal"
RESUME_TAG_FILE = "resume_tag"
PLAIN_SUFFIX = ".plain"


def reshard(run_dir: str, ds_config: str, new_world: int, markers: bool) -> list[str]:
    """Convert the gathered tag; the lines to print."""
    with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as fh:
        plan = json.load(fh)
    tag, world = str(plan["tag"]), int(plan["world"])
    bare = None if markers else WithoutMarkers(world)
    u = convert_to_universal(os.path.join(run_dir, GATHER_DIR), tag, without_markers=bare)
    lines = [f"converted to {u.tag} in {u.seconds:.1f} s (saved by {u.marker.world_size} ranks, "
             f"ZeRO-{u.marker.zero_stage}, step {u.marker.step})"]
    if bare is not None:
        with open(ds_config, encoding="utf-8") as fh:
            plain = fh.read()
        r = user_resume(json.loads(plain), u.marker, new_world)
        if not os.path.exists(ds_config + PLAIN_SUFFIX):
            atomic_write_text(ds_config + PLAIN_SUFFIX, plain)
        atomic_write_text(ds_config, json.dumps(r.ds_config, indent=2, sort_keys=True) + "\n")
        atomic_write_text(os.path.join(run_dir, RESUME_TAG_FILE), r.tag + "\n")
        lines += list(r.lines)
    atomic_write_text(os.path.join(run_dir, UNIVERSAL_FILE), u.tag + "\n")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        sys.stderr.write("usage: python -m clusterkit.jobs.slurm_reshard RUN_DIR DS_CONFIG "
                         "NEW_WORLD MARKERS\n")
        return 2
    run_dir, ds_config, new_world, markers = argv
    try:
        lines = reshard(run_dir, ds_config, int(new_world), markers == "1")
    except (ClusterkitError, OSError, ValueError, KeyError) as exc:
        why = exc.one_line() if isinstance(exc, ClusterkitError) else repr(exc)
        print(f"clusterkit: cannot convert the checkpoint: {why}", file=sys.stderr)
        return 1
    for line in lines:
        print(f"clusterkit: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
