"""Node program: checkpoint replicas of a node-local ``clusterkit sbatch`` job (issue 31).

The batch script (templates/sbatch.sh.j2) starts it, the one way node programs are
started (``python -S -u -c BOOTSTRAP slurm.replica ...``, the sources on stdin: a file
the script writes once per run, given to every task with ``srun --input=all``):

* ``serve CONF RUN_DIR`` on every node, an overlapping step (``srun --overlap``) beside
  the ranks: ``clusterkit launch``'s own replication service
  (``node/replicas/service.py``: the same server, completion rule, pushes, retries,
  pruning, record in ``JOBDIR/nodes/<node>/replicas.json`` and lines in its
  ``launcher.log``), for this node's index in the allocation. It ends when the script
  writes ``RUN_DIR/end``: ``ok`` (the ranks exited 0: push what is due, BYE, wait for
  the sources, bounded) or anything else (stop at once);
* ``list``, ``plan``, ``restore``: a run on another node set (``node/slurm/restore.py``),
  or, for a user's program whose restart is readied (CONF's ``program``, the rule
  spec/resume.resume_rule rendered), any run after a save; then ``ready`` on every node:
  its checkpoint dir readied by the plan's ``prep.json`` (node/ckpt/ready.py, the rule a
  launch's agents follow: newer unassemblable tags moved aside, DeepSpeed's ``latest``,
  HF's ``checkpoint-N/latest``), the program's resume words in ``RUN_DIR/resume``;
  on another number of nodes (the bundled workload) ``gather`` every part into the
  shared ``RUN_DIR/gather``, where the script converts it to DeepSpeed's universal
  checkpoint (checkpoints/convert/universal.py), and ``spread`` the result to every node;
* ``saved``, at USR1 for a program that does not save on SIGUSR1, after ``list`` beside
  the ranks: whether the newest checkpoint complete on every node was saved in this run
  (node/slurm/end.py ends the step and requeues only then).

``CONF`` is one JSON word: ``job_id``, ``job_dir``, ``ckpt_dir``, ``rpn`` (ranks per
node), ``markers`` (the program writes completion markers), ``replicas`` (K),
``program`` (how a user's program resumes; empty for the bundled workload). The
run's hosts are ``RUN_DIR/hosts`` (node index order, one per line: ``scontrol show
hostnames``), the per-run secret is ``RUN_DIR/secret`` (mode 0600, made by the script,
removed when it ends: never on a command line, in an environment or in a log).

Placement is node/replicas/rules.ring, the rule ``plan/build.py`` places a launch's copies
by, on the allocation: node i's copies go to the next K nodes in node order, as a ring,
skipping a node with the same host name or address.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any

from clusterkit.node.ckpt.ready import (
    Readiness,
    newest_holder,
    prep_doc,
    readiness,
    ready_checkpoints,
    spread_line,
)
from clusterkit.node.contract import (
    OTHER_WORLD_AS_IS,
    OTHER_WORLD_REFUSE,
    SLURM_RESUMED_FROM,
    SLURM_SPREAD_DIR,
    JobDir,
)
from clusterkit.node.files import write_atomic
from clusterkit.node.hashing import sha256_file
from clusterkit.node.replicas import priority
from clusterkit.node.replicas.rules import ring, ring_sources
from clusterkit.node.replicas.service import ReplicaService
from clusterkit.node.slurm import restore

END_FILE = "end"
RESHARD_FILE = "reshard"  # the tag to reshard (written by plan): gather, convert, spread
GATHER_DIR = "gather"
UNIVERSAL_FILE = "universal"  # the converted tag's name (the script writes it)
SPREAD_FILE = "spread.json"  # a conversion inside the tag dir: the files to merge (the same)
# A run after such a conversion, nothing complete saved since: the converted tag it resumes
# from again (written by the script's `slurm_reshard again` step, read by `plan`).
CONVERTED_FILE = "converted"
PREP_FILE = "prep.json"  # plan -> every node's `ready` (node/ckpt/ready.prep_doc)
RESUME_FILE = "resume"  # plan -> the script: the program's resume words, NUL-separated
RECEIVE_WAIT_S = 600.0  # a node waiting for a one-writer file (its writer copies it at once)
SAVED_FILE = "saved_in_run"  # saved -> node/slurm/end.py at USR1: a tag, or empty
VERBS = ("serve", "list", "plan", "restore", "gather", "spread", "ready", "saved")
END_OK = "ok"
POLL_S = 1.0
FINISH_PUSH_S = 240.0  # the end of a job: outstanding pushes, then the sources' BYE
FINISH_SOURCES_S = 120.0


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as fh:
        return [ln.strip() for ln in fh if ln.strip()]


def address_of(host: str) -> str:
    """The host's first IPv4 address (as the script resolves the head node)."""
    return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])


