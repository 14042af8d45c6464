"""The launcher <-> agent contract: the spec, the output lines, the events, the control words.

Shipped to the node with the agent (standard library, Python >= 3.8 at run
time) and imported by the launcher, so both ends read one definition.

* The **spec** (:class:`AgentSpec`) is one JSON line on the agent's stdin.
* The agent writes **lines** ``@ck:L <node> <local-rank|-> <text>`` and **events**
  ``@ck:E {"v": 1, "ev": ..., "node": ..., ...}`` on stdout.
* The launcher writes **control words** (:class:`Control`) on the agent's stdin, one
  per line.

Each ``@ck:`` line is one typed message (:class:`Line`, or one
:class:`AgentEvent` subclass per event kind); :func:`encode`/:func:`decode` are
the one line codec for both ends.

Both directions carry ``schema_version`` (events: ``v``). Decoding is strict:
an unknown key, a missing key, a wrong type or another version is a
:class:`ProtocolError` that says which side to update, never a silent default.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Union, cast, get_args

SCHEMA_VERSION = 1

LINE_PREFIX = "@ck:L "
EVENT_PREFIX = "@ck:E "
DEFAULT_GRACE_S = 3.0

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
    "needs": (list,), "replica": (dict, type(None)),
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
    # forks the ranks (clusterkit.node.agent.zygote); empty: each rank is its own exec.
    zygote: list[str] = field(default_factory=list)
    # Files the ranks open that must be on this node (the user's script): the gate's
    # facts name the missing ones, so a node without the code fails before the start.
    needs: list[str] = field(default_factory=list)
    # Checkpoint replication (issue 22; node/replicas/wire*.py): this node's index, its peers,
    # the per-job secret. None: no replication.
    replica: dict[str, Any] | None = field(default=None, repr=False)  # holds the secret
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AgentSpec:
        return cls.from_dict(_json_object("agent spec", text))

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



# ----------------------------------------------------------------- the wire messages
#
# Every line the agent writes that the launcher reads is one of the dataclasses below
# (``@ck:L``: :class:`Line`; ``@ck:E``: one per event kind), and every line the
# launcher writes after the spec is a :class:`Control` word. :func:`encode` and
# :func:`decode` are the one codec, both directions.

class CopyState(str, Enum):  # noqa: UP042 (no StrEnum on the node's Python 3.8)
    """How a checkpoint replica's copy ended (``Replica.state``); a str, so its JSON is
    its value (write ``.value`` in text: f-strings differ across Pythons)."""

    COMPLETE = "complete"  # received, sha256-verified, renamed into place
    FAILED = "failed"  # ``detail`` says why; nothing counts


_ENUMS: dict[str, type[Enum]] = {"CopyState": CopyState}  # decoded from their values
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
    "dict": (dict,), "list": (list,), "None": (type(None),), "Any": (object,),
    **{name: (str,) for name in _ENUMS},
}


def _accepted(annotation: str) -> tuple[type, ...]:
    """The JSON types a field's annotation (a string: postponed annotations) allows.

    Read from the annotation text so that the field list is the only declaration
    (``typing.get_type_hints`` cannot evaluate ``X | None`` on the node's Python 3.8).
    """
    out: tuple[type, ...] = ()
    for part in annotation.split("|"):
        out += _JSON_TYPES[part.strip().split("[", 1)[0]]
    return out


@dataclass(frozen=True)
class AgentEvent:
    """One ``@ck:E`` line: ``{"v": 1, "ev": <EV>, "node": ..., <the kind's fields>}``."""

    EV: ClassVar[str] = ""
    node: str

    @property
    def ev(self) -> str:
        return self.EV


@dataclass(frozen=True)
class Facts(AgentEvent):
    """The folded gate: what this node has (``facts.gatefacts``); the agent holds for GO."""

    EV: ClassVar[str] = "facts"
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Started(AgentEvent):
    """The node's launcher (``pid``) or its ranks (``pids``; ``zygote``: the fork
    server's pid) run; ``argv`` empty: the agent only watches."""

    EV: ClassVar[str] = "started"
    pid: int | None = None
    argv: list[str] = field(default_factory=list)
    pids: list[int] | None = None
    zygote: int | None = None


@dataclass(frozen=True)
class RankFailed(AgentEvent):
    """A rank failed (read off the launcher's output or seen exiting): the earliest
    report names the culprit. ``failed_node`` may be another node (pdsh, DeepSpeed)."""

    EV: ClassVar[str] = "rank-failed"
    failed_node: str = ""
    local_rank: int | None = None
    rank: int | None = None
    code: int = 1


@dataclass(frozen=True)
class Forwarded(AgentEvent):
    """USR1/USR2 reached ``processes`` of this node's ranks."""

    EV: ClassVar[str] = "forwarded"
    signal: str = ""
    processes: int = 0


@dataclass(frozen=True)
class Teardown(AgentEvent):
    """The agent is tearing its ranks down (``reason``: term, kill, stdin-eof, ...)."""

    EV: ClassVar[str] = "teardown"
    reason: str | None = None


@dataclass(frozen=True)
class Exit(AgentEvent):
    """The agent's last event: its exit code, why it stopped, what the sweep found
    (``held``: it never got GO and started nothing)."""

    EV: ClassVar[str] = "exit"
    code: int = 0
    reason: str | None = None
    held: bool = False
    signalled: int = 0
    killed: int = 0
    left: int = 0


@dataclass(frozen=True)
class Error(AgentEvent):
    """The agent itself failed (an exception in its own code)."""

    EV: ClassVar[str] = "error"
    message: str = ""


@dataclass(frozen=True)
class Progress(AgentEvent):
    """For the hang watchdog: seconds since this node's newest progress (ages, not
    clock times), each rank's age, the newest step, the agent's wall clock of it."""

    EV: ClassVar[str] = "progress"
    idle_s: float = 0.0
    ranks: dict[str, float] = field(default_factory=dict)
    step: int | None = None
    time: float = 0.0


@dataclass(frozen=True)
class Stacks(AgentEvent):
    """The ranks' Python stacks after DUMP: rank -> {pid, state, tool, text}, and
    where the agent wrote them on the node."""

    EV: ClassVar[str] = "stacks"
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)
    dir: str = ""


@dataclass(frozen=True)
class Replica(AgentEvent):
    """A copy of node index ``source``'s checkpoint ``tag`` to node ``target`` ended:
    ``state`` is ``complete`` (received, sha256-verified, renamed into place) or
    ``failed`` (``detail`` says why; nothing counts)."""

    EV: ClassVar[str] = "replica"
    tag: str = ""
    source: int = 0
    target: str = ""
    state: CopyState = CopyState.FAILED
    detail: str = ""
    bytes: int = 0
    seconds: float = 0.0


# Replica.detail of a complete push the holder answered HAVE to: its copy's manifest names
# these very files (sizes and source mtimes), so nothing was sent.
REPLICA_ALREADY_THERE = "already there"


@dataclass(frozen=True)
class StopReply:
    """``agent.core --stop``'s answer, one JSON line on stdout: what the sweep of the job's
    processes on that node did (``clusterkit stop``, the launcher's teardown check)."""

    signalled: int = 0  # SIGTERMed
    killed: int = 0  # SIGKILLed after the grace
    left: int = 0  # still there at the end: the stop did not finish on this node

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> StopReply:
        """Strict: a line that is not this reply raises :class:`ProtocolError`."""
        return cls.from_dict(_json_object("stop reply", line))

    @classmethod
    def from_stdout(cls, stdout: str) -> StopReply:
        """The reply among ``agent.core --stop``'s output (:func:`answer_of`)."""
        return cls.from_dict(answer_of(stdout, "agent.core --stop"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StopReply:
        return cls(**_checked("stop reply", cls, dict(raw)))


# Every event kind as one type: the launcher matches it with assert_never
# (launch/runtime.py), so a kind added here without a case there fails mypy.
AnyEvent = Union[Facts, Started, RankFailed, Forwarded, Teardown, Exit, Error,  # noqa: UP007
                 Progress, Stacks, Replica]
EVENT_TYPES: dict[str, type[AgentEvent]] = {c.EV: c for c in get_args(AnyEvent)}
EVENTS = tuple(EVENT_TYPES)


@dataclass(frozen=True)
class Line:
    """One ``@ck:L <node> <local-rank|-> <text>`` line: a rank's output (``local_rank``)
    or its launcher's (None)."""

    node: str
    local_rank: int | None
    text: str

    def rank(self, offsets: dict[str, int], default: int) -> int | None:
        """The global rank (``offsets``: node -> first rank; ``default``: the reader's)."""
        if self.local_rank is None:
            return None
        return offsets.get(self.node, default) + self.local_rank


class Control(Enum):
    """A control word, launcher -> agent, one per stdin line."""

    TERM = "TERM"  # tear down (grace, then SIGKILL)
    KILL = "KILL"  # tear down now
    GO = "GO"  # the folded gate passed: start the ranks
    USR1 = "USR1"  # forward the signal to the ranks
    USR2 = "USR2"
    # Hangs (issue 14): PING keeps the agent's dead-man switch from firing; DUMP asks
    # it for the Python stacks of its ranks.
    PING = "PING"
    DUMP = "DUMP"

    def line(self) -> bytes:
        """The bytes the launcher writes on the agent's stdin."""
        return (self.value + "\n").encode()

    @classmethod
    def parse(cls, line: str) -> Control | None:
        """A control word, or None for anything else (ignored, never fatal mid-job)."""
        return cls.__members__.get(line.strip().upper())


TERM, KILL, GO, USR1, USR2, PING, DUMP = (Control.TERM, Control.KILL, Control.GO, Control.USR1,
                                          Control.USR2, Control.PING, Control.DUMP)
CONTROL_WORDS = tuple(c.value for c in Control)

# Union, not `|`: this alias is evaluated at run time, on the node's Python >= 3.8.
Message = Union[Line, AgentEvent]  # noqa: UP007


def encode(msg: Message) -> str:
    """The line (with its prefix) the agent prints for one message."""
    if isinstance(msg, Line):
        return f"{LINE_PREFIX}{msg.node} {'-' if msg.local_rank is None else msg.local_rank} " \
               f"{msg.text}"
    if EVENT_TYPES.get(msg.EV) is not type(msg):
        raise ProtocolError(f"unknown event {type(msg).__name__}")
    return EVENT_PREFIX + json.dumps({"v": SCHEMA_VERSION, "ev": msg.EV, **asdict(msg)})


def decode(line: str) -> Line | AnyEvent | None:
    """The message on one agent stdout line; None: not a protocol line (the agent's
    own output: a traceback, a Python that cannot start). A bad event raises."""
    if line.startswith(LINE_PREFIX):
        node, lrank, text = [*line[len(LINE_PREFIX):].split(" ", 2), "", ""][:3]
        return Line(node, int(lrank) if lrank.isdigit() else None, text)
    if line.startswith(EVENT_PREFIX):
        return decode_event(line)
    return None


def decode_event(line: str) -> AnyEvent:
    """Parse one ``@ck:E`` line (with or without the prefix), strictly."""
    text = line[len(EVENT_PREFIX):] if line.startswith(EVENT_PREFIX) else line
    raw = _json_object("agent event", text)
    if raw.get("v") != SCHEMA_VERSION:
        raise _version_error("an agent event", raw.get("v"))
    ev = raw.pop("ev", None)
    raw.pop("v")
    cls = EVENT_TYPES.get(ev) if isinstance(ev, str) else None
    if cls is None or not isinstance(raw.get("node"), str):
        raise ProtocolError(f"agent event {ev!r} (node {raw.get('node')!r}) is not one this "
                            "side knows")
    return cast(AnyEvent, cls(**_checked(f"agent event {ev!r}", cls, raw)))


def answer_of(stdout: str, what: str = "the node program") -> dict[str, Any]:
    """A node program's answer: the last line of its stdout that is a JSON object.

    Every node program ends its stdout with its answer, one JSON object line; the
    launcher reads every program's answer by this one rule. Other lines (a login banner,
    a noisy ``.bashrc``, a library's print, before or after it) are skipped. None there:
    :class:`ProtocolError` naming the last line."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    tail = stdout.strip().splitlines()[-1:] or ["<empty>"]
    raise ProtocolError(f"no JSON answer from {what} (last line: {tail[0][:200]!r})")


def _json_object(what: str, text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"{what} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{what} is not a JSON object")
    return data


def _checked(what: str, cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` when its keys are ``cls``'s fields with the declared JSON types."""
    types = {f.name: _accepted(str(f.type)) for f in fields(cls)}
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ProtocolError(f"{what} has unknown keys: {', '.join(unknown)}")
    for key, value in data.items():
        ok = types[key]
        if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok
                                         and object not in ok):
            raise ProtocolError(f"{what} key {key!r} has type {type(value).__name__}")
    for f in fields(cls):
        enum = _ENUMS.get(str(f.type))
        if enum is not None and f.name in data:
            try:
                data[f.name] = enum(data[f.name])
            except ValueError:
                raise ProtocolError(f"{what} key {f.name!r} is {data[f.name]!r}, not one of "
                                    + ", ".join(str(m.value) for m in enum)) from None
    return data
