"""Node program: what every node of a job must agree on (the pre-launch gate's facts).

Interpreter path, Python version and the versions of the packages every rank
imports, read from package metadata only: importing torch here would cost
seconds on every launch. The agent reports these as its ``facts`` event; run on
its own it prints them as one JSON line. ``clusterkit`` is the version importable
by this interpreter (None when absent: only the bundled workload needs it) and
``clusterkit_digest`` a digest of its sources, so "the same version" means the
same code (``clusterkit nodes install`` compares it with the launcher's). Beside
them, what the job needs on this node (``NEED_*``): its files, its directories
created and written for real, the master address resolved and the master port free.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from clusterkit.node.facts import envfacts, sitepaths
from clusterkit.node.facts.parity import MUST, packages

PACKAGES = packages(MUST)  # the versions every node must agree on (node/facts/parity.py)


def _version(name: str) -> str | None:
    try:
        from importlib import metadata  # Python >= 3.8; an older node reports nothing

        return metadata.version(name)
    except Exception:  # any broken metadata reads as "not installed"
        return None


def package_digest(directory: str) -> str:
    """sha256 over the package's ``.py`` files (relative path and content), in order.

    ``templates`` is left out: in a source tree it lives outside the package directory
    (pyproject maps it in), so only an installed copy has it there.
    """
    h = hashlib.sha256()
    for d, dirs, names in os.walk(directory):
        top = os.path.normpath(d) == os.path.normpath(directory)
        dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not (top and x == "templates"))
        for n in sorted(names):
            if n.endswith(".py"):
                path = os.path.join(d, n)
                h.update(os.path.relpath(path, directory).replace(os.sep, "/").encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(fh.read() + b"\0")
    return h.hexdigest()


def clusterkit_facts(version: Callable[[str], str | None] = _version) -> dict[str, Any]:
    """Version and digest of an importable clusterkit, found without importing it.

    ``version``: how to read a distribution's version (the probe passes a cheaper one).
    When shipped, ``clusterkit`` in sys.modules is the bootstrap's empty package:
    set it aside while asking the import system where the real one would come from.
    """
    import importlib.util

    sitepaths.finish("clusterkit")  # under -S: an editable install's finder, sitecustomize

    ours = {k: sys.modules.pop(k) for k in list(sys.modules)
            if k == "clusterkit" or k.startswith("clusterkit.")}
    try:
        spec = importlib.util.find_spec("clusterkit")
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.modules.update(ours)
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    if not where:
        return {"clusterkit": None, "clusterkit_digest": None}
    return {"clusterkit": version("clusterkit") or "unknown",
            "clusterkit_digest": package_digest(where[0])}


# What a job needs on a node, one string each (the agent passes them through as they are):
# an absolute path is a file the ranks open (the user's script); the others are
# ``KIND:VALUE``. The launcher builds them with the functions below (launch/gate.py).
NEED_DIR = "dir:"  # WHAT=PATH: a directory the job must be able to create and write there
NEED_PORT = "port:"  # a TCP port the master (rank 0's node) must be able to listen on
NEED_RESOLVE = "resolve:"  # the master address every rank connects to


def need_dir(path: str, what: str = "checkpoint dir") -> str:
    """``what`` names the directory in the report (``checkpoint dir``, ``job dir``)."""
    return f"{NEED_DIR}{what}={path}"


def need_port(port: int) -> str:
    return f"{NEED_PORT}{port}"


def need_resolve(address: str) -> str:
    return NEED_RESOLVE + address


def dir_problem(path: str) -> str | None:
    """Why the ranks could not create and write ``path`` here (None: they can).

    Probed for real, by creating and removing a directory in ``path`` or in its nearest
    existing parent: ``os.access`` says yes to root on /proc and on a root-squashed NFS
    mount (issue 25: ``--ckpt-dir /proc/nope`` passed the gate and failed in the ranks).
    Nothing is left behind, so a dry run stays dry."""
    import tempfile

    base = path
    while not os.path.lexists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        return f"cannot be created: {base} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".clusterkit-probe-", dir=base))
    except OSError as exc:
        if base == path:
            return f"is not writable ({exc.strerror})"
        return f"cannot be created in {base} ({exc.strerror})"
    return None


def port_problem(port: int) -> str | None:
    """Why the master could not listen on ``port`` here (None: it can). SO_REUSEADDR as
    torch's TCPStore sets it: a closed connection in TIME_WAIT is no obstacle."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def resolve_problem(address: str) -> str | None:
    import socket

    try:
        socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


