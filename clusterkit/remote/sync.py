"""``clusterkit sync``: a code directory to the same path under every node's workdir.

Per node, over the transport (the same SSH seam as everything else), two runs of
the node program :mod:`clusterkit.node.sync`:

1. ``plan``: the node compares our manifest (size + mtime) with its copy and
   returns the sha256 of files whose size matches but mtime differs;
2. ``apply``: only the files that differ travel, as one tar stream on stdin;
   the node writes each atomically, checks its sha256, sets mode and mtime, and
   (with ``--delete``) removes files we do not have.

Files matching the ignore file (``.clusterkitignore`` in the directory,
gitignore-style) and ``.git/`` never travel. Nothing is cached locally: a second
sync asks the nodes again, so a file changed on a node is noticed too.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import posixpath
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.errors import TransportError
from clusterkit.node.ship import node_command
from clusterkit.remote.base import CommandResult, GroupResult, SSHTarget, Transport
from clusterkit.remote.fanout import fan_out

IGNORE_FILE = ".clusterkitignore"
# Never sent, never deleted: VCS data, bytecode, and the job dirs launch keeps in the
# workdir (.clusterkit/jobs/<job>: logs, rendered files) which --delete must not touch.
ALWAYS_IGNORED = (".git/", "__pycache__/", "*.pyc", "/.clusterkit/")
SYNC_TIMEOUT_S = 600.0
MAX_BYTES = 2 << 30  # one in-memory tar stream per node: a code dir, not a dataset


@dataclass(frozen=True)
class _Rule:
    pattern: str
    negate: bool
    dir_only: bool
    anchored: bool


@dataclass(frozen=True)
class Ignore:
    """gitignore-style rules: ``#``, ``!``, trailing ``/``, leading ``/``, ``*``, ``?``, ``**``."""

    rules: tuple[_Rule, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Ignore:
        rules = []
        for raw in text.splitlines():
            line = raw.rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = line[1:] if negate else line
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            rules.append(_Rule(line.lstrip("/"), negate, dir_only, anchored))
        return cls(tuple(rules))

    def ignored_path(self, rel: str) -> bool:
        """A file path: ignored itself or under an ignored directory."""
        parts = rel.split("/")
        return self.ignored(rel, False) or any(
            self.ignored("/".join(parts[:i]), True) for i in range(1, len(parts)))

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """The last matching rule decides (gitignore semantics)."""
        verdict = False
        for r in self.rules:
            if r.dir_only and not is_dir:
                continue
            target = rel if r.anchored else posixpath.basename(rel)
            if _glob(target, r.pattern):
                verdict = not r.negate
        return verdict


def _glob(path: str, pattern: str) -> bool:
    if "**" in pattern:  # "a/**/b" matches a/b, a/x/b, a/x/y/b
        return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(
            path, pattern.replace("**/", ""))
    return fnmatch.fnmatchcase(path, pattern) and path.count("/") == pattern.count("/")


def load_ignore(src: str, extra: str | None = None, protect: Sequence[str] = ()) -> Ignore:
    """The rules for one sync; ``protect``: destination-relative dirs (checkpoints) to
    leave alone on the nodes (added last: the last match wins, so no ``!`` undoes them)."""
    texts = ["\n".join(ALWAYS_IGNORED)]
    for path in (os.path.join(src, IGNORE_FILE), extra):
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                texts.append(fh.read())
    texts.append("\n".join(f"/{p.strip('/')}/" for p in protect))
    return Ignore.parse("\n".join(texts))


@dataclass(frozen=True)
class LocalFile:
    size: int
    mtime: float
    mode: int
    path: str  # absolute, on this machine


def manifest(src: str, ignore: Ignore) -> dict[str, LocalFile]:
    """Every regular file under ``src`` that is not ignored, by POSIX relative path."""
    out: dict[str, LocalFile] = {}
    for d, dirs, names in os.walk(src):
        rel_dir = os.path.relpath(d, src).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirs[:] = sorted(x for x in dirs if not ignore.ignored(rel_dir + x, True))
        for n in sorted(names):
            p = os.path.join(d, n)
            if os.path.islink(p) or not os.path.isfile(p) or ignore.ignored(rel_dir + n, False):
                continue
            st = os.stat(p)
            out[rel_dir + n] = LocalFile(st.st_size, st.st_mtime, st.st_mode & 0o7777, p)
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class SyncNode:
    name: str
    target: SSHTarget
    python: str
    dest: str  # absolute directory on the node


@dataclass
class NodeSync:
    """What one node got: files written (verified), mtimes fixed, deleted, unchanged."""

    node: str
    written: list[str] = field(default_factory=list)
    bytes: int = 0
    touched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: int = 0
    extra: list[str] = field(default_factory=list)  # on the node only, kept (no --delete)

    def summary(self) -> str:
        """One line without the node's name (equal lines fold into node ranges)."""
        parts = [f"{len(self.written)} file(s) sent ({self.bytes:,} bytes, verified)",
                 f"{self.unchanged} unchanged"]
        if self.touched:
            parts.append(f"{len(self.touched)} mtime(s) fixed")
        if self.deleted:
            parts.append(f"{len(self.deleted)} deleted")
        if self.extra:
            parts.append(f"{len(self.extra)} extra file(s) kept (--delete removes them)")
        return ", ".join(parts)


def _node_json(res: CommandResult, node: str, what: str) -> dict[str, Any]:
    line = (res.stdout.strip().splitlines() or [""])[-1]
    try:
        data = json.loads(line)
    except ValueError:
        data = None
    if not isinstance(data, dict) or "error" in data or not res.ok:
        why = data.get("error") if isinstance(data, dict) else (res.stderr.strip()[-300:] or line)
        raise TransportError(f"sync {what} failed (exit {res.exit_code}): {why}", kind="sync",
                             host=node, hint="check the workdir on the node (permissions, space)")
    return data


def sync_node(transport: Transport, node: SyncNode, files: dict[str, LocalFile], *,
              delete: bool = False, ignore: Ignore | None = None) -> NodeSync:
    wanted = {rel: [f.size, f.mtime] for rel, f in files.items()}
    cmd = node_command(node.python, "sync", ["plan", node.dest],
                       payload=(json.dumps({"files": wanted}) + "\n").encode())
    plan = _node_json(transport.run(node.target, cmd.argv, stdin=cmd.stdin,
                                    timeout=SYNC_TIMEOUT_S), node.name, "plan")
    # Ignored files on the node (its own __pycache__, logs) are neither extra nor deleted.
    plan["extra"] = [r for r in plan["extra"] if not (ignore and ignore.ignored_path(r))]
    send = list(plan["send"])
    checks: dict[str, str] = dict(plan["check"])
    touch = {rel: files[rel].mtime for rel, sha in checks.items() if sha == _sha256(files[rel].path)}
    send += sorted(set(checks) - set(touch))
    out = NodeSync(node.name, unchanged=len(plan["same"]) + len(touch),
                   extra=[] if delete else list(plan["extra"]))
    if not send and not touch and not (delete and plan["extra"]):
        return out
    header = {"files": {rel: [_sha256(files[rel].path), files[rel].mtime, files[rel].mode]
                        for rel in send},
              "touch": touch, "delete": list(plan["extra"]) if delete else []}
    cmd = node_command(node.python, "sync", ["apply", node.dest],
                       payload=(json.dumps(header) + "\n").encode() + _tar(files, send))
    done = _node_json(transport.run(node.target, cmd.argv, stdin=cmd.stdin,
                                    timeout=SYNC_TIMEOUT_S), node.name, "apply")
    out.written = list(done["written"])
    out.bytes = int(done["bytes"])
    out.touched = list(done["touched"])
    out.deleted = list(done["deleted"])
    return out


def _tar(files: dict[str, LocalFile], send: Sequence[str]) -> bytes:
    if sum(files[rel].size for rel in send) > MAX_BYTES:
        raise TransportError(f"{len(send)} files to sync exceed {MAX_BYTES >> 30} GiB",
                             kind="usage", hint=f"exclude data and outputs in {IGNORE_FILE}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in send:
            tar.add(files[rel].path, arcname=rel, recursive=False)
    return buf.getvalue()


def sync_all(transport: Transport, nodes: Sequence[SyncNode], files: dict[str, LocalFile], *,
             delete: bool = False, ignore: Ignore | None = None, max_parallel: int = 16
             ) -> tuple[dict[str, NodeSync], GroupResult]:
    """Sync every node in parallel; per-node results plus the group (failures inside)."""
    results: dict[str, NodeSync] = {}
    by_name = {n.name: n for n in nodes}

    def work(target: SSHTarget) -> CommandResult:
        results[target.name] = sync_node(transport, by_name[target.name], files, delete=delete,
                                         ignore=ignore)
        return CommandResult(target.name, ("sync",), 0, "", "", 0.0)

    group = fan_out([n.target for n in nodes], work, per_host_budget_s=2 * SYNC_TIMEOUT_S,
                    max_parallel=max_parallel)
    return results, group
