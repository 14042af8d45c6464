"""The launcher <-> agent line codec (clusterkit.node.protocol): every message type
round-trips through encode/decode, and decoding stays strict and versioned."""

from __future__ import annotations

import dataclasses
import json

import pytest

from clusterkit.node import protocol
from clusterkit.node.protocol import Control, ProtocolError

# One instance of every message the agent writes, with every field set away from its
# default (so a field the codec drops or renames fails the round trip).
MESSAGES: list[protocol.Message] = [
    protocol.Line("node3", 2, "step 4 | loss 1.5  (two  spaces kept)"),
    protocol.Line("node3", None, "a launcher line"),
    protocol.Line("node3", 0, ""),
    protocol.Facts("node3", facts={"python": "3.11", "missing": ["torch"]}),
    protocol.Started("node3", pid=41, argv=["torchrun", "x.py"], pids=[42, 43], zygote=40),
    protocol.RankFailed("node3", failed_node="node5", local_rank=1, rank=9, code=-9),
    protocol.Forwarded("node3", signal="USR1", processes=2),
    protocol.Teardown("node3", reason="stdin-eof"),
    protocol.Exit("node3", code=137, reason="term", held=True, signalled=3, killed=1, left=1),
    protocol.Error("node3", message="OSError: no space"),
    protocol.Progress("node3", idle_s=2.5, ranks={"8": 2.5, "9": 0.5}, step=12, time=1700.25),
    protocol.Stacks("node3", ranks={"8": {"pid": 42, "state": "S", "tool": "py-spy",
                                          "text": "Thread 1"}}, dir="/j/stacks/a0"),
    protocol.Replica("node3", tag="global_step20", source=2, target="node4", state="complete",
                     detail="", bytes=4096, seconds=0.25),
]


def test_every_event_kind_has_a_case() -> None:
    kinds = {type(m) for m in MESSAGES if isinstance(m, protocol.AgentEvent)}
    assert kinds == set(protocol.EVENT_TYPES.values())
    assert tuple(protocol.EVENT_TYPES) == protocol.EVENTS


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: protocol.Message) -> None:
    line = protocol.encode(msg)
    assert "\n" not in line
    assert protocol.decode(line) == msg


def test_event_wire_format_is_versioned_json() -> None:
    line = protocol.encode(protocol.RankFailed("node3", failed_node="node3", rank=5, code=-9))
    assert line.startswith(protocol.EVENT_PREFIX)
    raw = json.loads(line[len(protocol.EVENT_PREFIX):])
    assert (raw["v"], raw["ev"], raw["node"], raw["rank"], raw["code"]) == \
        (protocol.SCHEMA_VERSION, "rank-failed", "node3", 5, -9)
    assert protocol.decode_event(line[len(protocol.EVENT_PREFIX):]).ev == "rank-failed"
    assert protocol.encode(protocol.Line("n", None, "x")) == "@ck:L n - x"


def test_defaults_fill_absent_optional_fields() -> None:
    ev = protocol.decode('@ck:E {"v": 1, "ev": "started", "node": "n", "pid": 3}')
    assert ev == protocol.Started("n", pid=3)


@pytest.mark.parametrize(("line", "why"), [
    ('@ck:E {"ev": "exit", "node": "n"}', "schema_version None"),
    ('@ck:E {"v": 2, "ev": "exit", "node": "n"}', "schema_version 2"),
    ('@ck:E {"v": 1, "ev": "party", "node": "n"}', "not one this side knows"),
    ('@ck:E {"v": 1, "ev": "exit"}', "not one this side knows"),
    ('@ck:E {"v": 1, "ev": "exit", "node": "n", "cake": 1}', "unknown keys: cake"),
    ('@ck:E {"v": 1, "ev": "exit", "node": "n", "code": "1"}', "'code' has type str"),
    ('@ck:E {"v": 1, "ev": "exit", "node": "n", "code": true}', "'code' has type bool"),
    ('@ck:E {"v": 1, "ev": "started", "node": "n", "pid": 1.5}', "'pid' has type float"),
    ('@ck:E {"v": 1, "ev": "replica", "node": "n", "state": "done"}',
     "'state' is 'done', not one of complete, failed"),
    ("@ck:E [1]", "not a JSON object"),
    ("@ck:E {", "not JSON"),
])
def test_decoding_is_strict(line: str, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        protocol.decode(line)


def test_a_replicas_state_is_its_enum_on_both_ends() -> None:
    line = protocol.encode(protocol.Replica("n", tag="t", state=protocol.CopyState.COMPLETE))
    assert '"state": "complete"' in line
    ev = protocol.decode(line)
    assert isinstance(ev, protocol.Replica) and ev.state is protocol.CopyState.COMPLETE


def test_other_lines_are_not_messages() -> None:
    assert protocol.decode("Traceback (most recent call last):") is None
    assert protocol.decode("") is None


def test_an_unregistered_event_class_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Party(protocol.AgentEvent):
        EV = "party"

    with pytest.raises(ProtocolError, match="unknown event"):
        protocol.encode(Party("n"))


@pytest.mark.parametrize("word", list(Control), ids=lambda w: w.value)
def test_control_words_round_trip(word: Control) -> None:
    assert word.line() == f"{word.value}\n".encode()
    assert Control.parse(word.line().decode()) is word
    assert Control.parse(f"  {word.value.lower()}\r\n") is word


def test_unknown_control_words_are_ignored() -> None:
    assert Control.parse("HUP") is None and Control.parse("") is None
    assert protocol.CONTROL_WORDS == ("TERM", "KILL", "GO", "USR1", "USR2", "PING", "DUMP")