# -- "Node-local" checkpoint dirs that are one filesystem (issue 32): each node writes a
# token naming itself into the dir (or its nearest existing parent: nothing is created),
# then lists the tokens of this round it can see. The launcher removes them only after
# every node has looked (the agent after GO or a stop, run_gate and doctor by a second
# command), so of two nodes sharing the dir the one that writes second sees the first's
# token: "A sees B or B sees A" is the shared relation (shared_groups).
NEED_UNSHARED = "unshared:"  # RUN:NODE=PATH: PATH must not be this node's alone
TOKEN_PREFIX = ".clusterkit-token."
TOKEN_STALE_S = 3600.0  # a token this old was left by a killed round: any round removes it


def need_unshared(path: str, run: str, node: str) -> str:
    return f"{NEED_UNSHARED}{run}:{node}={path}"


def _unshared(value: str) -> tuple[str, str, str]:
    """``RUN:NODE=PATH`` (the part after NEED_UNSHARED) -> (run, node, path)."""
    head, _, path = value.partition("=")
    run, _, node = head.rpartition(":")
    return run, node, path


def token_name(run: str, node: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{run}.{node}")
    return TOKEN_PREFIX + safe


def _base(path: str) -> tuple[str, str]:
    """(the nearest existing directory of ``path``, the rest of ``path`` below it)."""
    base = os.path.abspath(path)
    while not os.path.isdir(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    return base, os.path.relpath(os.path.abspath(path), base)


def token_seen(path: str, run: str, node: str, now: float | None = None) -> dict[str, Any]:
    """Write this node's token for ``path`` and list the other nodes' tokens of ``run``
    naming the same directory: ``{"seen": [nodes]}``, or ``{"error": why}``."""
    import time

    base, tail = _base(path)
    now = time.time() if now is None else now
    mine = token_name(run, node)
    # Named per node too: on a shared dir two nodes' writers may have the same pid.
    tmp = os.path.join(base, f".clusterkit-tokentmp.{mine[len(TOKEN_PREFIX):]}.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"run": run, "node": node, "tail": tail}, fh)
        os.replace(tmp, os.path.join(base, mine))
        names = os.listdir(base)
    except OSError as exc:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        return {"error": f"cannot write a token in {base} ({exc.strerror or exc})"}
    seen = []
    for name in names:
        if not name.startswith(TOKEN_PREFIX) or name == mine:
            continue
        p = os.path.join(base, name)
        try:
            if now - os.stat(p).st_mtime > TOKEN_STALE_S:
                os.unlink(p)
                continue
            with open(p, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue  # removed while we looked, or being written: not this round's anyway
        if isinstance(data, dict) and data.get("run") == run and data.get("tail") == tail:
            seen.append(str(data.get("node")))
    return {"seen": sorted(seen)}


def drop_tokens(needs: Sequence[str]) -> None:
    """Remove this node's tokens of ``needs`` (after every node has looked); a dir
    created since the token was written: the token is in one of its parents."""
    for value in (n[len(NEED_UNSHARED):] for n in needs if n.startswith(NEED_UNSHARED)):
        run, node, path = _unshared(value)
        d = os.path.abspath(path)
        while True:
            try:
                os.unlink(os.path.join(d, token_name(run, node)))
                break
            except OSError:
                if os.path.dirname(d) == d:
                    break
                d = os.path.dirname(d)


def shared_groups(seen: Mapping[str, Sequence[str]], order: Sequence[str] = ()) -> list[list[str]]:
    """The nodes that share one directory: ``seen[a]`` lists the nodes whose token ``a``
    saw; a and b share when either saw the other (the second to write sees the first).
    Groups of two or more, each in ``order`` (then by name), first node first."""
    group: dict[str, set[str]] = {}
    for a, others in seen.items():
        for b in others:
            if b == a:
                continue
            merged = group.get(a, {a}) | group.get(b, {b})
            for n in merged:
                group[n] = merged
    rank = {n: i for i, n in enumerate(order)}

    def key(n: str) -> tuple[int, str]:
        return rank.get(n, len(rank)), n

    out = {tuple(sorted(g, key=key)) for g in group.values()}
    return [list(g) for g in sorted(out, key=lambda g: key(g[0]))]


def shared_verdict(facts: Mapping[str, Mapping[str, Any]], order: Sequence[str] = ()
                   ) -> list[tuple[str, list[str]]]:
    """(dir, the nodes sharing it) from the nodes' facts (their ``unshared`` key: the
    gate's, doctor's); a node whose token could not be written takes no part."""
    seen: dict[str, list[str]] = {}
    where: dict[str, str] = {}
    for node, f in facts.items():
        found = f.get("unshared")
        for path, result in (found.items() if isinstance(found, Mapping) else ()):
            if isinstance(result, Mapping) and isinstance(result.get("seen"), list):
                seen.setdefault(node, []).extend(str(n) for n in result["seen"])
                where[node] = str(path)
    return [(where.get(g[0], "?"), g) for g in shared_groups(seen, order)]


# One spelling for the gate, doctor and collect-ckpt (``where``: the nodes, folded).
SHARED_FIX = "--storage shared, or a checkpoint.local_dir (--ckpt-dir) on each node's own disk"


def shared_line(path: str, where: str) -> str:
    return (f"checkpoint dir {path} is one directory shared by {where} (a file written on one "
            "is seen on the others): node-local checkpoints and replicas would collide there")


def gate_facts(needs: Sequence[str] = ()) -> dict[str, Any]:
    """``needs``: what the job needs on this node (see ``NEED_*``): ``missing`` lists the
    absent files, ``unwritable`` the directories the job could not write (``WHAT=PATH``
    -> why), ``port``/``resolve`` what the master port and address checks found."""
    sitepaths.add()  # shipped under -S: the package directories, as ranks will see them
    facts: dict[str, Any] = {"python": sys.executable, "version": sys.version.split()[0]}
    facts.update({name: _version(name) for name in PACKAGES})
    facts.update(clusterkit_facts())
    facts["env"] = envfacts.env_state(sys.prefix)  # its record of `nodes env`: no hashing
    facts["missing"] = [p for p in needs if p.startswith("/") and not os.path.isfile(p)]
    checks: dict[str, tuple[str, Callable[[str], str | None]]] = {
        NEED_DIR: ("unwritable", lambda v: dir_problem(v.partition("=")[2])),
        NEED_PORT: ("port", lambda v: port_problem(int(v))),
        NEED_RESOLVE: ("resolve", resolve_problem)}
    for prefix, (key, check) in checks.items():
        found = {n[len(prefix):]: check(n[len(prefix):]) for n in needs if n.startswith(prefix)}
        facts[key] = {value: why for value, why in found.items() if why is not None}
    tokens = [_unshared(n[len(NEED_UNSHARED):]) for n in needs if n.startswith(NEED_UNSHARED)]
    if tokens:
        facts["unshared"] = {path: token_seen(path, run, node) for run, node, path in tokens}
    return facts


def main(argv: list[str] | None = None) -> int:
    """Arguments: the files the job needs on this node; ``--drop NEEDS``: remove this
    node's tokens of an earlier call (every node has looked)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--drop"]:
        drop_tokens(args[1:])
        return 0
    sys.stdout.write(json.dumps(gate_facts(args)) + "\n")
    sys.stdout.flush()
    return 0
