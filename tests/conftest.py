"""What every tier of the suite shares (docs/testbed.md, "The suite's tiers"): the private
CLUSTERKIT_HOME, the skip of @extended variants, and the order the xdist workers take
modules in. Each tier's own fixtures are in its conftest.py (tests/unit, tests/process,
tests/bed, tests/bed/slurm).

Expensive training runs that several tests check are fixtures of the one module that
holds those tests (``launched_7x2`` in test_launch_train.py, ``preempted`` in
test_sbatch_user_slurm.py): pytest-xdist's
``--dist loadfile`` (pyproject addopts) runs a module on one worker, so each runs once.
Nothing here depends on xdist's private workings (issue 37: xdist 3.8's ``loadgroup``
renames test ids through a private attribute that pytest 9.2 no longer reads, so its
groups were silently dropped).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests import module_seconds

# pytest-xdist (`-n 2 --dist loadfile`, pyproject addopts): every worker is its own
# session with its own test bed (a fresh prefix and subnet, tests/testbed/core.py), and
# gets whole modules: a run several tests share is a module fixture of their module.
# Longer variants of behaviours the default run already covers (the 7 x 2 acceptance
# runs, every launcher variant on Slurm, the whole resume grid): @pytest.mark.extended.
EXTENDED_ENV = "CLUSTERKIT_EXTENDED"
EXTENDED = os.environ.get(EXTENDED_ENV) == "1"


@pytest.fixture(scope="session", autouse=True)
def _private_clusterkit_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test's default job registry and virtual nodes live in a session temp dir, never
    in the real ~/.cache/clusterkit (an in-process `sbatch --submit` registers its job);
    a test that sets CLUSTERKIT_HOME itself (monkeypatch, a subprocess env) still wins."""
    old = os.environ.get("CLUSTERKIT_HOME")
    os.environ["CLUSTERKIT_HOME"] = str(tmp_path_factory.mktemp("clusterkit-home"))
    yield
    if old is None:
        os.environ.pop("CLUSTERKIT_HOME", None)
    else:
        os.environ["CLUSTERKIT_HOME"] = old


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("extended") is not None and not EXTENDED:
            item.add_marker(pytest.mark.skip(reason=f"extended variant: {EXTENDED_ENV}=1 runs it"))
    if hasattr(config, "workerinput"):
        # In an xdist worker: the longest modules first, by their measured seconds
        # (tests/module_seconds.py), so the run ends on short modules that fill both
        # workers, never on one worker alone with a long module. The scheduler keeps
        # this order only with --no-loadscope-reorder (pyproject addopts): by default
        # xdist >= 3.6 reorders modules by their number of tests, which put the
        # one-test trainings (test_nonroot_testbed, test_sbatch_replica_slurm) last.
        # A stable sort: a module's tests keep their order.
        cost = _module_cost(items)
        items.sort(key=lambda item: -cost[_module_of_item(item)])


def _module_of_item(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _module_cost(items: list[pytest.Item]) -> dict[str, float]:
    """Seconds per module: measured, or estimated from its costliest marker."""
    measured = module_seconds.load()
    markers: dict[str, set[str]] = {}
    for item in items:
        markers.setdefault(_module_of_item(item), set()).update(m.name for m in item.iter_markers())
    return {mod: measured.get(mod, module_seconds.estimate(names))
            for mod, names in markers.items()}
