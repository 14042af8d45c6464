"""No test helper defined twice (issue 36, item 6): a top-level function of a module
under tests/ that is not a test (a helper or a fixture) has one definition. A helper two
modules need lives in a shared module (docs/testbed.md, "The suite's tiers"); one name
that meant two things gets a name for each."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.paths import TESTS


def _is_program(tree: ast.Module) -> bool:
    """A module run as a program: it has a top-level ``if __name__ == "__main__":``."""
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            left, right = node.test.left, node.test.comparators
            if (isinstance(left, ast.Name) and left.id == "__name__" and len(right) == 1
                    and isinstance(right[0], ast.Constant) and right[0].value == "__main__"):
                return True
    return False


def _fixture_name(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The name pytest knows it by: ``@pytest.fixture(name=...)`` wins over the def's."""
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call):
            for kw in dec.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    return str(kw.value.value)
    return fn.name


def helper_definitions(root: Path) -> dict[str, list[str]]:
    """Top-level non-test function name -> the modules (relative to ``root``) defining it.
    Exempt by rule: ``main`` of a program module (see ``_is_program``: the scripts under
    tests/programs, tests/fixtures, tests/slurmbed/usertrain.py, tests/testbed/__main__.py,
    ...), which is the program's entry point, not a helper anything imports."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        program = _is_program(tree)
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            name = _fixture_name(node)
            if name.startswith("test_") or (program and name == "main"):
                continue
            found[name].append(str(path.relative_to(root)))
    return found


def test_no_test_helper_or_fixture_is_defined_twice() -> None:
    twice = {name: mods for name, mods in helper_definitions(TESTS).items() if len(mods) > 1}
    assert twice == {}, "defined in more than one module under tests/ (share one helper, " \
        "or name each for what it does): " + "; ".join(
            f"{name}: {', '.join(mods)}" for name, mods in sorted(twice.items()))


def test_the_rule_sees_a_second_definition(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def _run():\n    pass\n\n\ndef main():\n    pass\n")
    (tmp_path / "b.py").write_text("import pytest\n\n\n@pytest.fixture(name='_run')\n"
                                   "def other():\n    pass\n\n\ndef test_x():\n    pass\n")
    (tmp_path / "c.py").write_text("def main():\n    pass\n\n\nif __name__ == \"__main__\":\n"
                                   "    main()\n")
    (tmp_path / "d.py").write_text("def test_x():\n    pass\n")
    found = helper_definitions(tmp_path)
    assert found["_run"] == ["a.py", "b.py"]
    assert found["main"] == ["a.py"]  # c.py is a program: its main is exempt
    assert "test_x" not in found
