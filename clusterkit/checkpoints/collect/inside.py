"""Which DeepSpeed tag inside a program's tag dir collect-ckpt takes (issue 38 item 4):
HF's ``checkpoint-N`` after a reshard holds the old world's ``global_stepN/`` (its parts
on the nodes that had them) and ``global_stepN_universal/`` (DeepSpeed's universal
checkpoint of it, the same on every node of the new mapping, ``latest_universal`` naming
it, clusterkit's marker inside: jobs/reshard.py); accelerate's ``step_N`` holds the
conversion as ``pytorch_model/`` (the name its load_state loads) and the old world's tag
moved aside beside it, ``pytorch_model.set-aside/``, which the marker names.

Pure: listings in, a :class:`Converted` out. The rule, for collect-ckpt (with and without
``--tag``), ``status`` (checkpoints/collect/tags.py) and a restart (jobs/reshard.
converted_inside):

* the DeepSpeed tag it was converted from (:attr:`Converted.original`) is taken when
  its file set is complete (judged by discover's rule with the world size that saved it,
  the marker's: the job's record names the new, smaller world);
* else the universal conversion, when some node holds it complete (every file its
  marker lists, at its size, none cut short);
* else neither: refused, with both reasons. A conversion whose marker is missing or
  unreadable never stands in (the world size of its source is unknown); its DeepSpeed
  tag is then judged by the world size collect-ckpt was given.

A restart resumes from the conversion only when every node holds it complete
(:attr:`Converted.everywhere`).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from clusterkit.checkpoints.listing import FileInfo, NodeListing
from clusterkit.checkpoints.universal_marker import UniversalMarker, marker_from_json_dict
from clusterkit.errors import CheckpointError
from clusterkit.node.contract import LATEST_FILE, LATEST_UNIVERSAL_FILE, UNIVERSAL_MARKER
from clusterkit.node.replicas.rules import size_problem


@dataclass(frozen=True)
class Converted:
    """A universal conversion inside ``tag``: the dir ``name`` (``latest_universal``'s
    text), the DeepSpeed tag ``source`` it was converted from, and that save's
    ``world_size``, ``zero_stage`` and ``precision`` (its marker; None: no readable marker).
    ``complete_on``: the nodes holding it complete; ``problems``: why the others do not."""

    tag: str
    name: str
    source: str
    world_size: int | None
    zero_stage: int | None
    precision: str
    complete_on: tuple[str, ...]
    problems: tuple[str, ...]
    latest: str | None = None  # what the tag dir's `latest` names (the DeepSpeed tag to take)
    files: Mapping[str, int] = field(default_factory=dict)  # the marker's, relative to `name`

    @property
    def usable(self) -> bool:
        return self.world_size is not None and bool(self.complete_on)

    @property
    def everywhere(self) -> bool:
        return self.usable and not self.problems

    @property
    def original(self) -> str:
        """Where the DeepSpeed tag it was converted from sits in the tag dir: the one its
        ``latest`` names (HF's, beside the conversion), or the marker's when ``latest``
        names the conversion's own dir (accelerate's: the tag moved aside for the
        conversion to take its name, ``latest`` kept as DeepSpeed wrote it)."""
        return self.latest if self.latest and self.latest != self.name else self.source

    def holds(self, rel: str) -> bool:
        """``rel`` (relative to the tag dir) belongs to the conversion."""
        return rel == LATEST_UNIVERSAL_FILE or rel.startswith(self.name + "/")


def converted(listings: Sequence[NodeListing], tag: str) -> Converted | None:
    """The conversion inside ``tag`` on the reachable nodes listed; None when no node's
    ``tag`` has a ``latest_universal`` naming a dir."""
    up = [ls for ls in listings if not ls.error and ls.tags.get(tag)]
    names = {t.strip() for ls in up if (t := ls.texts.get(tag, {}).get(LATEST_UNIVERSAL_FILE))}
    if not names:
        return None
    name = sorted(names)[0]
    marker = next((m for ls in up if (m := _marker(ls.texts.get(tag, {}).get(
        f"{name}/{UNIVERSAL_MARKER}"))) is not None), None)
    latest = {t.strip() for ls in up if (t := ls.texts.get(tag, {}).get(LATEST_FILE))}
    source = marker.source_tag.rsplit("/", 1)[-1] if marker else ""
    files = marker.files if marker else {}
    complete, problems = [], []
    for ls in up:
        why = _copy_problem(ls.tags.get(tag) or {}, ls.texts.get(tag, {}), tag, name, files)
        if len(names) > 1:
            why = why or f"{tag}'s {LATEST_UNIVERSAL_FILE} names {', '.join(sorted(names))}"
        if why:
            problems.append(f"{ls.node}: {why}")
        else:
            complete.append(ls.node)
    if marker is None:
        problems.append(f"{tag}/{name} has no readable {UNIVERSAL_MARKER} (the world size of "
                        "the save it was converted from is unknown)")
    return Converted(tag=tag, name=name, source=source,
                     world_size=marker.world_size if marker else None,
                     zero_stage=marker.zero_stage if marker else None,
                     precision=marker.precision if marker else "",
                     complete_on=tuple(complete), problems=tuple(problems),
                     latest=sorted(latest)[0] if len(latest) == 1 else None, files=files)


def _copy_problem(files: Mapping[str, FileInfo], texts: Mapping[str, str], tag: str,
                  name: str, expected: Mapping[str, int]) -> str:
    """Why one node's copy of the conversion is not complete; "" when it is."""
    if LATEST_UNIVERSAL_FILE not in files:
        return f"no {tag}/{LATEST_UNIVERSAL_FILE}"
    if f"{name}/{UNIVERSAL_MARKER}" not in texts:
        return f"no {tag}/{name}/{UNIVERSAL_MARKER}"
    # The replicas' completion watch judges a node's conversion by the same sizes
    # (node/replicas/rules.conversion_problem); this side adds the zip check it listed.
    present = {rel[len(name) + 1:]: (info.size, 0.0, info.whole) for rel, info in files.items()
               if rel.startswith(name + "/")}
    why = size_problem(present, expected, posixpath.join(tag, name), "its marker")
    cut = [rel for rel in sorted(expected) if present[rel][2] is False] if not why else []
    return why or (f"{posixpath.join(tag, name, cut[0])} is cut short" if cut else "")


def _marker(text: str | None) -> UniversalMarker | None:
    """The conversion's marker (the one reader, checkpoints/universal_marker.py); None
    when absent or not one."""
    try:
        data = json.loads(text) if text else None
        return marker_from_json_dict(data) if isinstance(data, dict) else None
    except (ValueError, TypeError, CheckpointError):
        return None


def without(listings: Sequence[NodeListing], tag: str, drop: Callable[[str], bool]
            ) -> list[NodeListing]:
    """``listings`` with the files of ``tag`` for which ``drop(rel)`` holds left out."""
    out = []
    for ls in listings:
        files = ls.tags.get(tag)
        if files is None:
            out.append(ls)
            continue
        kept = {rel: i for rel, i in files.items() if not drop(rel)}
        out.append(dataclasses.replace(ls, tags={**ls.tags, tag: kept}))
    return out
