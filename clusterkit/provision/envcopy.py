"""``clusterkit nodes env``: the launcher's Python environment, byte for byte, on every node.

What travels (:func:`describe_local`): the environment the job uses (``sys.prefix``:
a venv, a conda env, a uv- or pyenv-managed Python), the base interpreter
(``sys.base_prefix``) when the environment is a venv that runs the base's stdlib,
and the source trees of editable installs that lie outside both. Each goes to the
same absolute path on every node. A base in the operating system's own directories
(``/usr``, ``/usr/local``) is not copied: the OS provides it, and its Python version
is checked instead.

Per node, in order (:func:`replicate`), never stopping at one node's failure:

1. facts (node program :mod:`clusterkit.node.facts.envfacts`, run by a bootstrap Python
   on the node: the environment itself is not there yet) and the pure
   :func:`refusal`: another CPU architecture, an older glibc, a path that exists and
   is no environment refuse the node before any byte moves; another OS release is a
   warning;
2. each part whose recorded digest on the node already equals ours is left alone;
   the others travel through :func:`transfer` (regular files, delta, verified);
3. ``facts.envfacts finish``: links made, every entry compared with our manifest, and the
   node's record written only when all are equal (the digest the gate reads).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.errors import ClusterkitError, TransportError
from clusterkit.node.facts import envfacts
from clusterkit.provision.install import node_json
from clusterkit.remote.base import CommandResult, SSHTarget, Transport
from clusterkit.remote.fanout import fan_out
from clusterkit.ship import node_command

FACTS_TIMEOUT_S = 60.0
FINISH_TIMEOUT_S = 1800.0  # hashes the environment on the node the first time (GBs)
SYSTEM_PREFIXES = ("/usr", "/usr/local")  # the OS's Python: never copied


@dataclass(frozen=True)
class Part:
    path: str  # absolute; the same on every node
    role: str  # "environment", "base interpreter", "editable source of NAME"
    copy: bool = True  # False: the OS's base (/usr): checked, not copied


@dataclass(frozen=True)
class EnvSource:
    prefix: str
    parts: tuple[Part, ...]
    facts: Mapping[str, Any]  # the launcher's own envfacts.facts()
    python_version: str  # "3.11"

    @property
    def copied(self) -> tuple[Part, ...]:
        return tuple(p for p in self.parts if p.copy)


def _site_packages(prefix: str) -> list[str]:
    out = []
    for lib in ("lib", "lib64"):
        try:
            names = sorted(os.listdir(os.path.join(prefix, lib)))
        except OSError:
            continue
        out += [os.path.join(prefix, lib, n, "site-packages") for n in names
                if n.startswith("python") and os.path.isdir(os.path.join(prefix, lib, n,
                                                                         "site-packages"))]
    return list(dict.fromkeys(os.path.realpath(p) for p in out))  # lib64 -> lib: once


def editable_trees(prefix: str) -> list[tuple[str, str]]:
    """(distribution, source directory) of every editable install in ``prefix``'s
    site-packages: PEP 610's ``direct_url.json`` with ``"editable": true``."""
    out = []
    for site in _site_packages(prefix):
        for name in sorted(os.listdir(site)):
            if not name.endswith(".dist-info"):
                continue
            try:
                with open(os.path.join(site, name, "direct_url.json"), encoding="utf-8") as fh:
                    info = json.load(fh)
            except (OSError, ValueError):
                continue
            url = str(info.get("url", ""))
            if (info.get("dir_info") or {}).get("editable") and url.startswith("file://"):
                out.append((name.split("-")[0], os.path.realpath(url[len("file://"):])))
    return out


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def interpreter_prefixes(python: str) -> tuple[str, str, str]:
    """(sys.prefix, sys.base_prefix, "X.Y") of another interpreter here."""
    import subprocess

    code = ("import json,sys;print(json.dumps([sys.prefix,sys.base_prefix,"
            "'%d.%d'%sys.version_info[:2]]))")
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                             check=False)
        prefix, base, version = json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        raise ClusterkitError("cannot run it to ask where its environment is", path=python,
                              key="--python", hint="give the job's interpreter, e.g. "
                              "/opt/venvs/train/bin/python") from None
    return str(prefix), str(base), str(version)


