"""The documented layer order (docs/architecture.md), checked on every import (AST).

A module may import its own package and any package of a LOWER layer; never one of its
own layer (siblings stay independent) or above. Imports inside functions count too:
a lazy import is still a dependency. ``TYPE_CHECKING`` imports are exempt (types only).
"""

from __future__ import annotations

import ast
from pathlib import Path

import clusterkit

ROOT = Path(clusterkit.__file__).parent

# Bottom first. Each entry: the top-level modules/packages of clusterkit in that layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "node"),  # node: programs shipped to nodes, standard library only
    # ship: the launcher's half of node programs (what each ships, its command line)
    ("hostrange", "units", "fsutil", "backend_timeouts", "shellsafe", "ship"),
    ("inventory", "fold"),  # fold: rank-line folding for launch and sbatch --watch
    ("hostfile",),
    ("spec",),  # the job model: options, facts, plan values, ZeRO spec
    ("launchers",),  # the backend registry: one module per launcher, with its builders
    ("plan", "render"),  # siblings: the decisions; the one render of them
    ("remote", "slurm"),
    ("sync",),  # clusterkit sync's engine, above the transport it drives (docs/sync.md)
    ("provision",),  # node preparation: nodes env (through sync), install, build-ops
    ("checks", "launch", "checkpoints"),
    ("workload",),
    ("jobs",),  # a job as a whole: recovery, resolution, collect-ckpt end to end
    ("api",),  # the Python API (clusterkit/api.py): what the CLI verbs call
    ("cli",),
    ("__main__",),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# Imported by name only where a package has no dependency of its own on clusterkit.
STDLIB_ONLY = ("node",)
# (module, package it imports against the order): the reason it may stay. To stay empty.
ALLOWED: dict[tuple[str, str], str] = {}


def _package(path: Path, root: Path) -> str:
    return path.relative_to(root).with_suffix("").parts[0]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "clusterkit" and len(parts) > 1 and node.lineno not in skip:
                out.append((node.lineno, parts[1]))
    return out


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        if path.parent == root and path.name == "__init__.py":
            continue
        src = _package(path, root)
        assert src in LAYER, f"{path}: package {src!r} has no layer; add it to LAYERS and docs"
        for line, dst in _imports(path):
            if dst == src:
                continue
            assert dst in LAYER, f"{path}:{line}: clusterkit.{dst} has no layer"
            if (path.relative_to(root.parent).as_posix(), dst) in ALLOWED:
                continue
            if src in STDLIB_ONLY or LAYER[dst] >= LAYER[src]:
                bad.append(f"{path.relative_to(root.parent)}:{line}: {src} (layer {LAYER[src]}) "
                           f"imports {dst} (layer {LAYER[dst]})")
    return bad


def test_imports_follow_the_layer_order() -> None:
    assert violations() == []


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    # The checker itself, on a small tree: plan and render (siblings) importing each other
    # are both reported, a function-level (lazy) import counts, and render importing the
    # registry one layer down is fine.
    root = tmp_path / "clusterkit"
    for package in ("render", "plan", "launchers"):
        (root / package).mkdir(parents=True)
    (root / "render" / "x.py").write_text("def f():\n    from clusterkit.plan import build\n"
                                          "from clusterkit.launchers import BACKENDS\n")
    (root / "plan" / "y.py").write_text("from clusterkit.render import x\n")
    (root / "launchers" / "z.py").write_text("from clusterkit.plan import y\n")
    assert violations(root) == [
        "clusterkit/launchers/z.py:1: launchers (layer 5) imports plan (layer 6)",
        "clusterkit/plan/y.py:1: plan (layer 6) imports render (layer 6)",
        "clusterkit/render/x.py:2: render (layer 6) imports plan (layer 6)"]


def _imported(package: str) -> set[tuple[str, str]]:
    """(module, clusterkit package) for every import in ``package``, allowed ones left out."""
    return {(path.relative_to(ROOT.parent).as_posix(), dst)
            for path in sorted((ROOT / package).rglob("*.py")) for _, dst in _imports(path)
            if dst != package
            and (path.relative_to(ROOT.parent).as_posix(), dst) not in ALLOWED}


def test_the_transport_imports_nothing_above_it() -> None:
    # remote/ is the SSH seam only: what runs over it (sync, provisioning, launch) is above.
    above = {(m, dst) for m, dst in _imported("remote") if LAYER[dst] >= LAYER["remote"]}
    assert above == set()


def test_sync_and_provisioning_do_not_import_launch() -> None:
    # The engine serves clusterkit sync, launch --sync and nodes env alike, provisioning
    # serves nodes env/install/build-ops and the launch gate: launch calls them, never
    # the other way round.
    for package in ("sync", "provision"):
        assert {(m, dst) for m, dst in _imported(package) if dst in ("launch", "jobs")} == set()


def test_docs_list_the_same_layers() -> None:
    doc = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    for names in LAYERS:
        for name in names:
            assert f"`{name}`" in doc, f"docs/architecture.md does not name layer {name!r}"
