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
