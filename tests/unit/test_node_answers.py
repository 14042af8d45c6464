"""One rule for a node program's answer (issue 36 item 4): node/protocol.answer_of, the
last stdout line that is a JSON object. Every reader of a node program's answer uses it;
none parses "the last line" its own way again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import clusterkit
from clusterkit.node.protocol import ProtocolError, StopReply, answer_of

ROOT = Path(clusterkit.__file__).parent


@pytest.mark.parametrize(("stdout", "want"), [
    ('{"a": 1}\n', {"a": 1}),
    ('Welcome to node3\nLast login: today\n{"a": 1}\n', {"a": 1}),  # a login banner
    ('{"a": 1}\nlogout\n', {"a": 1}),  # a .bash_logout's line after it
    ('{"old": 1}\n{"a": 2}\n', {"a": 2}),  # the last answer wins
    ('{"a": 1}\n[1, 2]\n{not json}\n', {"a": 1}),  # not an object, not JSON: skipped
    ('  {"a": 1}  \r\n', {"a": 1}),
])
def test_the_answer_is_the_last_json_object_line(stdout: str, want: dict[str, int]) -> None:
    assert answer_of(stdout) == want


@pytest.mark.parametrize("stdout", ["", "\n\n", "Traceback (most recent call last):\nboom\n",
                                    "[1]\n", '"text"\n'])
def test_no_answer_names_the_last_line(stdout: str) -> None:
    with pytest.raises(ProtocolError) as info:
        answer_of(stdout, "the listing")
    assert "no JSON answer from the listing" in str(info.value)
    last = stdout.strip().splitlines()[-1:] or ["<empty>"]
    assert repr(last[0]) in str(info.value)


def test_the_stop_reply_is_read_by_the_same_rule() -> None:
    assert StopReply.from_stdout('banner\n{"signalled": 2, "killed": 0, "left": 1}\n') == \
        StopReply(signalled=2, left=1)
    with pytest.raises(ProtocolError):
        StopReply.from_stdout('{"nope": 1}\n')


# json.loads over a split-off last line: how the eight readers did it before.
LAST_LINE_PARSE = re.compile(r"json\.loads\(.*splitlines\(\)\[-1\]")


def test_no_module_parses_the_last_line_itself() -> None:
    found = [f"{p.relative_to(ROOT.parent)}:{n}"
             for p in sorted(ROOT.rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if LAST_LINE_PARSE.search(line)]
    # provision/envcopy.py asks a local interpreter (not a node program) for a JSON list.
    assert found == ["clusterkit/provision/envcopy.py:112"], found