def replica_config(conf: dict[str, Any], hosts: list[str], addresses: list[str], me: str,
                   secret: str) -> dict[str, Any]:
    """``AgentSpec.replica`` (node/replicas/service.py's REPLICA_KEYS) for node ``me``."""
    index = hosts.index(me)
    k, rpn = int(conf["replicas"]), int(conf["rpn"])
    identities = [(hosts[i], addresses[i]) for i in range(len(hosts))]
    targets = [{"node": hosts[j], "index": j, "address": addresses[j]}
               for j in ring(index, identities, k)]
    sources = ring_sources(index, identities, k)
    return {"index": index, "address": addresses[index], "ckpt_dir": conf["ckpt_dir"],
            "ranks": list(range(index * rpn, (index + 1) * rpn)),
            "markers": bool(conf["markers"]), "targets": targets, "sources": sources,
            "secret": secret}


class _Log:
    """The node's ``launcher.log`` in the shared job dir (what launch's agent writes)."""

    def __init__(self, job_dir: str, node: str) -> None:
        self.path = JobDir(job_dir).node_log(node)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def __call__(self, text: str) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(time.strftime("%Y-%m-%dT%H:%M:%SZ ", time.gmtime()) + text + "\n")

    def event(self, ev: Any) -> None:
        """A copy's end: the log line is written by the service; one that gave up is said
        on the job's output too (the console of a launch says it the same way)."""
        if getattr(ev, "state", None) is not None and str(ev.state.value) != "complete":
            print(f"clusterkit: replica {ev.tag}: copy from {ev.node} to {ev.target} failed: "
                  f"{ev.detail}", flush=True)
        elif getattr(ev, "message", None):
            print(f"clusterkit: {ev.node}: {ev.message}", flush=True)


def serve(conf: dict[str, Any], run_dir: str) -> int:
    me = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    hosts = read_lines(os.path.join(run_dir, "hosts"))
    with open(os.path.join(run_dir, "secret"), encoding="utf-8") as fh:
        secret = fh.read().strip()
    addresses = [address_of(h) for h in hosts]
    log = _Log(conf["job_dir"], me)
    words = priority.lower_this_session()  # below the ranks, if it leads a session
    if words:
        log(f"replica: the copy process runs in a session of its own: {words}")
    svc = ReplicaService(replica_config(conf, hosts, addresses, me, secret), conf["job_id"], me,
                         JobDir(conf["job_dir"]).replica_state(me), log.event, log)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    svc.start()
    end = os.path.join(run_dir, END_FILE)
    while not stopping and not os.path.exists(end):
        time.sleep(POLL_S)
    word = ""
    if not stopping:
        with open(end, encoding="utf-8") as fh:
            word = fh.read().strip()
    if word == END_OK:
        svc.finish(FINISH_PUSH_S, FINISH_SOURCES_S)
    else:
        svc.abort()
        log("replica: the job step did not end well: copies stopped")
    return 0


