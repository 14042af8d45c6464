"""The node contract is spelled once: ``clusterkit/node/contract.py`` (issue 23, item 4).

Scans the code of ``clusterkit/`` (string literals, f-string pieces; not comments or
docstrings, which may name a variable for a reader) and the bash of ``templates/``
(not its comment lines) for a second spelling of a contract name: a ``CLUSTERKIT_*``
environment name, a placeholder token, the completion-marker name, or a path of the
job-dir layout (``JobDir``). Every such name comes from the contract module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from clusterkit.node import contract
from clusterkit.node.contract import JobDir
from tests.paths import REPO

CONTRACT = REPO / "clusterkit" / "node" / "contract.py"
CK_NAME = re.compile(r"@?CLUSTERKIT_[A-Z0-9_]+@?")
# Settings only this machine's clusterkit reads (they never cross to a node or a rank),
# and render words replaced before a command leaves the launcher: each in its one module.
LOCAL_NAMES = {
    "CLUSTERKIT_DEBUG": "clusterkit/cli/main.py",
    "CLUSTERKIT_HOME": "clusterkit/jobs/here.py",
    "CLUSTERKIT_INVENTORY": "clusterkit/jobs/here.py",
    "CLUSTERKIT_SSH_CLIENT": "clusterkit/remote/openssh.py",
    "CLUSTERKIT_SLURMWATCH_EOF": "clusterkit/render/sbatch.py",  # a here-doc's end word
    "@CLUSTERKIT_MASTER_ADDR@": "clusterkit/launchers/argv.py",
    "@CLUSTERKIT_MASTER_PORT@": "clusterkit/launchers/argv.py",
    "@CLUSTERKIT_MASTER_": "clusterkit/launchers/argv.py",  # in the message about both
    "@CLUSTERKIT_NODE_RANK@": "clusterkit/shellsafe.py",
    # Node code that cannot import the contract: the fork server runs as one source file in
    # its own interpreter, and the probe also runs as one hand-copied file (docs/doctor.md).
    "CLUSTERKIT_RANK_SLOT": "clusterkit/node/agent/zygote.py",
    "CLUSTERKIT_PROBE_CLOCK_OFFSET_S": "clusterkit/node/facts/probe.py",
}
# A path piece that is not the job dir's: the embedded local cluster's own directories.
NOT_JOB_DIR = {("clusterkit/inventory.py", "nodes")}
CONTRACT_NAMES = {v for k, v in vars(contract).items()
                  if k.startswith("ENV_") and isinstance(v, str)} | {contract.SUMMARY_PREFIX.strip()}
TOKENS = (contract.JOB_ID_TOKEN, contract.JOB_DIR_TOKEN, contract.MARKER_PREFIX)
# The layout's file names (distinctive anywhere) and its directory names (as a path piece).
LAYOUT_FILES = (JobDir.DS_CONFIG, JobDir.SUMMARY, JobDir.AGENT_STATE, JobDir.LAUNCHER_LOG,
                JobDir.SLURM_NODES, contract.HEARTBEAT_SUFFIX, contract.STACKS_SUFFIX)
LAYOUT_DIRS = (JobDir.LOGS, JobDir.RANK_LOGS, JobDir.RUN, JobDir.EXITS, JobDir.STOP,
               JobDir.PROGRESS, JobDir.HANG, JobDir.HANGS, JobDir.STACKS, JobDir.NODES)
DIR_PIECE = re.compile(r"(?:^|/)(" + "|".join(LAYOUT_DIRS) + r")(?:/|$)")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal of a module that is not a docstring; a path
    joined from literal pieces (``os.path.join(d, "logs")``, ``p / "stacks"``) counts as
    ``/piece``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "join" \
                and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "attr", "") == "path":
            out += [(a.lineno, "/" + a.value) for a in node.args[1:]
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) \
                and isinstance(node.right, ast.Constant) and isinstance(node.right.value, str):
            out.append((node.lineno, "/" + node.right.value))
    return out


def _template_lines(path: Path) -> list[tuple[int, str]]:
    text = re.sub(r"\{#.*?#\}", lambda m: "\n" * m.group(0).count("\n"), path.read_text(), flags=re.S)
    return [(i, line) for i, line in enumerate(text.splitlines(), 1)
            if not line.lstrip().startswith("#") or line.startswith(("#!", "#SBATCH"))]


def _findings(rel: str, line: int, text: str) -> list[str]:
    where = f"{rel}:{line}"
    found = []
    for name in CK_NAME.findall(text):
        if name in LOCAL_NAMES:
            if LOCAL_NAMES[name] != rel:
                found.append(f"{where}: {name} belongs to {LOCAL_NAMES[name]}")
        elif name in CONTRACT_NAMES:
            found.append(f"{where}: {name} is spelled again (import it from clusterkit.node.contract)")
        else:
            found.append(f"{where}: {name} is not in clusterkit/node/contract.py")
    found += [f"{where}: {tok!r} is the contract's" for tok in TOKENS if tok in text]
    found += [f"{where}: {f!r} is JobDir's" for f in LAYOUT_FILES if text.endswith(f)]
    if "/" in text and not text.startswith(("http", "--")):
        found += [f"{where}: the path piece {m!r} is JobDir's" for m in DIR_PIECE.findall(text)
                  if (rel, m) not in NOT_JOB_DIR]
    return found


def _literal_sources() -> list[tuple[str, list[tuple[int, str]]]]:
    out = []
    for path in sorted((REPO / "clusterkit").rglob("*.py")):
        if path != CONTRACT:
            out.append((str(path.relative_to(REPO)), _literals(path)))
    for path in sorted((REPO / "templates").glob("*.j2")):
        out.append((str(path.relative_to(REPO)), _template_lines(path)))
    return out


def test_no_second_spelling_of_a_contract_name() -> None:
    found = [f for rel, lines in _literal_sources() for line, text in lines
             for f in _findings(rel, line, text)]
    assert not found, "\n".join(found)


def test_the_scan_finds_a_second_spelling() -> None:
    """The scan itself: each kind of second spelling is caught, a local setting is not."""
    assert _findings("clusterkit/x.py", 1, "CLUSTERKIT_JOB_ID")
    assert _findings("clusterkit/x.py", 1, "CLUSTERKIT_NEW_THING")
    assert _findings("clusterkit/x.py", 1, "jobs/@JOB@")
    assert _findings("clusterkit/x.py", 1, "clusterkit-complete.node")
    assert _findings("clusterkit/x.py", 1, "/logs")
    assert _findings("clusterkit/x.py", 1, ".heartbeat")
    assert _findings("templates/x.j2", 1, 'rm -f "$CLUSTERKIT_STOP_FILE"')
    assert not _findings("clusterkit/cli/main.py", 1, "CLUSTERKIT_DEBUG")
    assert _findings("clusterkit/cli/cmd_launch.py", 1, "CLUSTERKIT_DEBUG")
    assert not _findings("clusterkit/x.py", 1, "stop")  # a word, not a path piece


def test_local_names_are_where_the_test_says() -> None:
    for name, rel in LOCAL_NAMES.items():
        assert name in (REPO / rel).read_text(encoding="utf-8"), (name, rel)
