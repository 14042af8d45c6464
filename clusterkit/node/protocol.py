"""The launcher <-> agent contract: the spec, the output lines, the events, the control words.

Shipped to the node with the agent (standard library, Python >= 3.8 at run
time) and imported by the launcher, so both ends read one definition.

* The **spec** (:class:`AgentSpec`) is one JSON line on the agent's stdin.
* The agent writes **lines** ``@ck:L <node> <local-rank|-> <text>`` and **events**
  ``@ck:E {"v": 1, "ev": ..., "node": ..., ...}`` on stdout.
* The launcher writes **control words** on the agent's stdin, one per line.

Both directions carry ``schema_version`` (events: ``v``). Decoding is strict:
an unknown key, a missing key, a wrong type or another version is a
:class:`ProtocolError` that says which side to update, never a silent default.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

SCHEMA_VERSION = 1

ENV_JOB = "CLUSTERKIT_JOB_ID"
ENV_NODE = "CLUSTERKIT_NODE"
ENV_ATTEMPT = "CLUSTERKIT_ATTEMPT"
JOB_DIR_TOKEN = "@JOB_DIR@"  # replaced in argv/env/files by the node's expanded job dir
LINE_PREFIX = "@ck:L "
EVENT_PREFIX = "@ck:E "
DEFAULT_GRACE_S = 3.0

# Control words, launcher -> agent, one per stdin line.
TERM, KILL, GO, USR1, USR2 = "TERM", "KILL", "GO", "USR1", "USR2"
# Hangs (issue 14): PING keeps the agent's dead-man switch from firing; DUMP asks it
# for the Python stacks of its ranks.
PING, DUMP = "PING", "DUMP"
CONTROL_WORDS = (TERM, KILL, GO, USR1, USR2, PING, DUMP)

# Events, agent -> launcher.
EVENTS = ("facts", "started", "rank-failed", "forwarded", "teardown", "exit", "error",
          "progress", "stacks")

# How to read ranks from a launcher's output (AgentSpec.prefix).
PREFIXES = ("torchrun", "pdsh", "single", "native")  # native: ranks started by the agent
# AgentSpec.native keys: the agent starts the ranks itself with torchrun's environment.
NATIVE_KEYS = ("nproc", "first_rank", "world_size", "node_rank", "nnodes", "master_addr",
               "master_port")


class ProtocolError(ValueError):
    """A spec or event this side cannot read (malformed, or another clusterkit version)."""


def _version_error(what: str, got: object) -> ProtocolError:
    return ProtocolError(
        f"{what} has schema_version {got!r}, this side speaks {SCHEMA_VERSION}: the launcher "
        "and the node code come from different clusterkit versions (the agent is sent by "
        "the launcher at every launch, so a mismatch means an old spec or state file)")


# Field name -> accepted JSON types (None allowed where the default is None).
_SPEC_TYPES: dict[str, tuple[type, ...]] = {
    "schema_version": (int,), "job_id": (str,), "node": (str,), "job_dir": (str,),
    "argv": (list,), "env": (dict,), "files": (dict,), "cwd": (str, type(None)),
    "attempt": (int,), "prefix": (str,), "rank_offsets": (dict,), "grace_s": (int, float),
    "rank_log_dir": (str, type(None)), "native": (dict, type(None)), "hold": (bool,),
    "keepalive_s": (int, float), "local_ranks": (int,), "zygote": (list,),
    "needs": (list,),
}


@dataclass
class AgentSpec:
    """What one node's agent does for one job attempt."""

    job_id: str
    node: str
    job_dir: str
    argv: list[str] = field(default_factory=list)  # empty: watch only (pdsh peers)
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # name in job_dir -> content
    cwd: str | None = None
    attempt: int = 0
    prefix: str = "torchrun"  # one of PREFIXES
    rank_offsets: dict[str, int] = field(default_factory=dict)  # node -> first global rank
    grace_s: float = DEFAULT_GRACE_S
    # DeepSpeed's launcher with --enable_each_rank_log writes each rank's output to
    # <dir>/<stamp>_rank<R>.log and nothing to the console: the agent tails those files.
    rank_log_dir: str | None = None
    # Native mode: the agent starts this node's ranks itself (NATIVE_KEYS).
    native: dict[str, Any] | None = None
    # The pre-launch gate folded into the agent: report facts, start nothing until GO.
    hold: bool = False
    # Dead-man switch: no control word (PING) for this many seconds and the agent
    # tears its ranks down by itself, even while the network stays down. 0: off.
    keepalive_s: float = 0.0
    # Ranks this node runs, whoever starts them (the agent, torchrun, accelerate): the
    # OpenMP thread rule divides the node's CPUs by it. 0: unknown (no rule applied).
    local_ranks: int = 0
    # Native mode (issue 15): modules a per-node fork server imports once before it
    # forks the ranks (clusterkit.node.zygote); empty: each rank is its own exec.
    zygote: list[str] = field(default_factory=list)
    # Files the ranks open that must be on this node (the user's script): the gate's
    # facts name the missing ones, so a node without the code fails before the start.
    needs: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AgentSpec:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ProtocolError(f"agent spec is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ProtocolError("agent spec is not a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AgentSpec:
        if data.get("schema_version") != SCHEMA_VERSION:
            raise _version_error("the agent spec", data.get("schema_version"))
        unknown = sorted(set(data) - set(_SPEC_TYPES))
        if unknown:
            raise ProtocolError(f"agent spec has unknown keys: {', '.join(unknown)}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ProtocolError(f"agent spec lacks: {', '.join(missing)}")
        for key, value in data.items():
            ok = _SPEC_TYPES[key]
            if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok):
                raise ProtocolError(f"agent spec key {key!r} has type {type(value).__name__}")
        spec = cls(**data)
        spec.check()
        return spec

    def check(self) -> None:
        """Value rules the types cannot say."""
        if self.prefix not in PREFIXES:
            raise ProtocolError(f"agent spec prefix {self.prefix!r} is not one of {PREFIXES}")
        if not all(isinstance(a, str) for a in self.argv):
            raise ProtocolError("agent spec argv must be a list of strings")
        if self.native is not None and sorted(self.native) != sorted(NATIVE_KEYS):
            raise ProtocolError(f"agent spec native needs exactly {', '.join(NATIVE_KEYS)}")
        if not all(isinstance(m, str) for m in self.zygote):
            raise ProtocolError("agent spec zygote must be a list of module names")
        for name in self.files:
            if "/" in name or name.startswith("."):
                raise ProtocolError(f"bad job file name {name!r}")



@dataclass(frozen=True)
class Event:
    """One ``@ck:E`` line: its kind, the reporting node and the kind's own fields."""

    ev: str
    node: str
    data: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


def encode_event(ev: str, node: str, **data: Any) -> str:
    """The line (with prefix) the agent prints for one event."""
    if ev not in EVENTS:
        raise ProtocolError(f"unknown event {ev!r}")
    return EVENT_PREFIX + json.dumps({"v": SCHEMA_VERSION, "ev": ev, "node": node, **data})


def decode_event(line: str) -> Event:
    """Parse one ``@ck:E`` line (with or without the prefix), strictly."""
    text = line[len(EVENT_PREFIX):] if line.startswith(EVENT_PREFIX) else line
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"agent event is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("agent event is not a JSON object")
    if raw.get("v") != SCHEMA_VERSION:
        raise _version_error("an agent event", raw.get("v"))
    ev, node = raw.pop("ev", None), raw.pop("node", None)
    raw.pop("v")
    if ev not in EVENTS or not isinstance(node, str):
        raise ProtocolError(f"agent event {ev!r} (node {node!r}) is not one this side knows")
    return Event(ev=str(ev), node=node, data=raw)


def control_line(word: str) -> bytes:
    """One control word as the bytes the launcher writes on the agent's stdin."""
    if word not in CONTROL_WORDS:
        raise ProtocolError(f"unknown control word {word!r}")
    return (word + "\n").encode()


def parse_control(line: str) -> str | None:
    """A control word, or None for anything else (ignored, never fatal mid-job)."""
    word = line.strip().upper()
    return word if word in CONTROL_WORDS else None