def describe_local(python: str | None = None, home: str | None = None) -> EnvSource:
    """The parts of ``python``'s environment (default: this interpreter's), refused here,
    before any node is asked, when an editable source tree cannot travel."""
    if python is None:
        prefix, base = sys.prefix, sys.base_prefix
        version = ".".join(map(str, sys.version_info[:2]))
    else:
        prefix, base, version = interpreter_prefixes(python)
    prefix, base = os.path.realpath(prefix), os.path.realpath(base)
    home = os.path.realpath(home or os.path.expanduser("~"))
    parts = [Part(prefix, "environment")]
    if base != prefix:
        parts.append(Part(base, "base interpreter", copy=base not in SYSTEM_PREFIXES))
    for dist, src in editable_trees(prefix):
        if any(_inside(src, p.path) for p in parts):
            continue
        if src in ("/", home) or _inside(prefix, src) or _inside(base, src):
            raise ClusterkitError(
                f"the editable install of {dist} points at {src}, which holds the environment "
                "or a whole home directory: it cannot travel as a source tree", path=src,
                hint=f"install {dist} non-editable (pip install {dist} from a wheel) or move "
                     "its sources to a directory of their own")
        parts.append(Part(src, f"editable source of {dist}"))
    # This machine's own facts: architecture, glibc, OS (its paths are hashed just after).
    return EnvSource(prefix, tuple(parts), envfacts.facts([]), version)


# ----------------------------------------------------------------------------- pure checks


def _version_tuple(v: object) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in str(v).split("."))
    except ValueError:
        return None


def refusal(here: Mapping[str, Any], there: Mapping[str, Any],
            parts: Sequence[Part]) -> tuple[str | None, list[str]]:
    """Why the launcher's environment cannot be copied to a node (None: it can), and the
    warnings. ``here``/``there``: envfacts.facts() of the launcher and of the node. One
    line each, without the node's name (lines fold into node ranges)."""
    if here.get("machine") != there.get("machine"):
        return (f"CPU architecture {there.get('machine')} here, {here.get('machine')} on the "
                "launcher: compiled packages (torch) run on one architecture only; build the "
                "environment on such a node, or leave this node out (--exclude)"), []
    mine, theirs = _version_tuple(here.get("glibc")), _version_tuple(there.get("glibc"))
    if mine and (theirs is None or theirs < mine):
        return (f"glibc {there.get('glibc') or 'not found'} here is older than the launcher's "
                f"{here.get('glibc')}: its compiled packages need glibc >= {here.get('glibc')}; "
                "upgrade this node's OS, or build the environment on the node with the oldest "
                "glibc and replicate from there"), []
    for part in parts:
        state = (there.get("paths") or {}).get(part.path) or {}
        kind = state.get("state")
        if not part.copy:
            if kind != "env":
                return (f"the base interpreter {part.path} (the OS's Python) is not here: "
                        "install the same Python package, or use a uv/pyenv/conda Python "
                        "that can travel"), []
            continue
        if kind == "other":
            what = state.get("what") or "no pyvenv.cfg, conda-meta or bin/python, no record"
            return (f"{part.path} exists and is not a Python environment ({what}): move it "
                    f"away (mv {part.path} {part.path}.old) or replicate to another path"), []
    warnings = []
    if here.get("os") != there.get("os"):
        warnings.append(f"OS release {there.get('os')} here, {here.get('os')} on the launcher: "
                        "copied anyway (same architecture, glibc new enough); system libraries "
                        "outside the environment may still differ")
    return None, warnings


def unchanged(source_digests: Mapping[str, str], there: Mapping[str, Any], part: Part) -> bool:
    """The node's record of ``part`` already has our digest and nothing changed there
    since (sizes, mtimes, packages): nothing to send."""
    state = (there.get("paths") or {}).get(part.path) or {}
    rec = state.get("record") or {}
    return (bool(rec.get("digest")) and rec.get("digest") == source_digests.get(part.path)
            and not state.get("changed"))


# ----------------------------------------------------------------------------- execution


