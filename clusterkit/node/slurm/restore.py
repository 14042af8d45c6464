"""A node-local Slurm job on another node set: its checkpoint's parts moved first (issue 31).

Part of node program ``slurm.replica`` (``ship.py``; docs/sbatch.md, "Node-local
checkpoints across requeue"). A requeued (or resubmitted) node-local job may get other
nodes than those its checkpoint lives on: a node was lost for good, or Slurm picked
others. Node index i is the i-th node of the allocation (``SLURM_NODEID``, what the
launch line gives torchrun), so before the ranks start node i must hold part i of the
newest checkpoint that can be assembled. The batch script runs, in order:

1. ``list`` on every node (a step): the node's listing (``node/ckpt/listing.py``, the one
   collect-ckpt reads, replica area included) into ``RUN_DIR/list/<node>.json``;
2. ``plan`` on the batch host: the newest tag every node index has a source of (its
   own copy on some node of this run, or a complete replica), and for each node that
   lacks its part, where it comes from; ``RUN_DIR/plan.json`` and
   the decision lines in the job's log. Exit 3 with one line naming the missing node
   parts when no tag can be assembled from this run's nodes;
3. ``restore`` on every node (a step): a node whose own copy of the tag is another
   node index's part moves it into its replica area (a manifest with each file's
   sha256: a verified replica from then on); a part another node holds is pushed over
   the replica wire (``node/replicas/wire.py``: authenticated, every file's sha256 checked on
   arrival, manifest last, atomic); a node holding its part as a replica promotes it
   into its checkpoint dir after checking every file against the manifest (a
   directory rename: the tag dir and its marker appear at once; ``latest`` after it).

Which copy counts, the tag order and which sources serve which node index are the
replica rules (node/replicas/rules.py), the ones the launcher's assemble.py asks: this
module turns the listings' JSON into the rules' values and the answers into moves.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from clusterkit.node.ckpt.listing import listing
from clusterkit.node.contract import (
    LATEST_FILE,
    MODEL_STATES_RE,
    REPLICA_PARTIAL_PREFIX,
    goes_last,
    replica_dir,
    replica_source_dir,
)
from clusterkit.node.files import write_atomic
from clusterkit.node.hashing import sha256_file
from clusterkit.node.replicas.area import commit_copy, new_manifest, read_manifest
from clusterkit.node.replicas.rules import (
    Copy,
    Holding,
    file_ranks,
    held_index,
    own_problem,
    part_sources,
)
from clusterkit.node.replicas.rules import candidate_tags as rule_tags
from clusterkit.node.replicas.wire import ReplicaError, ReplicaServer, push, push_files

CANNOT_ASSEMBLE = 3  # the batch script's exit code for "not starting fresh"
RECEIVE_WAIT_S = 600.0  # a node waiting for its part: the holders push within this
PUSH_TRIES_S = 120.0  # a holder retries while the target's server comes up


def say(text: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    stream.write(f"clusterkit: {text}\n")
    stream.flush()


# ------------------------------------------------------------------ 1. list


def write_listing(ckpt_dir: str, run_dir: str, host: str) -> int:
    out = os.path.join(run_dir, "list", f"{host}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_atomic(out, json.dumps(listing(ckpt_dir, None)))
    return 0


# ------------------------------------------------------------------ 2. plan (pure)


@dataclass(frozen=True)
class Saved:
    """The run whose checkpoint is asked about: its ``hosts`` in node index order (a
    host's own tag dir holds its index's part unless its files say otherwise), whether it
    writes completion ``markers``, its ranks per node ``rpn``."""

    hosts: tuple[str, ...]
    markers: bool
    rpn: int

    @property
    def ranks(self) -> dict[int, range] | None:
        """node index -> its global ranks (None: not known)."""
        if self.rpn <= 0:
            return None
        return {i: range(i * self.rpn, (i + 1) * self.rpn) for i in range(len(self.hosts))}

    def position(self, host: str) -> int | None:
        return self.hosts.index(host) if host in self.hosts else None


def _stat(st: list[Any]) -> tuple[int, float, bool | None]:
    """A listed file ``[size, mtime(, whole)]`` (node/ckpt/listing.py) as the rules read it."""
    return int(st[0]), float(st[1]), (None if len(st) < 3 or st[2] is None else bool(st[2]))


def _copy(files: dict[str, Any], marks: dict[str, str] | None = None,
          manifest: str | None = None) -> Copy:
    return Copy(files={rel: _stat(st) for rel, st in files.items()}, markers=marks or {},
                manifest=manifest)


def _own(ls: dict[str, Any], tag: str) -> Copy | None:
    files = (ls.get("tags") or {}).get(tag)
    return None if files is None else _copy(files, (ls.get("markers") or {}).get(tag))


def _replicas(ls: dict[str, Any], tag: str) -> dict[int, Copy]:
    out = {}
    for key, entry in (ls.get("replicas") or {}).items():
        c = (entry.get("tags") or {}).get(tag)
        if c is not None:
            out[int(key)] = _copy(c.get("files") or {}, c.get("markers"), c.get("manifest"))
    return out


def holdings(listings: dict[str, Any], tag: str, saved: Saved) -> list[Holding]:
    """What each listed host holds of ``tag``, as the rules (node/replicas/rules.py) read it."""
    return [Holding(host=h, position=saved.position(h), own=_own(ls, tag),
                    copies=_replicas(ls, tag)) for h, ls in listings.items()]


def own_index(ls: dict[str, Any], tag: str, host: str, saved: Saved) -> int | None:
    """Which node index's complete part ``host``'s own ``tag`` dir holds; None if none
    (the rules' ``held_index`` and ``own_problem``)."""
    own = _own(ls, tag)
    if own is None:
        return None
    ranks = saved.ranks
    i = held_index(own, saved.position(host), saved.markers, ranks)
    if i is None or own_problem(own, i, tag, saved.markers, None if ranks is None else ranks.get(i)):
        return None
    return i


def sources(listings: dict[str, Any], tag: str, saved: Saved
            ) -> dict[int, list[tuple[str, str]]]:
    """node index -> [(host, "own" | "replica")] holding a usable copy of that part of
    ``tag`` (node/replicas/rules.part_sources)."""
    found, _ = part_sources(holdings(listings, tag, saved), tag, len(saved.hosts),
                            saved.markers, saved.ranks)
    return {i: [(s.host, s.kind) for s in src] for i, src in found.items() if src}


def candidate_tags(listings: dict[str, Any], markers: bool) -> list[str]:
    """Every tag some node has a copy or a replica of, newest first
    (node/replicas/rules.candidate_tags)."""
    own = [(t, _copy(files, (ls.get("markers") or {}).get(t)))
           for ls in listings.values() for t, files in (ls.get("tags") or {}).items() if files]
    copies = [(t, _copy(c.get("files") or {}, c.get("markers"), c.get("manifest")))
              for ls in listings.values() for entry in (ls.get("replicas") or {}).values()
              for t, c in (entry.get("tags") or {}).items() if c]
    return rule_tags(own, copies, markers)


def decide(listings: dict[str, Any], hosts: list[str], old_hosts: list[str], markers: bool,
           rpn: int) -> dict[str, Any]:
    """The plan: ``{"tag", "actions": {host: {...}}, "lines": [...], "newer": [...]}``
    (``newer``: the tags saved after ``tag`` that cannot be assembled from this run's
    nodes) or, when no tag can be assembled, ``{"missing": line}``; ``{"tag": None}`` when
    nothing was saved."""
    saved = Saved(tuple(old_hosts or hosts), markers, rpn)
    saves = candidate_tags(listings, markers)
    tags = [t for t in saves if sources(listings, t, saved)]
    if not tags:
        return {"tag": None}
    parts = len(saved.hosts)
    label = {i: f"node index {i}" + (f" (was {old_hosts[i]})" if i < len(old_hosts) else "")
             for i in range(max(parts, len(hosts)))}
    for tag in tags:
        src = sources(listings, tag, saved)
        if not all(src.get(i) for i in range(parts)):
            continue
        newer = saves[:saves.index(tag)]  # saved after it, not assemblable here
        if parts != len(hosts):
            return {**_gathers(tag, src, hosts, label, parts),
                    "world": _world(listings, tag) or parts * rpn, "newer": newer}
        return {**_moves(tag, src, hosts, label, listings, saved), "newer": newer}
    src = sources(listings, tags[0], saved)
    gone = [label[i] for i in range(parts) if not src.get(i)]
    return {"missing": f"checkpoint {tags[0]} cannot be assembled from this run's nodes: "
                       + ", ".join(gone) + ": no copy on any node of this run and no replica "
                       "of it there"}


def saved_after(listings: dict[str, Any], hosts: list[str], markers: bool, rpn: int,
                since: float) -> str | None:
    """The newest checkpoint complete on this run's nodes (:func:`decide`'s rule, replicas
    standing in) when it was saved after ``since`` (epoch seconds: the run's start stamp):
    a file of some node's own copy of it is newer; None otherwise (nothing complete, or
    only what the run began from: a half-written newer save does not count)."""
    tag = decide(listings, hosts, hosts, markers, rpn).get("tag")
    if not tag:
        return None
    written = [float(st[1]) for ls in listings.values()
               for st in ((ls.get("tags") or {}).get(tag) or {}).values()]
    return str(tag) if written and max(written) > since else None


def _moves(tag: str, src: dict[int, list[tuple[str, str]]], hosts: list[str],
           label: dict[int, str], listings: dict[str, Any], saved: Saved) -> dict[str, Any]:
    actions: dict[str, dict[str, Any]] = {
        h: {"index": i, "aside": _asides(listings.get(h) or {}, h, tag, i, saved),
            "get": "have", "push": []} for i, h in enumerate(hosts)}
    lines = []
    for i, host in enumerate(hosts):
        mine = dict(src[i])
        if mine.get(host) == "own":
            continue
        if mine.get(host) == "replica":
            actions[host]["get"] = "promote"
            lines.append(f"{label[i]} -> {host}: from its replica on {host}")
            continue
        # Another node pushes it: a verified replica first, else that part's own copy.
        holder = sorted(mine.items(), key=lambda kv: (kv[1] != "replica", hosts.index(kv[0])))[0]
        actions[host]["get"] = "receive"
        actions[holder[0]]["push"].append({"part": i, "to": host, "kind": holder[1]})
        what = "replica" if holder[1] == "replica" else "own copy"
        lines.append(f"{label[i]} -> {host}: from its {what} on {holder[0]}")
    moved = [f"{h}: its own {t} (node index {j}'s part) kept as a replica of it"
             for h, a in actions.items() for t, j in a["aside"] if j >= 0]
    return {"tag": tag, "actions": actions, "lines": lines + moved}


def _gathers(tag: str, src: dict[int, list[tuple[str, str]]], hosts: list[str],
             label: dict[int, str], parts: int) -> dict[str, Any]:
    """Another number of nodes: every part of ``tag`` is copied into
    the shared run dir by a node holding it (its own copy first), converted there to
    DeepSpeed's universal checkpoint, and that is copied to every node."""
    actions: dict[str, dict[str, Any]] = {h: {"gather": []} for h in hosts}
    lines = []
    for i in range(parts):
        host, kind = sorted(src[i], key=lambda hk: (hk[1] != "own", hosts.index(hk[0])))[0]
        actions[host]["gather"].append([i, kind])
        lines.append(f"{label[i]}: from its {'own copy' if kind == 'own' else 'replica'} on {host}")
    return {"tag": tag, "reshard": True, "actions": actions, "lines": lines}


def _world(listings: dict[str, Any], tag: str) -> int:
    """The world size that saved ``tag``: its highest rank file anywhere, plus one."""
    names: list[str] = []
    for ls in listings.values():
        names += list((ls.get("tags") or {}).get(tag) or {})
        for entry in (ls.get("replicas") or {}).values():
            names += list((((entry.get("tags") or {}).get(tag)) or {}).get("files", {}))
    return max(file_ranks(names), default=-1) + 1


def _asides(ls: dict[str, Any], host: str, tag: str, index: int, saved: Saved
            ) -> list[list[Any]]:
    """[tag, part] of this node's own tag dirs that hold another node index's part (they
    become replicas of that part: a later save of ``index`` must not land beside them);
    ``tag`` itself with part -1 when it holds no complete part (removed)."""
    out: list[list[Any]] = []
    for t, files in (ls.get("tags") or {}).items():
        if not files:
            continue
        j = own_index(ls, t, host, saved)
        if j is not None and j != index:
            out.append([t, j])
        elif j is None and t == tag:
            out.append([t, -1])
    return out


# ------------------------------------------------------------------ 3. restore (one node)


def aside(ckpt_dir: str, tag: str, part: int, job_id: str, host: str) -> None:
    """This node's own copy of ``tag`` is node index ``part``'s: into the replica area as a
    verified copy of that part (each file's sha256 in its manifest), or away (-1: no
    complete part)."""
    own = os.path.join(ckpt_dir, tag)
    if part < 0 or read_manifest(replica_dir(ckpt_dir, part, tag)) is not None:
        shutil.rmtree(own, ignore_errors=True)  # nothing complete, or a copy exists already
        return
    partial = os.path.join(replica_source_dir(ckpt_dir, part),
                           f"{REPLICA_PARTIAL_PREFIX}{tag}-aside")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    os.rename(own, os.path.join(partial, tag))
    latest = os.path.join(ckpt_dir, LATEST_FILE)
    if part == 0 and os.path.isfile(latest):
        shutil.copy2(latest, os.path.join(partial, LATEST_FILE))
    files = {}
    for d, dirs, names in os.walk(partial):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(d, n)
            rel = os.path.relpath(p, partial)
            files[rel] = (os.path.getsize(p), sha256_file(p), os.path.getmtime(p))
    commit_copy(partial, replica_dir(ckpt_dir, part, tag),
                new_manifest(job_id, tag, part, host, host, files))


def promote(ckpt_dir: str, tag: str, index: int) -> tuple[int, int]:
    """The replica of node index ``index``'s part becomes this node's own copy: every file
    checked against the manifest, then the tag dir renamed into place (it appears whole,
    marker included) and ``latest`` after it. (files, bytes)."""
    root = replica_dir(ckpt_dir, index, tag)
    manifest = read_manifest(root)
    if manifest is None:
        raise ReplicaError(f"no complete replica of {tag} of node index {index} here")
    bad = [rel for rel, f in manifest["files"].items()
           if sha256_file(os.path.join(root, rel)) != f["sha256"]]
    if bad:
        raise ReplicaError(f"sha256 differs from the replica manifest's: {', '.join(bad[:3])}")
    os.makedirs(ckpt_dir, exist_ok=True)
    dest = os.path.join(ckpt_dir, tag)
    if os.path.exists(dest):
        shutil.rmtree(dest)
    os.rename(os.path.join(root, tag), dest)
    for rel in manifest["files"]:
        if "/" not in rel and os.path.isfile(os.path.join(root, rel)):  # latest, the scripts
            os.replace(os.path.join(root, rel), os.path.join(ckpt_dir, rel))
    shutil.rmtree(root, ignore_errors=True)
    return len(manifest["files"]), sum(int(f["size"]) for f in manifest["files"].values())


def restore(plan: dict[str, Any], me: str, ckpt_dir: str, job_id: str, secret: str,
            addresses: dict[str, str]) -> int:
    """This node's part of ``plan``: aside, receive (a server), push, promote."""
    act = plan["actions"].get(me)
    if act is None:
        return 0
    tag, index = plan["tag"], int(act["index"])
    for t, part in act["aside"]:
        aside(ckpt_dir, str(t), int(part), job_id, me)
    server = None
    if act["get"] == "receive":
        server = ReplicaServer(job_id, index, me, ckpt_dir, secret, address=addresses[me])
        server.start()
    try:
        failed = [why for p in act["push"] for why in [_push_one(p, plan, me, ckpt_dir, job_id,
                                                                 secret, addresses)] if why]
        for why in failed:
            say(why, err=True)
        if server is not None and not _wait_manifest(replica_dir(ckpt_dir, index, tag)):
            say(f"{me}: node index {index}'s part of {tag} did not arrive within "
                f"{RECEIVE_WAIT_S:g} s", err=True)
            return 1
    finally:
        if server is not None:
            server.stop()
    if act["get"] in ("receive", "promote"):
        try:
            n, size = promote(ckpt_dir, tag, index)
        except (ReplicaError, OSError) as exc:
            say(f"{me}: cannot take node index {index}'s part of {tag}: {exc}", err=True)
            return 1
        say(f"restored {tag}'s node index {index} part onto {me}: {n} files, {size / 1e6:.1f} MB, "
            "each file's sha256 equal to its replica manifest's")
    return 1 if failed else 0


def gather(plan: dict[str, Any], me: str, ckpt_dir: str, dest: str) -> int:
    """This node's parts of a reshard plan into ``dest`` (the shared run dir): ``<tag>/...``
    and node 0's ``latest``; a replica's files checked against its manifest. The ZeRO 0-2
    model states file is node 0's (as collect-ckpt takes it: checkpoints/collect/discover.py)."""
    tag = plan["tag"]
    for part, kind in (plan["actions"].get(me) or {}).get("gather", []):
        root = ckpt_dir if kind == "own" else replica_dir(ckpt_dir, int(part), tag)
        manifest = read_manifest(root) if kind != "own" else None
        for rel in push_files(root, tag, int(part)):
            if int(part) != 0 and MODEL_STATES_RE.match(os.path.basename(rel)):
                continue  # ZeRO 0-2: every node wrote one; node 0's alone has shared_params
            out = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            tmp = f"{out}.{me}.part"  # nodes write the same model-states file name
            shutil.copyfile(os.path.join(root, rel), tmp)
            if manifest is not None and sha256_file(tmp) != manifest["files"][rel]["sha256"]:
                os.remove(tmp)
                say(f"{me}: {rel} of node index {part}'s replica differs from its manifest",
                    err=True)
                return 1
            os.replace(tmp, out)
        say(f"gathered {tag}'s node index {part} part from {me}")
    return 0


def spread(tag_dir: str, ckpt_dir: str) -> int:
    """The converted universal checkpoint into this node's checkpoint dir: copied beside
    it, then renamed into place (it appears whole, its marker with it)."""
    name = os.path.basename(tag_dir.rstrip("/"))
    final, tmp = os.path.join(ckpt_dir, name), os.path.join(ckpt_dir, f".{name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(ckpt_dir, exist_ok=True)
    shutil.copytree(tag_dir, tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    return 0


def spread_into(gathered: str, ckpt_dir: str, doc: dict[str, Any], me: str) -> int:
    """A tag dir converted inside itself (checkpoints/convert/tagdir.py) merged into this
    node's copy of it: ``doc["files"]`` (relative to the checkpoint dir: size, sha256),
    each copied beside its place, checked and renamed over it, the marker last
    (contract.goes_last); nothing of the node's own removed. The in-place layout
    (accelerate's ``step_N/pytorch_model``) has ``doc["aside"]`` = [the conversion's
    place, the old world's tag's new name]: the node's own copy of that tag is renamed
    first, when it holds a rank's optimizer shard (launch's rule, jobs/reshard.py: a node
    new to the mapping has none; a place holding the conversion already has none)."""
    files = {str(rel): (int(v[0]), str(v[1])) for rel, v in doc["files"].items()}
    if doc.get("aside"):
        conv, original = (os.path.join(ckpt_dir, p) for p in doc["aside"])
        if _holds_optim_states(conv):
            try:
                os.rename(conv, original)
            except OSError as exc:
                say(f"{me}: cannot move {conv} aside to {original} before the conversion "
                    f"takes its place: {exc}; move {original} away (it is kept otherwise), "
                    "then submit again", err=True)
                return 1
            say(f"{me}: moved {doc['aside'][0]} aside to {doc['aside'][1]} (kept)")
    for rel in sorted(files, key=lambda r: (goes_last(r), r)):
        size, digest = files[rel]
        final = os.path.join(ckpt_dir, rel)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = final + ".clusterkit-partial"
        shutil.copyfile(os.path.join(gathered, rel), tmp)
        if os.path.getsize(tmp) != size or sha256_file(tmp) != digest:
            os.remove(tmp)
            say(f"{me}: {rel}: its copy differs from the converted one in {gathered}", err=True)
            return 1
        os.replace(tmp, final)
    say(f"{me}: {len(files)} files of the converted {doc['tag']} in place "
        f"({sum(s for s, _ in files.values()) / 1e6:.1f} MB, sha256 verified)")
    return 0


def _holds_optim_states(tag_dir: str) -> bool:
    try:
        # launch's shell glob, `*optim_states.pt` (jobs/reshard.py): the same names
        return any(n.endswith("optim_states.pt") for n in os.listdir(tag_dir))
    except OSError:
        return False


def _push_one(p: dict[str, Any], plan: dict[str, Any], me: str, ckpt_dir: str, job_id: str,
              secret: str, addresses: dict[str, str]) -> str | None:
    tag, part, to = plan["tag"], int(p["part"]), str(p["to"])
    # An own copy that this node moved aside a moment ago is read from its replica area.
    root = replica_dir(ckpt_dir, part, tag)
    if p["kind"] == "own" and read_manifest(root) is None:
        root = ckpt_dir
    target = {"node": to, "index": part, "address": addresses[to]}
    end, why = time.monotonic() + PUSH_TRIES_S, ""
    while time.monotonic() < end:
        try:
            push(root, tag, target, job_id=job_id, source=part, source_host=me, secret=secret,
                 tags=[tag], stop=threading.Event())
            return None
        except (ReplicaError, OSError) as exc:
            why = str(exc)
            time.sleep(1.0)
    return f"{me}: could not send node index {part}'s part of {tag} to {to}: {why}"


def _wait_manifest(root: str) -> bool:
    end = time.monotonic() + RECEIVE_WAIT_S
    while time.monotonic() < end:
        if read_manifest(root) is not None:
            return True
        time.sleep(0.5)
    return False
