"""The replica rules, decided once (issue 36): every answer about checkpoint replicas that
the launcher and the Slurm node side both need.

* **placement**: :func:`ring` (which nodes hold node i's copies: the next K in node order,
  as a ring, none sharing a host name or address with i or with a holder already chosen),
  :func:`ring_sources` (whose copies node i holds), :func:`ring_distance` (the order the
  holders of a part are tried);
* **copy validity**: :func:`own_problem` (a node's own tag dir holds its part: its
  completion marker names the tag and the index and every file it lists is there at its
  size; a user's script: :func:`part_problem`, every file DeepSpeed owes the node's
  ranks; never a ``.pt`` cut short) and :func:`copy_problem` (a replica: its manifest
  present, of this version, naming this tag and source, every file it lists there at its
  size, none cut short);
* **tag order**: :func:`tag_order` (newest first: the step a tag's name ends in, then its
  newest file) and :func:`candidate_tags`;
* **which sources serve which node index**: :func:`held_index` (whose part an own tag dir
  holds) and :func:`part_sources` (each index's usable copies, own copies first, then
  replicas in ring order, or why there is none).

Its callers translate their own listing types into the plain values here (:class:`Copy`,
:class:`Holding`) and nothing else: checkpoints/replicas/assemble.py (collect-ckpt,
status, the launcher's restore) from typed ``NodeListing``s, node/slurm/restore.py (a
node-local Slurm job on another node set) from the raw JSON of node/ckpt/listing.py,
node/slurm/replica.py and plan/build.py for placement. ``tests/unit/test_replica_rules.py``
fails on a second definition elsewhere. Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from clusterkit.node.contract import (
    ASIDE_SUFFIX,
    MODEL_STATES_RE,
    OPTIM_STATES_RE,
    REPLICA_MANIFEST,
    REPLICA_SCHEMA,
    REPLICA_SCHEMA_VERSION,
    UNIVERSAL_MARKER,
    UNIVERSAL_SUFFIX,
    ZERO3_MODEL_STATES_RE,
    marker_name,
    parse_marker_name,
    tag_step,
)

if TYPE_CHECKING:  # a runtime alias would need typing.Tuple on Python 3.8
    Ranks = Mapping[int, Sequence[int]]  # node index -> its global ranks
    # a listed file: (size, mtime, whole: False for a .pt cut short, None when not a zip)
    Stat = tuple[int, float, bool | None]
OWN = "own"
REPLICA = "replica"
_RANK_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_")


# ------------------------------------------------------------------ placement


def ring(index: int, identities: Sequence[Collection[str]], k: int) -> list[int]:
    """The node indexes holding node ``index``'s copies: the next ``k`` in node order, as
    a ring, skipping any that shares an identity (``identities[i]``: its host name and
    address) with ``index`` or with one already chosen: one lost machine never takes a
    part and its copy. Fewer than ``k`` when the other nodes share its machine."""
    out: list[int] = []
    seen = set(identities[index])
    n = len(identities)
    for step in range(1, n):
        j = (index + step) % n
        if len(out) < k and not seen.intersection(identities[j]):
            out.append(j)
            seen.update(identities[j])
    return out


def ring_sources(index: int, identities: Sequence[Collection[str]], k: int) -> list[int]:
    """The node indexes whose copies node ``index`` holds (the inverse of :func:`ring`)."""
    return [i for i in range(len(identities)) if index in ring(i, identities, k)]


def ring_distance(index: int, holder: int, n: int) -> int:
    """How far along the ring of ``n`` nodes ``holder`` follows ``index`` (1: its
    successor): the order the holders of ``index``'s copies are tried, the order
    :func:`ring` placed them."""
    return (holder - index) % max(n, 1)


# ------------------------------------------------------------------ copy validity


@dataclass(frozen=True)
class Copy:
    """One copy of a node's part of a tag as a listing shows it: ``files`` relpath ->
    :data:`Stat` (an own tag dir: relative to the tag dir; a replica: to the replica dir,
    ``<tag>/...`` and node 0's ``latest``); ``markers`` completion-marker file name ->
    its text (an own tag dir); ``manifest`` the manifest's text (a replica; None: none)."""

    files: Mapping[str, Stat]
    markers: Mapping[str, str] = field(default_factory=dict)
    manifest: str | None = None


@dataclass(frozen=True)
class ReplicaManifest:
    """``clusterkit-replica.json`` (node/contract.py): every file of one copy with the
    size and sha256 its source computed while sending it."""

    job_id: str
    tag: str
    source: int
    source_host: str
    holder: str
    files: Mapping[str, tuple[int, str]]  # relpath (to the replica dir) -> (size, sha256)
    completed: float


def parse_replica_manifest(text: str) -> ReplicaManifest:
    """Parse a manifest; ValueError says what is wrong with it."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("schema") != REPLICA_SCHEMA:
        raise ValueError("not a clusterkit replica manifest")
    if data.get("version") != REPLICA_SCHEMA_VERSION:
        raise ValueError(f"manifest version {data.get('version')!r} unknown "
                         f"(this clusterkit reads {REPLICA_SCHEMA_VERSION})")
    try:
        files = {str(rel): (int(v["size"]), str(v["sha256"])) for rel, v in data["files"].items()}
        return ReplicaManifest(job_id=str(data["job_id"]), tag=str(data["tag"]),
                               source=int(data["source"]), source_host=str(data["source_host"]),
                               holder=str(data["holder"]), files=files,
                               completed=float(data["completed"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed manifest ({exc})") from None


@dataclass(frozen=True)
class MarkerFacts:
    """What the copy rule reads of a completion marker (checkpoints/layout.py's
    ``CompletionMarker`` holds the rest): its tag, node index, node count, and every file
    of the node's tag dir with its size."""

    tag: str
    node_index: int
    num_nodes: int
    node_files: Mapping[str, int]


def read_marker(text: str) -> MarkerFacts | None:
    """A completion marker's facts; None when it is not one (unreadable, a key missing or
    of the wrong type)."""
    try:
        data = json.loads(text)
        facts = MarkerFacts(tag=data["tag"], node_index=data["node_index"],
                            num_nodes=data["num_nodes"],
                            node_files={str(k): int(v) for k, v in data["node_files"].items()})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    ints = (facts.node_index, facts.num_nodes)
    if not isinstance(facts.tag, str) or any(type(v) is not int for v in ints):
        return None
    return facts


def missing_rank_files(names: Sequence[str], ranks: Sequence[int]) -> list[str]:
    """What DeepSpeed still owes this node's ``ranks`` in a tag dir holding ``names``
    (base names); an empty list when nothing is missing. A dir with no DeepSpeed file
    at all owes the ZeRO 0-2 model states (it is not a checkpoint yet)."""
    base = {posixpath.basename(n) for n in names}
    optim = {int(m.group(2)): n for n in base for m in [OPTIM_STATES_RE.match(n)] if m}
    zero3 = {int(m.group(1)) for n in base for m in [ZERO3_MODEL_STATES_RE.match(n)] if m}
    model = any(MODEL_STATES_RE.match(n) for n in base)
    missing = []
    if zero3:
        missing += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks if r not in zero3]
    elif not model:
        missing.append("mp_rank_00_model_states.pt")
    if optim:
        missing += [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks if r not in optim]
    return missing