@dataclass(frozen=True)
class EnvNode:
    name: str
    target: SSHTarget
    python: str  # a Python that exists on the node now (the environment may not)
    address: str = ""  # where the other nodes reach it (the chain's TCP hops)
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class NodeEnv:
    """What one node got."""

    node: str
    sent_files: int = 0
    sent_bytes: int = 0
    same_parts: int = 0
    digest: str = ""
    warnings: list[str] = field(default_factory=list)
    facts: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""  # why this node does not hold the environment (refused, failed)

    def summary(self) -> str:
        if self.error:
            return self.error
        sent = (f"{self.sent_files} file(s) sent ({self.sent_bytes:,} bytes, verified)"
                if self.sent_files else "nothing sent")
        return f"{sent}; environment {self.digest[:12]} equal to the launcher's"


# transfer(transport, nodes, part) -> node -> (why it failed or "", files, bytes): the
# part's regular files onto those nodes. The one way bytes move: clusterkit sync's.
Transfer = Callable[[Transport, Sequence[EnvNode], Part], dict[str, tuple[str, int, int]]]


def distribute_transfer(transport: Transport, nodes: Sequence[EnvNode], part: Part, *,
                        cache_dir: str | None = None,
                        on_progress: Callable[[Any], None] | None = None
                        ) -> dict[str, tuple[str, int, int]]:
    """The part through ``clusterkit sync``'s engine (sync/engine.py): one chain of
    the nodes, delta by sha256, each file verified on arrival."""
    from clusterkit.sync.engine import SyncNode, SyncOptions, sync_dir
    from clusterkit.sync.source import Ignore

    # links=False: the engine leaves links alone; envfacts finish makes the environment's
    # own, as written (an absolute bin/python -> /usr/bin/python3.11 included).
    opts = SyncOptions(delete=True, ignore=Ignore.parse("\n".join(envfacts.SKIPPED)),
                       cache_dir=cache_dir, on_progress=on_progress, links=False)
    res = sync_dir(transport, [SyncNode(n.name, n.target, n.python, n.address, part.path)
                               for n in nodes], part.path, part.path, options=opts)
    out = {}
    for n in nodes:
        r = res.nodes[n.name]
        why = "" if res.node_ok(n.name) else (
            f"copying {part.path} {r.state}: {r.why or r.summary()}" if r.state != "done"
            else f"copying {part.path}: {r.summary()}")
        out[n.name] = (why, r.files_sent, r.got_bytes)
    return out


def _node_json(res: CommandResult, node: str, what: str) -> dict[str, Any]:
    hint = "is --node-python a Python 3.8+ on the node?"
    data = node_json(res, node, what, "env", hint)
    if data.get("error"):
        raise TransportError(f"{what} failed: {data['error']}", kind="env", host=node, hint=hint)
    return data


def node_facts(transport: Transport, node: EnvNode, paths: Sequence[str]) -> dict[str, Any]:
    cmd = node_command(node.python, "facts.envfacts", ["facts", *paths])
    return _node_json(transport.run(node.target, cmd.argv, stdin=cmd.stdin,
                                    timeout=FACTS_TIMEOUT_S, env=dict(node.env) or None),
                      node.name, "reading the node's facts")


def record_source(source: EnvSource, token: str = ""
                  ) -> tuple[dict[str, str], dict[str, envfacts.Manifest]]:
    """Hash (or re-read from its record) every part here and record it (with this run's
    ``token``): path -> digest, and the manifests. The prefix's record carries the parts
    and the environment's digest."""
    manifests = {p.path: envfacts.local_manifest(p.path) for p in source.copied}
    digests = {path: envfacts.digest(m) for path, m in manifests.items()}
    env = env_record(source, digests)
    for part in source.copied:
        # A read-only part here: no record, the nodes' records still say what they hold.
        with contextlib.suppress(OSError):
            envfacts.write_record(part.path, manifests[part.path],
                                  env if part.path == source.prefix else None, token)
    return digests, manifests


