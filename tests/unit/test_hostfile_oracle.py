"""clusterkit's hostfile parser and host selection against DeepSpeed's own runner.

DeepSpeed's functions are the oracle: for every case both must accept with the
same result, or both must reject. The few places where clusterkit is stricter on
purpose are listed in clusterkit/hostfile.py and tested separately below.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import pytest

from clusterkit.errors import ClusterkitError, InventoryError, SelectionError
from clusterkit.hostfile import parse_hostfile, render_hostfile, select

runner = pytest.importorskip("deepspeed.launcher.runner")
logging.getLogger("DeepSpeed").setLevel(logging.CRITICAL)

HOSTFILE_CASES = [
    "worker-0 slots=16\nworker-1 slots=16\n",
    "a slots=2",
    "# comment\n\na slots=2\n\n# more\nb slots=4\n",
    "a slots=2 # trailing comment is ignored\n",
    "a slots=2 max_slots=8\n",
    "  a slots=3  \n",
    "a\tslots=1\n",
    "a    slots=007\n",
    "10.0.0.1 slots=8\n10.0.0.2 slots=8\n",
    "a slots=2\na slots=2\n",  # duplicate
    "a slots=2\nb\n",  # no slots
    "a slots=\n",
    "a slots=-1\n",
    "a slots=x\n",
    "slots=2\n",
    "",
    "# only comments\n\n",
    "a slot=2\n",
    "a  slots=2\r\nb slots=3\r\n",
    "node[1-3] slots=2\n",
    "a slots=1\n  # indented comment\nb slots=1\n",
    "a,b slots=2\n",
]


def _ours_parse(text: str) -> object:
    try:
        return dict(parse_hostfile(text))
    except InventoryError:
        return "error"


def _ds_parse(text: str) -> object:
    try:
        return dict(runner._parse_hostfile(text.splitlines(keepends=True)))
    except ValueError:
        return "error"


@pytest.mark.parametrize("text", HOSTFILE_CASES)
def test_hostfile_parser_matches_deepspeed(text: str) -> None:
    assert _ours_parse(text) == _ds_parse(text)


def test_hostfile_order_is_preserved_and_roundtrips() -> None:
    text = "z slots=1\na slots=2\nm slots=3\n"
    pool = parse_hostfile(text)
    assert list(pool) == ["z", "a", "m"]
    assert render_hostfile(pool) == text
    assert list(runner._parse_hostfile(render_hostfile(pool).splitlines())) == ["z", "a", "m"]


def test_hostfile_error_names_the_line() -> None:
    with pytest.raises(InventoryError) as exc:
        parse_hostfile("a slots=2\n\nb\n", path="hf")
    assert exc.value.one_line().startswith("hf:3: bad hostfile entry 'b'")
    with pytest.raises(InventoryError) as exc:
        parse_hostfile("a slots=2\na slots=4\n", path="hf")
    assert "hf:2:" in exc.value.one_line() and "line 1" in exc.value.one_line()


def test_slots_zero_is_refused_with_its_line() -> None:
    """Stricter than DeepSpeed on purpose (issue 25): its runner keeps a slots=0 host with
    no rank, or drops it once --include/--exclude is given; we refuse it, naming the line."""
    assert runner._parse_hostfile(["a slots=2\n", "b slots=0\n"]) == {"a": 2, "b": 0}
    with pytest.raises(InventoryError) as exc:
        parse_hostfile("a slots=2\n# b is down\nb slots=0\n", path="hf")
    line = exc.value.one_line()
    assert line.startswith("hf:3: host 'b' has slots=0"), line
    assert "delete the line" in line


POOL = OrderedDict([("worker-0", 4), ("worker-1", 4), ("worker-2", 2), ("worker-3", 2)])

SELECTION_CASES: list[tuple[str, str]] = [
    ("", ""),
    ("worker-0", ""),
    ("worker-1@worker-0", ""),
    ("worker-0@worker-1:0,2", ""),
    ("worker-1:3", ""),
    ("worker-1:3,1", ""),
    ("worker-1:1@worker-1:0", ""),
    ("worker-1@worker-1:0", ""),
    ("worker-2:0,0", ""),
    ("worker-9", ""),
    ("worker-0:4", ""),
    ("worker-0:x", ""),
    ("worker-0:", ""),
    ("worker-0:1:2", ""),
    ("worker-0@", ""),
    ("", "worker-1"),
    ("", "worker-1:0"),
    ("", "worker-1:0,1,2,3"),
    ("", "worker-1:0@worker-2"),
    ("", "worker-0@worker-1@worker-2@worker-3"),
    ("", "worker-1@worker-1:0"),
    ("", "worker-2:5"),
    ("", "nope"),
    ("", "worker-3:1,0"),
    ("worker-0", "worker-1"),
]


def _ours_select(include: str, exclude: str) -> object:
    try:
        return {h: s for h, s in select(POOL, include=include, exclude=exclude).items()}
    except SelectionError:
        return "error"


def _ds_select(include: str, exclude: str) -> object:
    try:
        out = runner.parse_inclusion_exclusion(POOL, include, exclude)
    except ValueError:
        return "error"
    # DeepSpeed lets a selection come out empty and fails later; we refuse it up front.
    return dict(out) if out else "error"


@pytest.mark.parametrize(("include", "exclude"), SELECTION_CASES)
def test_include_exclude_matches_deepspeed(include: str, exclude: str) -> None:
    assert _ours_select(include, exclude) == _ds_select(include, exclude)


NODES_GPUS_CASES = [(1, None), (2, None), (4, None), (None, 1), (None, 2), (2, 2), (3, 1), (1, 4)]


@pytest.mark.parametrize(("nodes", "gpus"), NODES_GPUS_CASES)
def test_nodes_and_gpus_match_deepspeed(nodes: int | None, gpus: int | None) -> None:
    active = runner.parse_inclusion_exclusion(POOL, "", "")
    expected = runner.apply_num_nodes_and_gpus(active, nodes or -1, gpus or -1)
    assert dict(select(POOL, nodes=nodes, gpus_per_node=gpus)) == dict(expected)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nodes": 5}, "only 4 hosts"),
        ({"nodes": 0}, "at least 1"),
        ({"gpus_per_node": 0}, "at least 1"),
        ({"gpus_per_node": 3}, "worker-2, worker-3"),
        ({"nodes": 1, "include": "worker-0"}, "cannot be combined"),
        ({"include": "worker-0", "exclude": "worker-1"}, "mutually exclusive"),
        ({"include": "ghost"}, "'ghost' is not in the inventory"),
        ({"exclude": "worker-0@worker-1@worker-2@worker-3"}, "leaves no hosts"),
    ],
)
def test_stricter_than_deepspeed_with_clear_messages(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ClusterkitError) as exc:
        select(POOL, **kwargs)  # type: ignore[arg-type]
    assert needle in exc.value.one_line()
