"""A node's checkpoint dir readied before the ranks start (issue 38, docs/programs.md).

One rule for both ways a job starts its ranks: the node agent of ``clusterkit launch``
(node program ``agent.core``: the launcher's ``checkpoint-prep.<node>.json``) and the
batch script of ``clusterkit sbatch`` (node program ``slurm.replica ready``: the run's
``prep.json``, written by its ``plan`` step).

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterkit.node.contract import (
    ASIDE_SUFFIX,
    CKPT_TAG_TOKEN,
    LATEST_FILE,
    MODEL_STATES_RE,
    OPTIM_STATES_RE,
    RESUME_DIR_FIELD,
    UNIVERSAL_MARKER,
    ZERO3_MODEL_STATES_RE,
)
from clusterkit.node.files import write_atomic


def prep_doc(ckpt_dir: str, *, aside: Sequence[str] = (), latest: str | None = None,
             nested_latest: bool = False, spread: Mapping[str, Any] | None = None) -> str:
    """What :func:`ready_checkpoints` reads: ``aside``, the tags to move aside; ``latest``,
    the tag DeepSpeed's top-level ``latest`` must name (a program that picks by it);
    ``nested_latest``, write the ``latest`` each tag dir lacks (HF's checkpoint-N/);
    ``spread``, the batch script's one-writer files to copy first (its ``ready`` step)."""
    doc: dict[str, Any] = {"ckpt_dir": ckpt_dir, "aside": list(aside), "latest": latest,
                           "nested_latest": nested_latest}
    if spread is not None:
        doc["spread"] = dict(spread)
    return json.dumps(doc, sort_keys=True) + "\n"


def resume_words(template: Sequence[str], ckpt: str) -> list[str]:
    """A profile's resume template (``--resume_from_checkpoint {dir}``) for checkpoint dir
    ``ckpt``."""
    return [w.replace(RESUME_DIR_FIELD, ckpt) for w in template]


@dataclass(frozen=True)
class Readiness:
    """What a restart of a user's program from ``tag`` needs (:func:`readiness`)."""

    tag: str
    resume: tuple[str, ...] = ()  # the resume words (empty: it resumes by itself)
    latest: bool = False  # every node's top-level ``latest`` names the tag
    aside: tuple[str, ...] = ()  # newer tags moved aside on every node
    nested_latest: bool = False
    lines: tuple[str, ...] = ()  # what is said, in order
    refusal: str | None = None  # the step-0 line: it must not start

    @property
    def changes(self) -> bool:
        return bool(self.resume or self.latest or self.aside)

    def prep(self, ckpt_dir: str, spread: Mapping[str, Any] | None = None) -> str:
        """The node's :func:`ready_checkpoints` input."""
        return prep_doc(ckpt_dir, aside=self.aside, latest=self.tag if self.latest else None,
                        nested_latest=self.nested_latest, spread=spread)


def _aside_line(newer: Sequence[str], name: str) -> str:
    return (f"moving {', '.join(newer)} aside on every node ({newer[0]} cannot be assembled "
            f"on these nodes; {name} would pick the newest it finds): renamed "
            f"<tag>{ASIDE_SUFFIX}, kept")


def newest_holder(mtimes: Mapping[str, float]) -> str | None:
    """Whose copy of a one-writer file (a snapshot rank 0 saved) every node gets: the
    newest by mtime (its writer's last save); None when nobody holds one."""
    return max(mtimes, key=lambda h: (mtimes[h], h)) if mtimes else None


def spread_line(name: str, writer: str, behind: str) -> str:
    return (f"{name}: written by {writer} only; copied to {behind} (sha256 verified) before "
            "the ranks start")


def readiness(rule: Mapping[str, Any], ckpt_dir: str, tag: str, newer: Sequence[str]
              ) -> Readiness:
    """A restart of a user's program from ``tag``, the newest checkpoint complete on every
    node, ``newer`` the saves after it that cannot be assembled: by its profile's
    ``rule`` (spec/resume.resume_rule, the same for a launch and the batch script): the
    step-0 refusal when it has no known way to resume; else its resume argument for
    ``ckpt_dir``/``tag``, or DeepSpeed's ``latest`` on every node pointed at ``tag``, or
    the newer tags moved aside where it picks the newest it finds."""
    name = str(rule.get("name", "the program"))
    step0 = str(rule.get("step0") or "")
    if step0:
        return Readiness(tag, refusal=step0.replace(CKPT_TAG_TOKEN, tag))
    nested = bool(rule.get("nested_latest"))
    template = [str(w) for w in rule.get("resume") or ()]
    if template:
        words = tuple(resume_words(template, f"{ckpt_dir}/{tag}"))
        return Readiness(tag, resume=words, nested_latest=nested, lines=(
            f"{name}: resuming from {tag}, the newest checkpoint complete on every node "
            f"({' '.join(words)})",))
    lines = []
    latest = bool(rule.get("top_latest"))
    if latest:
        lines.append(f"{name}: every node's {LATEST_FILE} names {tag} (the newest checkpoint "
                     "complete on every node)")
    aside = tuple(newer) if rule.get("aside") else ()
    if aside:
        lines.append(_aside_line(aside, name))
    return Readiness(tag, latest=latest, aside=aside, nested_latest=nested, lines=tuple(lines))


def ready_checkpoints(text: str) -> list[str]:
    """Ready this node's checkpoint dir before the ranks start (issue 38; the launcher's
    ``checkpoint-prep.<node>.json``, docs/programs.md); returns what was done, one line
    each. The dir itself is made (a program that saves into it finds it), newer
    checkpoints that cannot be assembled on this node set are moved aside (renamed,
    never deleted), DeepSpeed's top-level ``latest`` names the checkpoint every node
    resumes from, and a tag dir holding one DeepSpeed tag but no ``latest`` (written by
    global rank 0 only: HF's ``checkpoint-N/latest``) gets one."""
    prep = json.loads(text)
    ckpt = str(prep["ckpt_dir"])
    os.makedirs(ckpt, exist_ok=True)
    said = [f"moved {tag} aside to {moved} (it cannot be assembled on this node set)"
            for tag in prep.get("aside") or () for moved in [_set_aside(ckpt, str(tag))] if moved]
    latest = prep.get("latest")
    if latest and os.path.isdir(os.path.join(ckpt, latest)):
        path = os.path.join(ckpt, LATEST_FILE)
        if not _reads(path, latest):
            write_atomic(path, str(latest))
            said.append(f"{LATEST_FILE} -> {latest}")
    if prep.get("nested_latest"):
        said += _nested_latest(ckpt)
    return said


def _reads(path: str, text: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip() == text
    except OSError:
        return False


def _set_aside(ckpt: str, tag: str) -> str | None:
    src = os.path.join(ckpt, tag)
    if not os.path.isdir(src):
        return None
    n, dest = 1, f"{src}{ASIDE_SUFFIX}"
    while os.path.lexists(dest):
        n += 1
        dest = f"{src}{ASIDE_SUFFIX}{n}"
    os.rename(src, dest)
    return os.path.basename(dest)


def _is_ds_tag(path: str) -> bool:
    """A DeepSpeed tag a program's save wrote; not a universal conversion a reshard put
    beside it (its marker inside: DeepSpeed finds that one by ``latest_universal``)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return UNIVERSAL_MARKER not in names and any(MODEL_STATES_RE.match(n) or OPTIM_STATES_RE.match(n)
               or ZERO3_MODEL_STATES_RE.match(n) for n in names)


def _nested_latest(ckpt: str) -> list[str]:
    said = []
    for tag in sorted(os.listdir(ckpt)):
        tag_dir = os.path.join(ckpt, tag)
        if tag.startswith(".") or not os.path.isdir(tag_dir) \
                or os.path.lexists(os.path.join(tag_dir, LATEST_FILE)):
            continue
        inner = [d for d in sorted(os.listdir(tag_dir))
                 if os.path.isdir(os.path.join(tag_dir, d)) and _is_ds_tag(os.path.join(tag_dir, d))]
        if len(inner) == 1:
            write_atomic(os.path.join(tag_dir, LATEST_FILE), inner[0])
            said.append(f"{tag}/{LATEST_FILE} -> {inner[0]}")
    return said
