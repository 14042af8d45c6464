"""The conversion step of a node-local ``clusterkit sbatch`` job on another number of nodes.

Run by the batch script on the batch host (``python -m clusterkit.jobs.slurm_reshard
RUN_DIR DS_CONFIG NEW_WORLD MARKERS PROGRAM``; docs/sbatch.md, "Another number of nodes")
after ``slurm.replica gather`` put every part of the plan's tag into ``RUN_DIR/gather``: it
converts it with DeepSpeed's own converter (checkpoints/convert/universal.py, launch's
reshard path) and writes the converted tag's name to ``RUN_DIR/universal``, which
``slurm.replica spread`` copies to every node. A user's own script (``MARKERS`` 0, no
completion markers) also gets launch's next-attempt settings: ``DS_CONFIG`` rewritten
with ``checkpoint.load_universal`` and the batch policy (the plain file kept beside it as
``DS_CONFIG.plain``, which the script puts back when the run ends), and the tag to load
in ``RUN_DIR/resume_tag`` (the script exports ``CLUSTERKIT_RESUME_TAG``). A program whose
DeepSpeed tag sits inside its own tag dir (``PROGRAM``'s profile, spec/programs.py:
``OtherWorld.UNIVERSAL_INSIDE``; ``-`` for none) is converted there as a launch's reshard
does (checkpoints/convert/tagdir.py: HF's beside its tag, accelerate's in its place),
``DS_CONFIG`` (then the job's derived config) gets ``checkpoint.load_universal`` alone
(its batch is the program's own), and ``RUN_DIR/spread.json`` lists the files of the tag
dir that ``spread`` merges into every node's copy (node/slurm/restore.spread_into).

Needs clusterkit and DeepSpeed importable with the job's python on the batch host.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from clusterkit.checkpoints.collectplan import WithoutMarkers
from clusterkit.checkpoints.convert.tagdir import inside_line, into_tag_dir, with_load_universal
from clusterkit.checkpoints.convert.universal import Universal, convert_to_universal, user_resume
from clusterkit.checkpoints.listing import parse_listing
from clusterkit.errors import ClusterkitError
from clusterkit.fsutil import atomic_write_text
from clusterkit.jobs.recover import assemble_newest
from clusterkit.jobs.reshard import again_line, converted_again
from clusterkit.node.contract import ASIDE_SUFFIX
from clusterkit.node.contract import SLURM_PLAIN_SUFFIX as PLAIN_SUFFIX
from clusterkit.node.slurm.replica import (
    CONVERTED_FILE,
    GATHER_DIR,
    SPREAD_FILE,
    UNIVERSAL_FILE,
    read_lines,
)
from clusterkit.spec.jobrecord import RankSpan
from clusterkit.spec.programs import PROFILES, OtherWorld, Profile
from clusterkit.spec.resume import NO_PROGRAM

RESUME_TAG_FILE = "resume_tag"
AGAIN = "again"


def reshard(run_dir: str, ds_config: str, new_world: int, markers: bool,
            program: str = NO_PROGRAM) -> list[str]:
    """Convert the gathered tag; the lines to print."""
    with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as fh:
        plan = json.load(fh)
    tag, world = str(plan["tag"]), int(plan["world"])
    bare = None if markers else WithoutMarkers(world)
    gathered = os.path.join(run_dir, GATHER_DIR)
    u = convert_to_universal(gathered, tag, without_markers=bare)
    lines = [f"converted to {u.tag} in {u.seconds:.1f} s (saved by {u.marker.world_size} ranks, "
             f"ZeRO-{u.marker.zero_stage}, step {u.marker.step})"]
    prof = PROFILES.get(program)
    if prof is not None and prof.other_world is OtherWorld.UNIVERSAL_INSIDE:
        u = _inside(run_dir, gathered, tag, u, prof)
        _rewrite(ds_config, with_load_universal)
        lines.append(inside_line(u, new_world, prof, "this run only"))
    elif bare is not None:
        r = user_resume(json.loads(_plain(ds_config)), u.marker, new_world)
        _rewrite(ds_config, lambda _doc: r.ds_config)
        atomic_write_text(os.path.join(run_dir, RESUME_TAG_FILE), r.tag + "\n")
        lines += list(r.lines)
    atomic_write_text(os.path.join(run_dir, UNIVERSAL_FILE), u.tag + "\n")
    return lines


def again(run_dir: str, ds_config: str, rpn: int) -> list[str]:
    """A run after one that converted a checkpoint inside its tag dir (``again RUN_DIR
    DS_CONFIG RPN``, before the plan step, when a node's listing holds a
    ``latest_universal``): the converted tag it resumes from again with load_universal on,
    unless a complete save newer than it can be assembled (launch's rule,
    jobs/reshard.converted_again); the tag in ``RUN_DIR/converted`` for the plan step,
    ``DS_CONFIG`` rewritten for this run (the plain file kept as ``.plain``)."""
    hosts = read_lines(os.path.join(run_dir, "hosts"))
    try:
        old = read_lines(os.path.join(run_dir, "old_hosts")) or hosts
    except OSError:
        old = hosts
    listings = [parse_listing(h, i, "", _text(os.path.join(run_dir, "list", f"{h}.json")))
                for i, h in enumerate(hosts)]
    rank_map = [RankSpan(h, i * rpn, rpn) for i, h in enumerate(old)]
    tag = converted_again(listings, assemble_newest(listings, len(old), False, rank_map))
    if tag is None:
        return []
    _rewrite(ds_config, with_load_universal)
    atomic_write_text(os.path.join(run_dir, CONVERTED_FILE), tag + "\n")
    return [again_line(tag, "this run")]


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""  # not listed: parse_listing says so


def _inside(run_dir: str, gathered: str, tag: str, u: Universal, prof: Profile) -> Universal:
    """The conversion moved into the gathered tag dir (launch's code), and what ``spread``
    merges into every node's copy: the tag dir's files but the old world's DeepSpeed tag;
    in place (accelerate), the node's own copy of that tag renamed first."""
    in_place = prof.ds_tag is not None
    u, files = into_tag_dir(gathered, tag, u, in_place=in_place)
    name = u.tag.split("/", 1)[1]
    doc = {"tag": tag, "files": {rel: list(v) for rel, v in sorted(files.items())},
           "aside": [u.tag, f"{tag}/{name}{ASIDE_SUFFIX}"] if in_place else None}
    atomic_write_text(os.path.join(run_dir, SPREAD_FILE), json.dumps(doc, indent=1) + "\n")
    return u


def _plain(ds_config: str) -> str:
    """The config as the job has it: the plain copy a run before this one kept, if any
    (the script puts it back at the start of a run too)."""
    plain = ds_config + PLAIN_SUFFIX
    with open(plain if os.path.exists(plain) else ds_config, encoding="utf-8") as fh:
        return fh.read()


def _rewrite(ds_config: str, edit: Callable[[dict[str, Any]], Mapping[str, Any]]) -> None:
    """``ds_config`` for this run only: the plain file kept beside it (``.plain``, which
    the batch script puts back when the run ends), ``edit`` of it written in its place."""
    plain = _plain(ds_config)
    if not os.path.exists(ds_config + PLAIN_SUFFIX):
        atomic_write_text(ds_config + PLAIN_SUFFIX, plain)
    atomic_write_text(ds_config, json.dumps(edit(json.loads(plain)), indent=2, sort_keys=True)
                      + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == [AGAIN] and len(argv) == 4:
        return _said(lambda: again(argv[1], argv[2], int(argv[3])))
    if len(argv) not in (4, 5):
        sys.stderr.write("usage: python -m clusterkit.jobs.slurm_reshard RUN_DIR DS_CONFIG "
                         "NEW_WORLD MARKERS [PROGRAM]\n"
                         "       python -m clusterkit.jobs.slurm_reshard again RUN_DIR DS_CONFIG "
                         "RPN\n")
        return 2
    run_dir, ds_config, new_world, markers = argv[:4]
    return _said(lambda: reshard(run_dir, ds_config, int(new_world), markers == "1",
                                 argv[4] if len(argv) == 5 else NO_PROGRAM))


def _said(step: Callable[[], list[str]]) -> int:
    """Run the step; its lines on stdout, or the one line why not on stderr (exit 1)."""
    try:
        lines = step()
    except (ClusterkitError, OSError, ValueError, KeyError) as exc:
        why = exc.one_line() if isinstance(exc, ClusterkitError) else repr(exc)
        print(f"clusterkit: cannot convert the checkpoint: {why}", file=sys.stderr)
        return 1
    for line in lines:
        print(f"clusterkit: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