def conversion_dirs(names: Iterable[str]) -> set[str]:
    """The dirs inside a tag dir (``names``: its files, relative) that hold a universal
    conversion a reshard made, not its save's files: ``<DeepSpeed tag>_universal/``
    (HF's, beside the tag it was made from), or one holding clusterkit's marker
    (accelerate's, in the place of the tag its library loads by name; jobs/reshard.py).
    A top-level universal tag's own files (the contract's ``stepN_universal/``, its marker
    at its top) are that tag's save: only dirs below the tag count."""
    return {d for d in map(_conversion_dir, names) if d is not None}


def _conversion_dir(rel: str) -> str | None:
    parts = rel.replace("\\", "/").split("/")
    for i, d in enumerate(parts[:-1]):
        if d.endswith(UNIVERSAL_SUFFIX):
            return "/".join(parts[:i + 1])
    if len(parts) > 1 and parts[-1] == UNIVERSAL_MARKER:
        return "/".join(parts[:-1])
    return None


def conversion_problem(sizes: Mapping[str, int], markers: Mapping[str, str | None]) -> str:
    """Why a node's tag dir holding a reshard's conversion (``markers``: each dir of
    :func:`conversion_dirs` -> its marker's text, None when unreadable) is not finished;
    "" when every file each marker lists is there at its size (``sizes``: the tag dir's
    files, relative). The reshard put the whole conversion on every node: its rank files
    beside it (the old world's tag, set aside or not) are another world's, so the node's
    own ranks judge nothing here (collect-ckpt and status judge it by the same marker,
    checkpoints/collect/inside.py)."""
    for conv, text in sorted(markers.items()):
        try:
            listed = json.loads(text or "")["files"]
            expected = {posixpath.join(conv, rel): int(n) for rel, n in listed.items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            return f"{conv}/{UNIVERSAL_MARKER} is not readable"
        why = size_problem({rel: (n, 0.0, None) for rel, n in sizes.items()}, expected, "",
                           "its universal marker")
        if why:
            return why
    return ""


def saved_files(names: Iterable[str]) -> list[str]:
    """The files of a tag dir that its save wrote: without a universal conversion's
    (:func:`conversion_dirs`), whose per-rank files are every rank of another world
    (ZeRO-3's model states); the conversion is judged by its own marker
    (checkpoints/collect/inside.py)."""
    names = list(names)
    conv = conversion_dirs(names)
    return [n for n in names
            if not any(n.replace("\\", "/").startswith(d + "/") for d in conv)]


def part_problem(names: Sequence[str], ranks: Sequence[int], cut_short: Sequence[str] = ()
                 ) -> str | None:
    """The no-marker rule on what one listing of a node's tag dir shows: None when it
    holds every file DeepSpeed owes ``ranks`` and none is cut short (``cut_short``: the
    ``.pt`` files without their zip end record), else what is wrong. The one rule for a
    user's checkpoint: the completion watch (node/replicas/done.py, which adds what only
    it sees: nothing open, sizes stable), :func:`own_problem` and so ``status``,
    ``collect-ckpt``, the spare restore and the Slurm restore."""
    missing = missing_rank_files(names, ranks)
    if missing:
        return "missing " + ", ".join(missing[:3])
    if cut_short:
        return "not a whole zip: " + ", ".join(sorted(cut_short)[:3])
    return None


def torn(files: Mapping[str, Stat]) -> list[str]:
    """The ``.pt`` files of a listing that lack their zip end record (a save cut short)."""
    return [rel for rel, st in files.items() if st[2] is False]


def size_problem(present: Mapping[str, Stat], expected: Mapping[str, int], prefix: str,
                 whose: str) -> str:
    """The first file of ``expected`` missing from ``present`` or of another size."""
    for rel, size in sorted(expected.items()):
        st = present.get(rel)
        shown = posixpath.join(prefix, rel) if prefix else rel
        if st is None:
            return f"{shown} is missing ({whose} lists it)"
        if st[0] != size:
            return f"{shown} has {st[0]} bytes, {whose} recorded {size}"
    return ""


def own_problem(own: Copy, index: int, tag: str, markers: bool,
                ranks: Sequence[int] | None = None) -> str:
    """Why a node's own tag dir ``own`` does not hold node index ``index``'s complete part
    of ``tag``; "" when it does. Its completion marker decides (``markers``: the job
    writes them; without, a marker present still decides); a user's script without one:
    :func:`part_problem` on ``ranks`` (None: unknown, any file counts)."""
    cut = torn(own.files)
    if cut:
        return f"{posixpath.join(tag, cut[0])} is cut short"
    text = own.markers.get(marker_name(index))
    if text is None and not markers and own.files:
        why = part_problem(saved_files(own.files), ranks) if ranks is not None else None
        return f"{tag}: {why}" if why else ""
    if text is None:
        return f"no completion marker in {tag} (its save did not finish)"
    marker = read_marker(text)
    if marker is None or marker.tag != tag or marker.node_index != index:
        return f"unreadable completion marker in {tag}"
    return size_problem(own.files, marker.node_files, tag, "its completion marker")


def copy_problem(copy: Copy, index: int, tag: str) -> tuple[ReplicaManifest | None, str]:
    """(the manifest of a complete replica of node index ``index``'s ``tag``, "") or
    (None, why it does not count). The manifest's tag and source say whose copy it is
    (the Slurm side once looked for the source's completion marker among its files for
    that; a marker the manifest lists must be there at its size like any file). The
    service copies a tag only once it is complete on its node (node/replicas/done.py),
    so a replica is judged the same whether or not the job writes markers."""
    if copy.manifest is None:
        return None, f"has no {REPLICA_MANIFEST} (the copy did not finish)"
    try:
        manifest = parse_replica_manifest(copy.manifest)
    except ValueError as exc:
        return None, f"has an unusable manifest: {exc}"
    if manifest.tag != tag or manifest.source != index:
        return None, (f"has a manifest for {manifest.tag} of node index {manifest.source}, "
                      f"not {tag} of {index}")
    sizes = {rel: size for rel, (size, _) in manifest.files.items()}
    why = size_problem(copy.files, sizes, "", "its manifest")
    cut = [rel for rel in torn(copy.files) if rel in sizes]
    if why or cut:
        return None, (f"is incomplete: {why}" if why else f"is incomplete: {cut[0]} is cut short")
    return manifest, ""


# ------------------------------------------------------------------ tag order


def tag_order(newest: Mapping[str, float]) -> list[str]:
    """Tags newest first: the step each names (step16 after step8), then the newest
    mtime of its files (``newest``: tag -> that mtime; tags naming no step), then name."""
    return sorted(newest, key=lambda t: (tag_step(t), newest[t], t), reverse=True)


def oldest_first(tags: Iterable[str]) -> list[str]:
    """Tags by the step each names, oldest first (the completion watch's order)."""
    return sorted(tags, key=lambda t: (tag_step(t), t))


def is_deepspeed_file(rel: str) -> bool:
    """A file DeepSpeed writes into a tag dir (model or optimizer states)."""
    name = posixpath.basename(rel)
    return any(r.match(name) for r in (MODEL_STATES_RE, ZERO3_MODEL_STATES_RE, OPTIM_STATES_RE))


def candidate_tags(own: Iterable[tuple[str, Copy]], copies: Iterable[tuple[str, Copy]],
                   markers: bool) -> list[str]:
    """Every tag whose own dir on some node holds a completion marker (``markers`` False,
    a user's script: or any DeepSpeed file), or of which some node holds a replica with a
    manifest; newest first (:func:`tag_order`, over the files of own dirs and replicas).
    ``own`` and ``copies``: (tag, copy) of every reachable node."""
    tags: set[str] = set()
    newest: dict[str, float] = {}
    for kind, seen in ((OWN, own), (REPLICA, copies)):
        for tag, c in seen:
            if ASIDE_SUFFIX in tag:
                continue  # moved aside by a restart (node/ckpt/ready.py): kept, never resumed
            if c.files:
                newest[tag] = max([newest.get(tag, 0.0), *(st[1] for st in c.files.values())])
            if _names_a_save(kind, c, markers):
                tags.add(tag)
    return tag_order({t: newest.get(t, 0.0) for t in tags})


def _names_a_save(kind: str, c: Copy, markers: bool) -> bool:
    """A replica with a manifest; an own tag dir with a marker (a user's script: or any
    DeepSpeed file)."""
    if kind == REPLICA:
        return c.manifest is not None
    return bool(c.markers) or (not markers and any(is_deepspeed_file(rel) for rel in c.files))


# ------------------------------------------------------------------ which sources serve which index


@dataclass(frozen=True)
class Holding:
    """What one node holds of one tag, as its listing shows. ``position``: the node index
    whose part its own tag dir holds unless the dir says otherwise (its index in the run
    that saved; None: not one of that run's nodes); ``own``: its tag dir (None: none);
    ``copies``: source index -> its replica of the tag; ``error``: it could not be listed."""

    host: str
    position: int | None
    own: Copy | None = None
    copies: Mapping[int, Copy] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Source:
    """A usable copy of node index ``index``'s part: on ``host``, its own tag dir
    (``kind`` OWN) or a replica (REPLICA, with its ``manifest``)."""

    index: int
    host: str
    kind: str
    manifest: ReplicaManifest | None = None


def file_ranks(names: Iterable[str]) -> list[int]:
    """The global ranks DeepSpeed's per-rank file names in ``names`` name."""
    return [int(m.group(1)) for n in names for m in [_RANK_RE.search(n)] if m]


def held_index(own: Copy, position: int | None, markers: bool,
               ranks: Ranks | None = None) -> int | None:
    """Whose part an own tag dir holds (complete or not): the index its completion marker
    names (``position``'s first; else the one marker there); without markers, a user's
    script: the index whose ``ranks`` hold its lowest per-rank file's rank, else
    ``position``; None when nothing says."""
    named = [i for name in own.markers for i in [parse_marker_name(name)] if i is not None]
    if position is not None and position in named:
        return position
    if named or markers:
        return named[0] if len(named) == 1 else None
    rank = min(file_ranks(saved_files(own.files)), default=None)
    if rank is not None and ranks:
        return next((i for i, rs in sorted(ranks.items()) if rank in rs), None)
    return position


def part_sources(holdings: Sequence[Holding], tag: str, n: int, markers: bool,
                 ranks: Ranks | None = None
                 ) -> tuple[dict[int, list[Source]], dict[int, str]]:
    """Node index -> its usable copies of ``tag`` (own copies first, the one at the
    index's position first; then replicas in ring order from the index), for indexes
    ``0..n-1``; and index -> why it has none, for those without."""
    out: dict[int, list[Source]] = {i: [] for i in range(n)}
    for h in holdings:
        if h.error or h.own is None:
            continue
        i = held_index(h.own, h.position, markers, ranks)
        if i is not None and 0 <= i < n and not own_problem(
                h.own, i, tag, markers, None if ranks is None else ranks.get(i)):
            out[i].append(Source(i, h.host, OWN))
    why: dict[int, str] = {}
    for i in range(n):
        at = [h for h in holdings if h.position == i]
        out[i].sort(key=lambda s: not any(h.host == s.host for h in at))
        reps, rep_why = _replicas(holdings, i, tag, n)
        out[i] += reps
        if not out[i]:
            why[i] = "; ".join([_own_why(at[0] if at else None, i, tag, markers, ranks), rep_why])
    return out, why


def _own_why(h: Holding | None, index: int, tag: str, markers: bool,
             ranks: Ranks | None) -> str:
    if h is None:
        return "not among the nodes listed"
    if h.error:
        return "unreachable"
    if h.own is None:
        return f"has no {tag}"
    return own_problem(h.own, index, tag, markers, None if ranks is None else ranks.get(index)) \
        or "its own copy holds another node index's part"


def _replicas(holdings: Sequence[Holding], index: int, tag: str, n: int
              ) -> tuple[list[Source], str]:
    """Complete replicas of ``index``'s ``tag`` (ring order; a holder that was not one of
    the saving run's nodes last), and why there is none when so."""
    others = [h for h in holdings if h.position != index]
    others.sort(key=lambda h: n if h.position is None else ring_distance(index, h.position, n))
    found: list[Source] = []
    bad: list[str] = []
    for h in others:
        copy = None if h.error else h.copies.get(index)
        if copy is None:
            continue
        manifest, why = copy_problem(copy, index, tag)
        if manifest is None:
            bad.append(f"{h.host}'s copy {why}")
        else:
            found.append(Source(index, h.host, REPLICA, manifest))
    if found:
        return found, ""
    down = [h.host for h in others if h.error]
    details = bad + ([f"unreachable: {', '.join(down)}"] if down else [])
    return found, (f"no complete replica of {tag} on any reachable node"
                   + (f" ({'; '.join(details)})" if details else ""))
