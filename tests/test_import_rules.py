"""Import rules the layering test does not cover: only ``clusterkit/remote/`` imports
paramiko (the one transport seam, docs/architecture.md), and test modules share
helpers through helper modules, never by importing from another test module."""

from __future__ import annotations

import ast
from pathlib import Path

import clusterkit

ROOT = Path(clusterkit.__file__).parent
TESTS = Path(__file__).parent


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



def imports_of_test_modules(root: Path = TESTS) -> list[str]:
    """Imports of a test module (``tests.test_*``, or ``from tests import test_*``)
    anywhere under ``root``."""
    def is_test_module(module: str, names: list[str]) -> bool:
        parts = module.split(".")
        if parts[0] != "tests":
            return False
        if len(parts) > 1:
            return parts[1].startswith("test_")
        return any(n.startswith("test_") for n in names)

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
