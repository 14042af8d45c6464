"""The wheel must contain every subpackage, the templates and the bundled corpus."""

from __future__ import annotations

import tomllib

from tests.paths import REPO


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "clusterkit").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found | {"clusterkit.templates"} == listed


def test_templates_are_importable_as_package_resources() -> None:
    from importlib import resources

    names = {p.name for p in resources.files("clusterkit.templates").iterdir()}
    assert "sbatch.sh.j2" in names
