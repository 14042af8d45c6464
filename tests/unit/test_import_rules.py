"""Import rules the layering test does not cover: only ``clusterkit/remote/`` imports
paramiko (the one transport seam, docs/architecture.md), test modules share helpers
through helper modules, never by importing from another test module, and one door
per name (issue 30 item 5): no import circle among clusterkit's modules, no private
name imported across modules, no re-export, no backend-name comparison outside the
registry (docs/architecture.md, "One door per name"). The shipped node package
(``clusterkit/node/``, issue 36): standard library only, no launcher code, rooms by
role with only its face and a fixed few base modules at its top."""

from __future__ import annotations

import ast
import contextlib
import sys
from pathlib import Path

import pytest

import clusterkit
from tests.paths import TESTS

ROOT = Path(clusterkit.__file__).parent


def imported_modules(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in ``path``, function-level ones too."""
    out: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def paramiko_importers(root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root.parent)}:{line}"
            for path in sorted(root.rglob("*.py"))
            if path.relative_to(root).parts[0] != "remote"
            for line, module, _ in imported_modules(path)
            if module.split(".")[0] == "paramiko"]


def test_only_remote_imports_paramiko() -> None:
    assert paramiko_importers() == []


def test_the_paramiko_check_sees_a_lazy_import(tmp_path: Path) -> None:
    root = tmp_path / "clusterkit"
    (root / "remote").mkdir(parents=True)
    (root / "checks").mkdir()
    (root / "remote" / "ssh.py").write_text("import paramiko\n")
    (root / "checks" / "doctor.py").write_text("def f():\n    from paramiko import Agent\n")
    assert paramiko_importers(root) == ["clusterkit/checks/doctor.py:2"]


# -- The shipped node package (docs/architecture.md, "Node modules"). Directly under
# clusterkit/node/: its face and the base modules every room shares; the rest is in a
# room by role. A new module goes into a room (or a new room), not here.
NODE_TOP = {"__init__.py", "contract.py", "protocol.py", "hashing.py", "hangrule.py", "files.py"}
NODE_ROOMS = {"agent", "ckpt", "facts", "hooks", "provision", "replicas", "slurm", "sync"}
# What a node module may import beyond the standard library and clusterkit.node (path
# under clusterkit/node/: packages). The bandwidth worker is the only one that needs torch.
NODE_EXTRA_IMPORTS = {"facts/bw_worker.py": {"torch", "torch.distributed"}}


def node_import_problems(root: Path = ROOT) -> list[str]:
    """Imports of a module under ``root/node/`` (at any depth, function-level ones
    too) of anything but the standard library and the node package itself: a shipped
    module that imports launcher code (or a third-party package) would not run on a node."""
    node = root / "node"
    out = []
    for path in sorted(node.rglob("*.py")):
        rel = path.relative_to(node).as_posix()
        for line, module, _ in imported_modules(path):
            top = module.split(".")[0]
            if (top in sys.stdlib_module_names or module == "__future__"
                    or module == "clusterkit.node" or module.startswith("clusterkit.node.")
                    or module in NODE_EXTRA_IMPORTS.get(rel, set())):
                continue
            out.append(f"{path.relative_to(root.parent)}:{line}: {module}")
    return out


def test_the_node_package_imports_only_the_standard_library_and_itself() -> None:
    assert node_import_problems() == []


def test_the_node_import_check_sees_launcher_code_at_any_depth(tmp_path: Path) -> None:
    root = tmp_path / "clusterkit"
    (root / "node" / "facts").mkdir(parents=True)
    (root / "node" / "contract.py").write_text("import json\nfrom clusterkit.node import protocol\n")
    (root / "node" / "facts" / "bw_worker.py").write_text("import torch\n")
    (root / "node" / "facts" / "probe.py").write_text(
        "from clusterkit.node.facts import parity\ndef f():\n    from clusterkit import ship\n"
        "    import yaml\n    import clusterkit.spec.job\n")
    assert node_import_problems(root) == ["clusterkit/node/facts/probe.py:3: clusterkit",
                                          "clusterkit/node/facts/probe.py:4: yaml",
                                          "clusterkit/node/facts/probe.py:5: clusterkit.spec.job"]


def node_layout_problems(root: Path = ROOT) -> list[str]:
    """Modules directly under ``node/`` beyond ``NODE_TOP``, rooms not in ``NODE_ROOMS``
    (or nested deeper), and a room's ``__init__.py`` with anything but its docstring:
    on a node the bootstrap makes each package an empty module, so code there never runs."""
    node = root / "node"
    out = [f"node/{p.name}: a module at the top of node/ (put it in a room by role)"
           for p in sorted(node.glob("*.py")) if p.name not in NODE_TOP]
    for room in sorted(p for p in node.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if room.name not in NODE_ROOMS:
            out.append(f"node/{room.name}/: a room not in NODE_ROOMS")
        out += [f"node/{room.name}/{p.name}/: a room inside a room" for p in sorted(room.iterdir())
                if p.is_dir() and p.name != "__pycache__"]
        init = room / "__init__.py"
        body = ast.parse(init.read_text(encoding="utf-8")).body if init.exists() else None
        if body is None or len(body) != 1 or ast.get_docstring(ast.Module(body, [])) is None:
            out.append(f"node/{room.name}/__init__.py: only a docstring (what the room holds)")
    return out


def test_the_node_package_is_rooms_by_role_with_a_fixed_few_base_modules() -> None:
    """Issue 36 item 3: five base modules and the face directly under node/."""
    assert node_layout_problems() == []
    assert len(NODE_TOP - {"__init__.py"}) == 5


def test_the_node_layout_check(tmp_path: Path) -> None:
    node = tmp_path / "clusterkit" / "node"
    (node / "agent").mkdir(parents=True)
    (node / "misc").mkdir()
    for name in NODE_TOP:
        (node / name).write_text('"""x"""\n')
    (node / "stray.py").write_text('"""x"""\n')
    (node / "agent" / "__init__.py").write_text('"""The agent."""\nfrom clusterkit.node.agent import core\n')
    (node / "misc" / "__init__.py").write_text('"""Misc."""\n')
    assert node_layout_problems(tmp_path / "clusterkit") == [
        "node/stray.py: a module at the top of node/ (put it in a room by role)",
        "node/agent/__init__.py: only a docstring (what the room holds)",
        "node/misc/: a room not in NODE_ROOMS"]



def imports_of_test_modules(root: Path = TESTS) -> list[str]:
    """Imports of a test module (``tests.test_*``, ``tests.unit.test_*``, or ``from tests
    import test_*``)
    anywhere under ``root``."""
    def is_test_module(module: str, names: list[str]) -> bool:
        parts = module.split(".")
        if parts[0] != "tests":
            return False
        # tests.test_x, tests.unit.test_x, or from tests[.unit] import test_x
        return any(p.startswith("test_") for p in parts[1:]) or any(
            n.startswith("test_") for n in names)

    return [f"{path.relative_to(root.parent)}:{line}: {module}"
            for path in sorted(root.rglob("*.py"))
            for line, module, names in imported_modules(path)
            if is_test_module(module, names)]


def test_no_module_imports_a_test_module() -> None:
    """Shared helpers live in tests/helpers.py (or a helper package such as
    tests/testbed): no module imports another test module's names."""
    assert imports_of_test_modules() == []


def test_the_test_import_check_sees_both_spellings(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("from tests.helpers import x\nfrom tests.test_b import _y\n")
    (tests / "conftest.py").write_text("def f():\n    from tests import test_b\n")
    assert imports_of_test_modules(tests) == ["tests/conftest.py:2: tests",
                                              "tests/test_a.py:2: tests.test_b"]


# ----------------------------------------------------------------------------- one door per name
# Issue 30 item 5: every name has one door (the module that defines it), the module graph
# has no circle, no module reaches into another's private names, and backend semantics
# are read from the registry (clusterkit/launchers/), never from a backend's name.


def _module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules_by_name(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """clusterkit module -> the clusterkit modules it imports. Every import counts: a
    function-local (lazy) one is still a dependency, and so is one under
    ``TYPE_CHECKING``: a type-only back-import is the same circle in the design (the
    doctor <-> doctor_port circle of issue 30 was one), so none is exempt.
    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
    ``pkg`` (its ``__init__``); the implicit import of a parent package is not an edge."""
    mods = _modules_by_name(root)

    def target(module: str, name: str = "") -> str | None:
        if name and f"{module}.{name}" in mods:
            return f"{module}.{name}"
        return module if module in mods else None

    graph: dict[str, set[str]] = {}
    for me, path in mods.items():
        edges: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {target(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                edges |= {target(node.module, a.name) for a in node.names}
        graph[me] = {e for e in edges if e is not None and e != me}
    return graph


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """The strongly connected components of :func:`module_graph` with more than one
    module (Tarjan), each sorted: every import circle, however long."""
    graph = module_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_module_graph_has_no_import_cycle() -> None:
    assert import_cycles() == []


def test_the_cycle_check_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    root = tmp_path / "clusterkit"
    (root / "cli").mkdir(parents=True)
    (root / "cli" / "__init__.py").write_text("")
    (root / "cli" / "a.py").write_text("def f():\n    from clusterkit.cli import b\n")
    (root / "cli" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from clusterkit.cli.c import X\n")
    (root / "cli" / "c.py").write_text("from clusterkit.cli.a import f\n")
    (root / "cli" / "d.py").write_text("from clusterkit.cli import a\n")  # into, not back
    assert import_cycles(root) == [["clusterkit.cli.a", "clusterkit.cli.b", "clusterkit.cli.c"]]


def private_imports(root: Path = ROOT) -> list[str]:
    """``from clusterkit.x import _name`` and ``module._name`` (``module`` a clusterkit
    module imported here) in a module other than the one that defines ``_name``.
    Dunders are not private."""
    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    out = []
    for me, path in _modules_by_name(root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules: set[str] = set()  # local names bound to clusterkit modules or names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] == root.name:
                for a in node.names:
                    modules.add(a.asname or a.name)
                    if private(a.name) and node.module != me:
                        out.append(f"{path.relative_to(root.parent)}:{node.lineno}: "
                                   f"from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name.split(".")[0] for a in node.names
                            if a.name.split(".")[0] == root.name}
        out += [f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and private(node.attr)
                and ((isinstance(node.value, ast.Name) and node.value.id in modules)
                     or ast.unparse(node.value).startswith(f"{root.name}."))]
    return sorted(out)


# Each entry: a line private_imports() reports, and why it may stay. Keep it empty.
ALLOWED_PRIVATE_IMPORTS: dict[str, str] = {}


def test_no_module_imports_another_modules_private_names() -> None:
    found = private_imports()
    assert [f for f in found if f not in ALLOWED_PRIVATE_IMPORTS] == []
    assert [a for a in ALLOWED_PRIVATE_IMPORTS if a not in found] == []  # no stale entry


def test_the_private_import_check_sees_both_spellings(tmp_path: Path) -> None:
    root = tmp_path / "clusterkit"
    root.mkdir()
    (root / "a.py").write_text("_X = 1\ndef _f():\n    return _X\n")
    (root / "b.py").write_text("from clusterkit.a import _X, __doc__\nfrom clusterkit import a\n"
                               "import clusterkit.a\n"
                               "def g():\n    return a._f(), a.__name__, clusterkit.a._X\n")
    assert private_imports(root) == ["clusterkit/b.py:1: from clusterkit.a import _X",
                                     "clusterkit/b.py:5: a._f", "clusterkit/b.py:5: clusterkit.a._X"]


def _assigns_all(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    else:
        return False
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def reexports(root: Path = ROOT) -> list[str]:
    """Names a module imports from clusterkit at module level (an ``if``/``try`` there
    included) and never uses: kept only for others to import through it (``__all__``,
    ``import x as x``). A use is any ``Name`` outside ``__all__``, or a word of a string
    annotation. Function-local imports are used where they are made (ruff's F401)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_all = {id(n) for stmt in tree.body if _assigns_all(stmt) for n in ast.walk(stmt)}
        bound: dict[str, int] = {}
        for stmt in tree.body:
            for node in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                        and node.module.split(".")[0] == root.name:
                    bound |= {a.asname or a.name: node.lineno for a in node.names}
        used: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in in_all:
                continue
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                with contextlib.suppress(SyntaxError):
                    used |= {n.id for n in ast.walk(ast.parse(node.value, mode="eval"))
                             if isinstance(n, ast.Name)}
        out += [f"{path.relative_to(root.parent)}:{line}: {name}"
                for name, line in bound.items() if name not in used]
    return sorted(out)


# Each entry: a line reexports() reports, and why it may stay. Keep it empty.
ALLOWED_REEXPORTS: dict[str, str] = {}


def test_no_module_re_exports_names() -> None:
    found = reexports()
    assert [f for f in found if f not in ALLOWED_REEXPORTS] == []
    assert [a for a in ALLOWED_REEXPORTS if a not in found] == []  # no stale entry


def test_the_re_export_check(tmp_path: Path) -> None:
    root = tmp_path / "clusterkit"
    root.mkdir()
    (root / "a.py").write_text("X = 1\nY = 2\nZ = 3\nclass C: ...\n")
    (root / "b.py").write_text(
        "from clusterkit.a import X as X\nfrom clusterkit.a import Y, Z, C\n"
        "__all__ = ['X', 'Y']\ndef f(c: 'C') -> int:\n    return Z\n")
    assert reexports(root) == ["clusterkit/b.py:1: X", "clusterkit/b.py:2: Y"]


def backend_name_comparisons(root: Path = ROOT) -> list[str]:
    """Comparisons (``==``, ``!=``, ``in``, ...) of something named ``*backend*`` or
    ``*launcher*`` with a backend's name (a registry key, a plan backend, ``pdsh``) or a
    collection of them, outside ``clusterkit/launchers/``: what a backend does is a
    Backend attribute there. (Other words that happen to equal a backend's name --
    a collect method or transport "slurm", a workload engine "accelerate" -- are not
    compared with something named backend/launcher and are not reported.)"""
    from clusterkit.launchers import BACKENDS

    names = set(BACKENDS) | {b.plan_backend for b in BACKENDS.values()} | {"pdsh"}

    def words(node: ast.expr) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(words(e) for e in node.elts))
        return set()

    out = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "launchers":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any(("backend" in ast.unparse(s).lower() or "launcher" in ast.unparse(s).lower())
                        and not words(s) for s in sides)
            if named and set().union(*(words(s) for s in sides)) & names:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_backend_name_comparison_outside_the_registry() -> None:
    assert backend_name_comparisons() == []


def test_the_backend_name_check(tmp_path: Path) -> None:
    root = tmp_path / "clusterkit"
    (root / "checks").mkdir(parents=True)
    (root / "launchers").mkdir()
    (root / "launchers" / "x.py").write_text("ok = backend == 'deepspeed'\n")
    (root / "checks" / "y.py").write_text(
        "a = ctx.backend != 'deepspeed'\nb = args.launcher in ('torchrun', 'native')\n"
        "c = method == 'slurm'\nd = backend(name).doctor.same_python\n")
    assert backend_name_comparisons(root) == [
        "clusterkit/checks/y.py:1: ctx.backend != 'deepspeed'",
        "clusterkit/checks/y.py:2: args.launcher in ('torchrun', 'native')"]


def _defined(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level (an ``if``/``try`` there included):
    functions, classes and assignments; not what it imports."""
    out: set[str] = set()
    for stmt in tree.body:
        for node in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def imports_through(root: Path = ROOT, *others: Path) -> list[str]:
    """``from clusterkit.x import name`` (in clusterkit, or in ``others``: tests, bench)
    where ``name`` is neither a module of ``x`` nor defined by ``x``: the name has another
    door, its defining module."""
    mods = _modules_by_name(root)
    defined = {m: _defined(ast.parse(p.read_text(encoding="utf-8"))) for m, p in mods.items()}
    out = []
    for base in (root, *others):
        for path in sorted(base.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods:
                    out += [f"{path.relative_to(base.parent)}:{node.lineno}: {a.name} "
                            f"through {node.module}" for a in node.names
                            if f"{node.module}.{a.name}" not in mods
                            and a.name not in defined[node.module]]
    return out


@pytest.mark.slow  # ~15-35 s: every module's imports resolved
def test_every_name_is_imported_from_its_defining_module() -> None:
    assert imports_through(ROOT, TESTS, ROOT.parent / "bench") == []


def test_the_defining_module_check(tmp_path: Path) -> None:
    root = tmp_path / "clusterkit"
    (root / "p").mkdir(parents=True)
    (root / "p" / "__init__.py").write_text("from clusterkit.p.m import f\n")
    (root / "p" / "m.py").write_text("def f(): ...\nif True:\n    G = 1\n")
    (root / "q.py").write_text("from clusterkit.p import m, f\nfrom clusterkit.p.m import f, G\n")
    assert imports_through(root) == ["clusterkit/q.py:1: f through clusterkit.p"]