def shared_here(token: str, there: Mapping[str, Any], part: Part) -> bool:
    """The node reads this run's token in the part's record: the part is this machine's
    own directory there (a shared filesystem). Copying it onto itself could only race
    the edits of whoever works in it: it is left alone."""
    rec = ((there.get("paths") or {}).get(part.path) or {}).get("record") or {}
    return bool(token) and rec.get("token") == token


def env_record(source: EnvSource, digests: Mapping[str, str]) -> dict[str, Any]:
    return {"env_digest": envfacts.combine(dict(digests)), "parts": dict(digests),
            "prefix": source.prefix}


def _fan(transport: Transport, nodes: Sequence[EnvNode], budget_s: float,
         work: Callable[[EnvNode], None], max_parallel: int) -> dict[str, str]:
    """``work`` on every node at once; node -> why it failed (nodes that did not fail: absent)."""
    by_name = {n.name: n for n in nodes}

    def one(target: SSHTarget) -> CommandResult:
        work(by_name[target.name])
        return CommandResult(target.name, ("env",), 0, "", "", 0.0)

    group = fan_out([n.target for n in nodes], one, per_host_budget_s=budget_s,
                    max_parallel=max_parallel)
    return {r.host: r.reason() or "failed" for r in group.failed}


def finish_node(transport: Transport, node: EnvNode, part: Part, want: envfacts.Manifest,
                env: Mapping[str, Any] | None) -> None:
    header = {"entries": want, "env": dict(env) if env else None}
    cmd = node_command(node.python, "facts.envfacts", ["finish", part.path],
                       payload=(json.dumps(header) + "\n").encode())
    done = _node_json(transport.run(node.target, cmd.argv, stdin=cmd.stdin,
                                    timeout=FINISH_TIMEOUT_S), node.name, "verifying")
    if "differ" in done:
        shown = ", ".join(done["differ"][:5])
        raise TransportError(f"{part.path}: {done['ndiffer']} file(s) still differ after the "
                             f"copy ({shown}): changed on the launcher meanwhile?", kind="env",
                             host=node.name, hint="run it again")


def _finish_one(transport: Transport, node: EnvNode, *, part: Part, want: envfacts.Manifest,
                env: Mapping[str, Any] | None) -> None:
    finish_node(transport, node, part, want, env)


def replicate(transport: Transport, nodes: Sequence[EnvNode], source: EnvSource, *,
              transfer: Transfer = distribute_transfer, max_parallel: int = 16
              ) -> dict[str, NodeEnv]:
    """Facts and refusals on every node first (no byte moves to a refused node), then each
    part through ``transfer`` to the nodes whose record differs from ours, verified."""
    token = secrets.token_hex(8)
    digests, manifests = record_source(source, token)
    env = env_record(source, digests)
    results = {n.name: NodeEnv(n.name, digest=env["env_digest"]) for n in nodes}
    paths = [p.path for p in source.parts]

    def facts(node: EnvNode) -> None:
        r = results[node.name]
        r.facts = node_facts(transport, node, paths)
        why, r.warnings = refusal(source.facts, r.facts, source.parts)
        if why is not None:
            r.error = f"refused: {why}"

    for name, why in _fan(transport, nodes, FACTS_TIMEOUT_S + 30, facts, max_parallel).items():
        results[name].error = why
    # The prefix last: its record (what the gate reads) exists only once all parts do.
    for part in sorted(source.copied, key=lambda p: p.path == source.prefix):
        todo = [n for n in nodes if not results[n.name].error
                and not unchanged(digests, results[n.name].facts, part)
                and not shared_here(token, results[n.name].facts, part)]
        for n in nodes:
            if not results[n.name].error and n not in todo:
                results[n.name].same_parts += 1
        if not todo:
            continue
        for name, (why, files, nbytes) in transfer(transport, todo, part).items():
            results[name].sent_files += files
            results[name].sent_bytes += nbytes
            results[name].error = why
        ready = [n for n in todo if not results[n.name].error]
        record = env if part.path == source.prefix else None
        failed = _fan(transport, ready, FINISH_TIMEOUT_S + 30, functools.partial(
            _finish_one, transport, part=part, want=manifests[part.path], env=record),
            max_parallel)
        for name, why in failed.items():
            results[name].error = why
    return results
