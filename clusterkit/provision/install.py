"""``clusterkit nodes install``: this exact clusterkit, as a locally built wheel, on the nodes.

Only the bundled workload (``python -m clusterkit.workload``) needs clusterkit on
the nodes; launch, doctor and collect-ckpt ship their node code on every run.
The wheel is built here from the source tree clusterkit runs from (``pip wheel
--no-deps --no-build-isolation --no-index``: nothing is downloaded) or given with
``--wheel``; each node gets it over the SSH session's stdin (node program
:mod:`clusterkit.node.provision.install`) and installs it offline with ``--no-index
--no-deps``. "The same version" means the same sources: a node whose installed
clusterkit has the launcher's source digest is left alone, so a second run does
nothing; after installing, the digest is checked again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import clusterkit
from clusterkit.errors import ClusterkitError, TransportError
from clusterkit.node.facts.gatefacts import package_digest
from clusterkit.node.protocol import ProtocolError, answer_of
from clusterkit.remote.base import CommandResult, GroupResult, SSHTarget, Transport
from clusterkit.remote.fanout import fan_out
from clusterkit.ship import node_command

INSTALL_TIMEOUT_S = 600.0
FACTS_TIMEOUT_S = 60.0


def local_digest() -> str:
    return package_digest(os.path.dirname(clusterkit.__file__))


def check_wheel(wheel: Path) -> None:
    """``--wheel FILE`` before anything connects: a readable zip that holds clusterkit.

    One line naming ``--wheel`` (exit 2) for a missing file, a directory or a file that
    is no wheel, instead of an OSError or zipfile.BadZipFile from the middle of a run.
    """
    hint = "pass a clusterkit wheel (pip wheel --no-deps .), or no --wheel to build one here"
    if not wheel.is_file():
        why = "is a directory" if wheel.is_dir() else "does not exist"
        raise ClusterkitError(f"{why}, not a wheel file", path=str(wheel), key="--wheel",
                              hint=hint)
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        raise ClusterkitError(f"is not a wheel ({exc})", path=str(wheel), key="--wheel",
                              hint=hint) from None
    if not any(n.startswith("clusterkit/") for n in names):
        raise ClusterkitError("holds no clusterkit package", path=str(wheel), key="--wheel",
                              hint=hint)


def wheel_digest(wheel: Path, scratch: str) -> str:
    """The source digest of the clusterkit inside ``wheel`` (what the nodes must end up with).

    Taken from the wheel itself, not from the tree: the tree may change while we install.
    """
    out = Path(scratch) / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(out, [n for n in zf.namelist() if n.startswith("clusterkit/")])
    if not (out / "clusterkit").is_dir():
        raise ClusterkitError(f"{wheel} holds no clusterkit package", path=str(wheel),
                              hint="pass a clusterkit wheel (or no --wheel to build one)")
    return package_digest(str(out / "clusterkit"))


def build_wheel(out_dir: str) -> Path:
    """A wheel of the clusterkit this process runs, built from its source tree, offline."""
    root = Path(clusterkit.__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        raise ClusterkitError(
            f"clusterkit here is not running from a source tree ({root} has no pyproject.toml)",
            hint="pass --wheel FILE (the wheel this clusterkit was installed from)")
    # Built from a fresh copy: setuptools reuses build/lib, where a module deleted from
    # the tree would live on and end up in the wheel.
    src = Path(out_dir) / "src"
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(
        ".git", "build", "sync_chain", "*.egg-info", "__pycache__", "tests", ".venv*"))
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--no-index", "--disable-pip-version-check", "-w", out_dir, str(src)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    wheels = sorted(Path(out_dir).glob("clusterkit-*.whl"))
    if res.returncode != 0 or not wheels:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ClusterkitError(f"building the clusterkit wheel failed: {tail[0]}",
                              hint="`pip wheel --no-deps --no-build-isolation .` in the source "
                                   "tree shows the error (setuptools must be installed)")
    return wheels[-1]


@dataclass(frozen=True)
class InstallNode:
    name: str
    target: SSHTarget
    python: str


@dataclass(frozen=True)
class Installed:
    outcome: str  # "installed" | "already installed"
    version: str | None

    def summary(self) -> str:
        return f"{self.outcome} (clusterkit {self.version}, same sources as here)"


def node_json(res: CommandResult, node: str, what: str, kind: str = "install",
              hint: str | None = None) -> dict[str, Any]:
    """A node program's answer (node/protocol.answer_of; nodes env, build-ops and install
    read theirs so). None there: one error naming the node, with the last line of stderr
    (a traceback's, a missing interpreter's)."""
    try:
        return answer_of(res.stdout, what)
    except ProtocolError:
        tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise TransportError(f"{what}: no answer (exit {res.exit_code}): {tail[0][:300]}",
                             kind=kind, host=node, hint=hint) from None



def install_node(transport: Transport, node: InstallNode, wheel: Path, want: str) -> Installed:
    facts_cmd = node_command(node.python, "facts.gatefacts")
    facts = node_json(transport.run(node.target, facts_cmd.argv, stdin=facts_cmd.stdin,
                                    timeout=FACTS_TIMEOUT_S), node.name, "checking the node")
    if facts.get("clusterkit_digest") == want:
        return Installed("already installed", facts.get("clusterkit"))
    data = wheel.read_bytes()
    cmd = node_command(node.python, "provision.install", [wheel.name, str(len(data))], payload=data)
    out = node_json(transport.run(node.target, cmd.argv, stdin=cmd.stdin,
                                  timeout=INSTALL_TIMEOUT_S), node.name, "installing")
    if out.get("error") or out.get("pip_exit") != 0:
        why = out.get("error") or " / ".join(out.get("pip_tail") or [])
        raise TransportError(f"pip install failed: {why}", kind="install", host=node.name,
                             hint="the node's python needs pip (`<python> -m ensurepip`); "
                                  "dependencies are not installed (--no-deps): install them "
                                  "there from your own mirror or wheels")
    after = out.get("facts") or {}
    if after.get("clusterkit_digest") != want:
        raise TransportError("installed, but the node's clusterkit still differs from this one "
                             f"(version {after.get('clusterkit')})", kind="install",
                             host=node.name, hint="another clusterkit earlier on the node's "
                             "sys.path shadows it (PYTHONPATH, a source checkout)?")
    return Installed("installed", after.get("clusterkit"))


def install_all(transport: Transport, nodes: Sequence[InstallNode], wheel: Path | None = None,
                *, max_parallel: int = 16) -> tuple[dict[str, Installed], GroupResult]:
    with tempfile.TemporaryDirectory(prefix="clusterkit-wheel-") as tmp:
        built = wheel or build_wheel(tmp)
        want = wheel_digest(built, tmp)
        results: dict[str, Installed] = {}
        by_name = {n.name: n for n in nodes}

        def work(target: SSHTarget) -> CommandResult:
            results[target.name] = install_node(transport, by_name[target.name], built, want)
            return CommandResult(target.name, ("provision.install",), 0, "", "", 0.0)

        # One node per interpreter path first: where that path is on a shared filesystem
        # the others then find it installed instead of racing pip in one directory, and
        # a wheel that cannot install fails on one node, not all.
        first = list({n.python: n for n in reversed(nodes)}.values())
        rest = [n for n in nodes if n not in first]
        groups = [fan_out([n.target for n in wave], work,
                          per_host_budget_s=INSTALL_TIMEOUT_S + 2 * FACTS_TIMEOUT_S,
                          max_parallel=max_parallel) for wave in (first, rest) if wave]
    order = {n.name: i for i, n in enumerate(nodes)}
    merged = sorted((r for g in groups for r in g), key=lambda r: order[r.host])
    return results, GroupResult(tuple(merged))