def main(argv: list[str]) -> int:
    # The script's USR1 (time limit, preemption) goes to every step of the job: the
    # ranks save; this program keeps copying (their save is what it copies next).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if len(argv) != 3 or argv[0] not in VERBS:
        sys.stderr.write(f"usage: slurm.replica {'|'.join(VERBS)} CONF RUN_DIR\n")
        return 2
    verb, conf, run_dir = argv[0], json.loads(argv[1]), argv[2]
    me = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    if verb == "serve":
        return serve(conf, run_dir)
    if verb == "list":
        return restore.write_listing(conf["ckpt_dir"], run_dir, me)
    if verb == "plan":
        return plan(conf, run_dir)
    if verb == "saved":
        return saved(conf, run_dir)
    if verb == "ready":
        return ready_node(conf["ckpt_dir"], run_dir, me)
    if verb == "spread":
        return spread(conf["ckpt_dir"], run_dir, me)
    with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as fh:
        the_plan = json.load(fh)
    if verb == "gather":
        return restore.gather(the_plan, me, conf["ckpt_dir"],
                                   os.path.join(run_dir, GATHER_DIR))
    with open(os.path.join(run_dir, "secret"), encoding="utf-8") as fh:
        secret = fh.read().strip()
    hosts = read_lines(os.path.join(run_dir, "hosts"))
    return restore.restore(the_plan, me, conf["ckpt_dir"], conf["job_id"], secret,
                                {h: address_of(h) for h in hosts})


