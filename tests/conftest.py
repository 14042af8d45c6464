"""Shared pytest fixtures.

Test bed (tests/testbed, docs/testbed.md): one session-wide set of namespace nodes,
created lazily by the first test that asks for it and grown on demand::

    @pytest.mark.testbed(nodes=7)
    def test_x(testbed_nodes): ...          # the first 7 nodes, already up

    @pytest.mark.testbed
    def test_y(testbed): testbed.ensure(3)   # the Testbed object itself

Without root / sshd / ip the test bed tests are skipped with the reason, except
when the environment variable CI is set: then they fail loudly.

Expensive training runs are session fixtures too, launched once by the first test
that asks and checked by every test that needs them (helpers in
tests/helpers.py):

* ``reference_2x2``: the uninterrupted 2 x 2 run the restart and hang tests compare
  their resumed loss with;
* ``launched_7x2(key)``: the 7 x 2 run of one launcher (native, deepspeed,
  accelerate); the node-local ones are also collected by test_collect_testbed.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from tests.slurmbed.fixtures import slurm, slurm_bed  # noqa: F401  (Slurm test bed fixtures)
from tests.testbed import Testbed, TestNode, unavailable_reason

if TYPE_CHECKING:
    from tests.helpers import Launched, Run

DEFAULT_TESTBED_NODES = 2
# pytest-xdist (`-n 2 --dist loadgroup`, pyproject addopts): every worker is its own
# session with its own test bed (a fresh prefix and subnet, tests/testbed/core.py). Tests
# that share an expensive run (a session or module fixture) run in one worker, so it
# runs once.
# Longer variants of behaviours the default run already covers (the 7 x 2 acceptance
# runs, every launcher variant on Slurm, the whole resume grid): @pytest.mark.extended.
EXTENDED_ENV = "CLUSTERKIT_EXTENDED"
EXTENDED = os.environ.get(EXTENDED_ENV) == "1"
# The Slurm tests are not one group: a second cluster costs each worker a few seconds,
# while the Slurm tests together took 9:30 on one worker (docs/testbed.md). Only the two
# that share one job (test_sbatch_user_slurm.py's module fixture `preempted`) are grouped.
XDIST_GROUPS = {
    "preempted": "slurm-user-preempted",
    "launched_7x2": "train-7x2",
    "reference_2x2": "train-ref-2x2",
    "reference": "workload-dist-reference",  # test_workload_dist.py's module fixture
}


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


# tryfirst: xdist's own collection hook turns the group marks into the "@group" nodeid
# suffix its scheduler groups by; marks added after it are ignored. (From 07400c8 to
# this line's commit the decorator sat on the fixture above: no group held, so both
# workers launched the shared runs and a Slurm cluster each, and split the Slurm tests.
# pytest_collection_finish below now refuses that state.)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {g: i for i, g in enumerate(dict.fromkeys(XDIST_GROUPS.values()))}
    groups: dict[str, int] = {}
    for item in items:
        names = getattr(item, "fixturenames", ())
        group = next((g for fixture, g in XDIST_GROUPS.items() if fixture in names), None)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
        if group is not None:
            groups[item.nodeid] = order[group]
        if item.get_closest_marker("extended") is not None and not EXTENDED:
            item.add_marker(pytest.mark.skip(reason=f"extended variant: {EXTENDED_ENV}=1 runs it"))
    if hasattr(config, "workerinput"):
        # In an xdist worker: the longest work first (the scheduler hands out the rest in
        # collection order, one test at a time), so the run ends on short tests that fill
        # both workers, never on one worker alone with a long test or group.
        cost = _module_cost(items)
        items.sort(key=lambda item: (groups.get(item.nodeid, len(order)), cost[_module(item)]))


# Ungrouped tests, longest first: modules with a `slow` test (DeepSpeed training, tens of
# seconds), then Slurm and test bed modules (seconds to a minute each), then the rest
# (milliseconds). Whole modules, in collection order within each: a module fixture
# (test_doctor_testbed's `bed`) is set up once per worker that runs its tests.
COST_MARKERS = ("slow", "slurm", "testbed")


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _module_cost(items: list[pytest.Item]) -> dict[str, int]:
    cost: dict[str, int] = {}
    for item in items:
        mine = next((i for i, m in enumerate(COST_MARKERS)
                     if item.get_closest_marker(m) is not None), len(COST_MARKERS))
        cost[_module(item)] = min(mine, cost.get(_module(item), mine))
    return cost


def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker under --dist loadgroup: every grouped test must carry its group
    in its nodeid, or the scheduler spreads the group over the workers (see above)."""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"xdist groups not applied (conftest hook order?): {lost[:3]}")


def _require_testbed() -> None:
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the test bed cannot run: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def testbed_required() -> None:
    """For tests that build their own test bed: skip (or fail under CI) like `testbed`."""
    _require_testbed()


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    _require_testbed()
    tb = Testbed.create()  # also registers atexit + SIGTERM/SIGHUP teardown
    try:
        yield tb
    finally:
        tb.down()


@pytest.fixture
def testbed_nodes(request: pytest.FixtureRequest, testbed: Testbed) -> list[TestNode]:
    """The first n nodes of the session test bed, n from @pytest.mark.testbed(nodes=n)."""
    marker = request.node.get_closest_marker("testbed")
    n = int(marker.kwargs.get("nodes", DEFAULT_TESTBED_NODES)) if marker else DEFAULT_TESTBED_NODES
    return testbed.ensure(n)


@pytest.fixture(scope="session")
def reference_2x2(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The uninterrupted 2 x 2 torchrun/shared run of tests/helpers.REF_STEPS steps."""
    from tests.helpers import launch_reference

    return launch_reference(testbed, tmp_path_factory.mktemp("reference-2x2"))


@pytest.fixture(scope="session")
def launched_7x2(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory
                 ) -> Callable[[str], Launched]:
    """``launched_7x2(key)``: the 7 x 2 run of tests/helpers.SHARED_7X2[key], launched
    on first use and kept for the session (a failed run is kept too: every test that
    shares it then reports the same failure instead of launching it again)."""
    from tests.helpers import launch_7x2

    runs: dict[str, Launched] = {}

    def get(key: str) -> Launched:
        if key not in runs:
            runs[key] = launch_7x2(testbed, tmp_path_factory.mktemp(f"launch-7x2-{key}"), key)
        return runs[key]

    return get