def spread(ckpt_dir: str, run_dir: str, me: str) -> int:
    """``spread``: the converted checkpoint onto this node: a conversion inside the
    program's tag dir (``SPREAD_FILE``, written by the conversion step) merged into the
    node's copy of it; a top-level universal tag copied whole."""
    gathered = os.path.join(run_dir, GATHER_DIR)
    try:
        with open(os.path.join(run_dir, SPREAD_FILE), encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        with open(os.path.join(run_dir, UNIVERSAL_FILE), encoding="utf-8") as fh:
            name = fh.read().strip()
        return restore.spread(os.path.join(gathered, name), ckpt_dir)
    return restore.spread_into(gathered, ckpt_dir, doc, me)


def plan(conf: dict[str, Any], run_dir: str) -> int:
    """Decide (node/slurm/restore.py), write ``plan.json`` when parts must move, ready a
    user's program for the tag (``prep.json`` for every node's ``ready``, ``resume``: its
    resume words), say why."""
    hosts = read_lines(os.path.join(run_dir, "hosts"))
    old = read_lines(os.path.join(run_dir, "old_hosts"))
    listings = read_listings(run_dir, hosts)
    p = converted_plan(run_dir, listings) or \
        restore.decide(listings, hosts, old, bool(conf["markers"]), int(conf["rpn"]))
    job, was, now = conf["job_id"], ",".join(old), ",".join(hosts)
    try:  # the node lists as Slurm writes them (node[1-4])
        with open(JobDir(conf["job_dir"]).path(JobDir.SLURM_NODES), encoding="utf-8") as fh:
            was = fh.read().strip() or was
    except OSError:
        pass
    now = os.environ.get("SLURM_JOB_NODELIST") or now
    refusal = _refusal(p, conf, job, was, now, hosts, old)
    if refusal is not None:
        restore.say(refusal, err=True)
        return restore.CANNOT_ASSEMBLE
    rule = conf.get("program") or {}
    if p.get("reshard") and other_world(rule) == OTHER_WORLD_AS_IS:
        p = {"tag": None}  # what it loads is its top-level file, as it is: convert nothing
    spread = one_writer_copies(listings) if rule.get("one_writer") else {}
    written = bool(rule.get("one_writer")) and any(ls.get("top") for ls in listings.values())
    if p.get("tag") is None:
        _say_untagged(rule, written, job, was, now, hosts, old)
        if rule:
            _write_prep(run_dir, conf["ckpt_dir"], None, spread)
        return 0
    ready = readiness(rule, conf["ckpt_dir"], p["tag"], p.get("newer") or []) if rule else None
    if ready is not None and ready.refusal is not None:
        restore.say(ready.refusal, err=True)
        return restore.CANNOT_ASSEMBLE
    _say_moves(p, job, was, now, hosts, old, run_dir)
    if ready is not None:
        for line in ready.lines:
            restore.say(line)
        _write_prep(run_dir, conf["ckpt_dir"], ready, spread)
    return 0


def read_listings(run_dir: str, hosts: list[str]) -> dict[str, Any]:
    """Each host's listing (``list``); a host not listed holds nothing that counts."""
    listings = {}
    for h in hosts:
        try:
            with open(os.path.join(run_dir, "list", f"{h}.json"), encoding="utf-8") as fh:
                listings[h] = json.load(fh)
        except (OSError, ValueError):
            listings[h] = {}
    return listings


def saved(conf: dict[str, Any], run_dir: str) -> int:
    """``saved``, on the batch host at USR1 (a program that does not save on SIGUSR1),
    after ``list`` on every node: ``RUN_DIR/saved_in_run`` holds the newest checkpoint
    complete on every node of this run when it was saved since the run's start stamp, or
    an empty line (node/slurm/end.py reads it; no file there: it falls back to the batch
    host's own dir)."""
    hosts = read_lines(os.path.join(run_dir, "hosts"))
    try:
        since = os.stat(JobDir(conf["job_dir"]).path(JobDir.RUN_STARTED)).st_mtime
    except OSError:
        return 1  # no start stamp: nothing to judge by
    tag = restore.saved_after(read_listings(run_dir, hosts), hosts, bool(conf["markers"]),
                              int(conf["rpn"]), since)
    write_atomic(os.path.join(run_dir, SAVED_FILE), (tag or "") + "\n")
    return 0


def converted_plan(run_dir: str, listings: dict[str, Any]) -> dict[str, Any] | None:
    """The plan when the script's ``again`` step found a tag converted inside itself by an
    earlier run on another number of nodes, complete on every node of this one, nothing
    complete saved since (``CONVERTED_FILE``; launch's rule, jobs/reshard.converted_again):
    that tag, nothing moved, the saves after it ``newer``; None otherwise."""
    try:
        tag = read_lines(os.path.join(run_dir, CONVERTED_FILE))[0]
    except (OSError, IndexError):
        return None
    saves = restore.candidate_tags(listings, False)
    return {"tag": tag, "lines": [], "newer": saves[:saves.index(tag)] if tag in saves else []}


def _say_untagged(rule: dict[str, Any], written: bool, job: str, was: str, now: str,
                  hosts: list[str], old: list[str]) -> None:
    """The plan's line when no tag is to be resumed: a snapshot (``written``: some node
    holds a top-level file of a one-writer program) going on as it is, or a fresh start."""
    if written and other_world(rule) == OTHER_WORLD_AS_IS and len(hosts) != len(old):
        restore.say(f"job {job}: this run got {len(hosts)} nodes, {now}; the checkpoint was "
                    f"saved on {len(old)}, {was}: it loads on any world size as it is: its "
                    "newest copy is put on every node, nothing converted")
    if not written:
        restore.say(f"job {job}: no checkpoint on its nodes ({now}) or in their replicas: "
                    "starting fresh" if hosts == old else
                    f"job {job}: this run got {now} (the checkpoint's nodes were {was}); no "
                    "checkpoint on any of them or in their replicas: starting fresh")


def one_writer_copies(listings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each file at the top of the checkpoint dir that some node of this run lacks or
    holds another version of (a snapshot rank 0 saved on its own node): ``{name: {"from":
    its newest copy's host (node/ckpt/ready.newest_holder, the launch's rule), "mtime",
    "to": [the hosts behind]}}``."""
    out: dict[str, dict[str, Any]] = {}
    names = sorted({n for ls in listings.values() for n in (ls.get("top") or {})
                    if not n.startswith(".")})
    for name in names:
        stats = {h: _size_mtime((ls.get("top") or {}).get(name)) for h, ls in listings.items()}
        src = newest_holder({h: st[1] for h, st in stats.items() if st is not None})
        if src is None:
            continue
        ref = stats[src]
        behind = [h for h, st in stats.items() if h != src and st != ref]
        if behind and ref is not None:
            out[name] = {"from": src, "mtime": ref[1], "to": behind}
    return out


def _size_mtime(st: list[Any] | None) -> tuple[int, float] | None:
    return None if not st else (int(st[0]), float(st[1]))


def _write_prep(run_dir: str, ckpt_dir: str, ready: Readiness | None,
                spread: dict[str, dict[str, Any]]) -> None:
    """``prep.json`` for every node's ``ready`` step; ``resume``: the resume words,
    NUL-separated (the script reads them with ``read -d ''``)."""
    write_atomic(os.path.join(run_dir, PREP_FILE), ready.prep(ckpt_dir, spread)
                 if ready is not None else prep_doc(ckpt_dir, spread=spread))
    if ready is not None and ready.resume:
        write_atomic(os.path.join(run_dir, RESUME_FILE), "".join(w + "\0" for w in ready.resume))
        write_atomic(os.path.join(run_dir, SLURM_RESUMED_FROM), ready.tag + "\n")
    for name, c in sorted(spread.items()):
        restore.say(spread_line(name, c["from"], ",".join(c["to"])))


def _refusal(p: dict[str, Any], conf: dict[str, Any], job: str, was: str, now: str,
             hosts: list[str], old: list[str]) -> str | None:
    """Why this run must not start (no tag can be assembled here; a program's checkpoint
    the script does not convert for another number of nodes); None when it may."""
    if p.get("missing"):
        return (f"job {job} keeps node-local checkpoints on {was}, but this run got {now}: not "
                f"starting fresh: {p['missing']}. Bring those nodes back and submit again on "
                "them, or gather and move the shards: clusterkit collect-ckpt --scatter, then "
                "remove JOBDIR/" + JobDir.SLURM_NODES)
    if p.get("tag") is None and hosts != old and not set(old) & set(hosts):
        return (f"job {job} keeps node-local checkpoints on {was}, but this run got {now}, "
                f"where no part of them is: not starting fresh. Submit again on {was} "
                "(clusterkit sbatch --submit pins them), or gather and move the shards: "
                "clusterkit collect-ckpt --scatter, then remove JOBDIR/" + JobDir.SLURM_NODES)
    rule = conf.get("program") or {}
    if rule and other_world(rule) == OTHER_WORLD_AS_IS and old and old[0] not in hosts:
        return writer_gone(job, was, now, old[0], conf["ckpt_dir"])
    if p.get("reshard") and rule and other_world(rule) == OTHER_WORLD_REFUSE:
        why, fix = rule.get("other_world_why"), rule.get("other_world_fix")
        return (f"job {job}: its checkpoint {p['tag']} was saved on {len(old)} nodes ({was}), "
                f"this run got {len(hosts)} ({now}): clusterkit sbatch converts no "
                f"{rule.get('name')} checkpoint ({rule.get('layout')}) for another number of "
                "nodes" + (f": {why}" if why else "") + ": not starting. Submit it on "
                f"{len(old)} nodes, " + (f"or {fix}, " if fix else "") + "or take its weights: "
                f"clusterkit collect-ckpt {job} --consolidate fp32 (docs/programs.md)")
    return None


def other_world(rule: dict[str, Any]) -> str:
    """How the program's checkpoint continues on another number of nodes (its rule's
    ``other_world``, spec/resume.sbatch_other_world; the job dir holds the node code of
    the clusterkit that rendered the rule, so the two always agree)."""
    return str(rule.get("other_world", OTHER_WORLD_REFUSE))


def writer_gone(job: str, was: str, now: str, writer: str, ckpt_dir: str) -> str:
    """A snapshot's run without the node that holds its newest copy: rank 0 saved it on
    node index 0 of the last run only, and a node's local disk is read only from inside
    the allocation, so any copy on this run's nodes may be older (a silent step back)."""
    return (f"job {job}: its newest snapshot is on {writer} (rank 0's node of {was}), which "
            f"this run ({now}) did not get: not starting. Submit it on nodes including "
            f"{writer} (clusterkit sbatch --submit does), or fetch it with clusterkit "
            f"collect-ckpt {job}, put it in {ckpt_dir} on every node it will run on and remove "
            f"JOBDIR/{JobDir.SLURM_NODES}")


def _say_moves(p: dict[str, Any], job: str, was: str, now: str, hosts: list[str],
               old: list[str], run_dir: str) -> None:
    """The plan's lines; ``plan.json`` (and the reshard word) when parts must move."""
    if not p["lines"]:
        restore.say(f"job {job}: every node of this run ({now}) holds its part of {p['tag']}"
                    + ("" if hosts == old else f" already (was {was})"))
        return
    if p.get("reshard"):
        restore.say(f"job {job}: this run got {len(hosts)} nodes, {now}; the checkpoint "
                    f"was saved on {len(old)}, {was}: resharding {p['tag']} (gathered in "
                    "the job dir, converted to DeepSpeed's universal checkpoint, copied to "
                    "every node) before the ranks start")
        with open(os.path.join(run_dir, RESHARD_FILE), "w", encoding="utf-8") as fh:
            fh.write(p["tag"] + "\n")
    elif hosts == old:
        restore.say(f"job {job}: restoring the parts of {p['tag']} its nodes lack before the "
                    "ranks start")
    else:
        restore.say(f"job {job}: this run got {now}, not the checkpoint's nodes {was}: "
                    f"moving the parts of {p['tag']} before the ranks start")
    for line in p["lines"]:
        restore.say("  " + line)
    write_atomic(os.path.join(run_dir, "plan.json"), json.dumps(p))


def ready_node(ckpt_dir: str, run_dir: str, me: str) -> int:
    """``ready``: this node's checkpoint dir readied by the plan's ``prep.json``
    (node/ckpt/ready.py, the launch agents' rule), after the one-writer files it lacks
    are copied in from their writer through the shared run dir (every node runs this at
    once: a writer puts its file there, the others wait for it)."""
    with open(os.path.join(run_dir, PREP_FILE), encoding="utf-8") as fh:
        prep = fh.read()
    spread = json.loads(prep).get("spread") or {}
    shared = os.path.join(run_dir, SLURM_SPREAD_DIR)
    for name, c in sorted(spread.items()):
        if c["from"] == me:
            export_file(os.path.join(ckpt_dir, name), shared)
    for name, c in sorted(spread.items()):
        if me in c["to"]:
            if not import_file(shared, name, ckpt_dir, float(c["mtime"]), RECEIVE_WAIT_S):
                restore.say(f"{me}: {name}: its writer's copy did not arrive in {shared} within "
                            f"{RECEIVE_WAIT_S:.0f} s, or its sha256 differs", err=True)
                return 1
            restore.say(f"{me}: {name}: copied from {c['from']} (sha256 verified)")
    for line in ready_checkpoints(prep):
        restore.say(f"{me}: {line}")
    return 0


def export_file(path: str, shared: str) -> None:
    """The writer's copy into the shared run dir, with its own sha256 beside it (what each
    node checks its copy against: the whole route from the writer), each whole."""
    os.makedirs(shared, exist_ok=True)
    name = os.path.basename(path)
    tmp = os.path.join(shared, f".{name}.part")
    digest = sha256_file(path)
    shutil.copyfile(path, tmp)
    write_atomic(os.path.join(shared, name + ".sha256"), digest)
    os.replace(tmp, os.path.join(shared, name))


def import_file(shared: str, name: str, ckpt_dir: str, mtime: float, wait_s: float) -> bool:
    """The writer's copy from the shared run dir into this node's checkpoint dir (beside
    it first, renamed over: a program never finds half a file), its sha256 checked and
    its mtime the writer's (a later run sees the same file); False when it does not
    arrive in ``wait_s`` or differs."""
    src, digest_file = os.path.join(shared, name), os.path.join(shared, name + ".sha256")
    end = time.monotonic() + wait_s
    while not (os.path.exists(src) and os.path.exists(digest_file)):
        if time.monotonic() > end:
            return False
        time.sleep(POLL_S)
    with open(digest_file, encoding="utf-8") as fh:
        digest = fh.read().strip()
    os.makedirs(ckpt_dir, exist_ok=True)
    tmp = os.path.join(ckpt_dir, f".{name}.clusterkit-partial")
    shutil.copyfile(src, tmp)
    if sha256_file(tmp) != digest:
        os.remove(tmp)
        return False
    os.utime(tmp, (mtime, mtime))
    os.replace(tmp, os.path.join(ckpt_dir, name))
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
