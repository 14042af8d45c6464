"""The inventory: clusterkit's single source of truth (schema in docs/inventory.md).

Loading is strict: an unknown key, a bad host range, a duplicate host, a bad value
or a YAML syntax error raises :class:`InventoryError` naming ``file:line`` and what
to do. The parsed result is made of frozen dataclasses in rank order.

One file because: the records and the strict loader are one contract, read
together (each key the loader accepts is a field of a record here, each check names
the key); the loader's ~400 lines are small per-key checks. A split would add a
module to the layer table (tests/unit/test_layering.py) for the records alone.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from typing import Any

import yaml

from clusterkit.errors import InventoryError, RenderError
from clusterkit.hostrange import HostRangeError, expand
from clusterkit.node.contract import ENV_CKPT_DIR, ENV_JOB_DIR
from clusterkit.shellsafe import check_env_value, ssh_config_value

SCHEMA_VERSION = 1
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ADDRESS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:%-]*")
TRANSPORTS = ("ssh", "local")

LOOPBACK = "127.0.0.1"  # the default address of a local-transport host


@dataclass(frozen=True)
class SSHSettings:
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None
    config_file: str | None = None
    known_hosts_file: str | None = None


def ssh_options(*, user: str | None = None, port: int | None = None,
                identity_file: str | None = None, proxy_jump: str | None = None,
                known_hosts_file: str | None = None, accept_new_host_keys: bool = False
                ) -> dict[str, str]:
    """The one mapping from inventory SSH fields to ssh_config(5) keywords.

    paramiko (as the first, command-line-like layer), the OpenSSH tar streams
    (``-o K=V``) and pdsh's rendered ssh_config all take their options from here,
    so they honour the same fields by construction. Unset fields are left out:
    ``~/.ssh/config`` then ``/etc/ssh/ssh_config`` decide those, first value wins.
    """
    values = {"User": user, "Port": None if port is None else str(port),
              "IdentityFile": identity_file, "ProxyJump": proxy_jump,
              "UserKnownHostsFile": known_hosts_file,
              "StrictHostKeyChecking": "accept-new" if accept_new_host_keys else None}
    return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class CheckpointStorage:
    shared_dir: str | None = None
    local_dir: str | None = None
    replicas: int | None = None  # the default of --replicas (docs/lost-a-node.md)


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    transport: str = "ssh"
    ssh: SSHSettings = field(default_factory=SSHSettings)
    gpus: int = 0
    gpu_model: str | None = None
    slots: int = 1
    python: str | None = None  # None: the launcher's own interpreter path
    workdir: str | None = None  # None: the launcher's working directory
    checkpoint: CheckpointStorage = field(default_factory=CheckpointStorage)
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    env_allowlist: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)


    def ssh_options(self) -> dict[str, str]:
        """This host's inventory SSH fields as ssh_config keywords (see :func:`ssh_options`)."""
        s = self.ssh
        return ssh_options(user=s.user, port=s.port, identity_file=s.identity_file,
                           proxy_jump=s.proxy_jump, known_hosts_file=s.known_hosts_file)


@dataclass(frozen=True)
class Inventory:
    hosts: tuple[Host, ...]
    name: str = "cluster"
    path: str | None = None
    # Spare hosts (docs/lost-a-node.md): kept out of every selection; `launch --replace
    # OLD` runs OLD's ranks on the first one not in use.
    spares: tuple[str, ...] = ()

    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "path": self.path,
            "hosts": [asdict(h) | {"env": dict(h.env), "labels": dict(h.labels)} for h in self.hosts],
            "spares": list(self.spares),  # hosts never selected: launch --replace's
        }


# --------------------------------------------------------------------------- YAML with lines


class _LineDict(dict[Any, Any]):
    """A mapping that remembers the 1-based line of each key (and of itself), and the
    text of each plain (unquoted) scalar value as written: ``1.10``, not YAML's 1.1."""

    line: int = 0
    key_lines: dict[Any, int]
    plain: dict[Any, str]


class _LineLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> _LineDict:
    loader.flatten_mapping(node)
    out = _LineDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    out.plain = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str | int | float | bool) or key is None:
            raise _Located(line, f"mapping key {key!r} must be a plain string")
        if key in out:
            # PyYAML silently keeps the last duplicate; for an inventory that hides a mistake.
            raise _Located(line, f"duplicate key {key!r} (first at line {out.key_lines[key]})")
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = line
        if isinstance(value_node, yaml.ScalarNode) and not value_node.style:
            out.plain[key] = value_node.value
    return out


_LineLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


class _Located(Exception):
    def __init__(self, line: int, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.message = message
        self.hint = hint


# --------------------------------------------------------------------------- field specs

_HOST_KEYS = (
    "address",
    "transport",
    "ssh",
    "gpus",
    "gpu_model",
    "slots",
    "python",
    "workdir",
    "checkpoint",
    "env",
    "env_allowlist",
    "labels",
)
_SSH_KEYS = ("user", "port", "identity_file", "proxy_jump", "config_file", "known_hosts_file")
MAX_REPLICAS = 16  # checkpoint.replicas: copies of each node's checkpoints on other nodes


def replicas_problem(k: int) -> str | None:
    """What is wrong with K checkpoint replicas, None when nothing: the one bound for the
    inventory's checkpoint.replicas, launch's --replicas and doctor's --replicas."""
    if k < 0:
        return f"must be >= 0, got {k}"
    return None if k <= MAX_REPLICAS else f"must be <= {MAX_REPLICAS}, got {k}"
_CKPT_KEYS = ("shared_dir", "local_dir", "replicas")
_TOP_KEYS = ("schema_version", "cluster", "defaults", "hosts", "spares")
_CLUSTER_KEYS = ("name",)


@dataclass
class _Ctx:
    path: str

    def fail(self, line: int, message: str, hint: str | None = None, key: str | None = None) -> None:
        raise InventoryError(message, path=self.path, line=line or None, key=key, hint=hint)


def _line_of(mapping: Any, key: Any) -> int:
    if isinstance(mapping, _LineDict):
        return mapping.key_lines.get(key, mapping.line)
    return 0


def _check_keys(ctx: _Ctx, mapping: _LineDict, allowed: tuple[str, ...], where: str) -> None:
    for key in mapping:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
            ctx.fail(_line_of(mapping, key), f"unknown key {key!r} in {where}", hint)


def _require_mapping(ctx: _Ctx, value: Any, line: int, where: str) -> _LineDict:
    if value is None:
        empty = _LineDict()
        empty.line, empty.key_lines = line, {}
        return empty
    if not isinstance(value, _LineDict):
        ctx.fail(line, f"{where} must be a mapping (key: value lines), got {type(value).__name__}")
    assert isinstance(value, _LineDict)
    return value


def _as_str(ctx: _Ctx, value: Any, line: int, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        ctx.fail(line, f"{where} must be a non-empty string, got {value!r}")
    return str(value)


def _as_abs_path(ctx: _Ctx, value: Any, line: int, where: str) -> str:
    # The same rule as the planner's (plan/build.py): these paths reach argv and files
    # verbatim, where nothing would expand a ``~`` (issue 25: validate said ok to it).
    text = _as_str(ctx, value, line, where)
    if text.startswith("~") or not PurePosixPath(text).is_absolute():
        ctx.fail(line, f"{where} must be an absolute path, got {text!r}",
                 "write the full path (clusterkit passes it as a literal argument: nothing "
                 "expands ~ there)")
    return text


def _shell_rule(ctx: _Ctx, line: int, where: str, rule: Callable[[str, str], object],
                *args: str) -> None:
    """A :mod:`clusterkit.shellsafe` rule, applied where the user wrote the value: the
    launch refuses what these rules refuse, so ``inventory validate`` must refuse it too,
    naming file:line instead of a variable the plan met later."""
    try:
        rule(*args)
    except RenderError as exc:
        ctx.fail(line, exc.message, exc.hint, key=where)


def _as_int(ctx: _Ctx, value: Any, line: int, where: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        ctx.fail(line, f"{where} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        ctx.fail(line, f"{where} must be between {minimum} and {maximum}, got {value}")
    return int(value)


def _as_str_map(ctx: _Ctx, value: Any, line: int, where: str) -> dict[str, str]:
    mapping = _require_mapping(ctx, value, line, where)
    out: dict[str, str] = {}
    for k, v in mapping.items():
        kl = _line_of(mapping, k)
        if not isinstance(k, str):
            ctx.fail(kl, f"{where} key {k!r} must be a string")
        if isinstance(v, _LineDict | list) or v is None:
            ctx.fail(kl, f"{where}.{k} must be a scalar value, got {v!r}", "quote it as a string")
        out[k] = str(v).lower() if isinstance(v, bool) else str(v)
    return out


def _as_env_map(ctx: _Ctx, value: Any, line: int, where: str) -> dict[str, str]:
    """``env:`` names and values are checked here, where the user wrote them, by the rules
    the launch applies (:func:`clusterkit.shellsafe.check_env_value`)."""
    mapping = _require_mapping(ctx, value, line, where)
    for name, v in mapping.items():
        _env_value_is_a_string(ctx, mapping, name, v, where)
    out = _as_str_map(ctx, mapping, line, where)
    for name, text in out.items():
        kl = _line_of(value, name)
        if not _ENV_NAME.fullmatch(name):
            ctx.fail(kl, f"{where}: {name!r} is not an environment variable name",
                     "names must match [A-Za-z_][A-Za-z0-9_]* (no spaces or dashes)")
        _shell_rule(ctx, kl, f"{where}.{name}", check_env_value, name, text)
    return out


_YAML_TYPES = {bool: "a boolean", int: "a number", float: "a number"}


def _env_value_is_a_string(ctx: _Ctx, mapping: _LineDict, name: Any, v: Any, where: str) -> None:
    """A bare ``1.10``, ``010``, ``true`` or empty value is YAML's number, boolean or null:
    the ranks got ``1.1`` and ``8`` (issue 25). Environment values are text: quote them."""
    if isinstance(v, str | _LineDict | list):
        return  # lists and mappings: _as_str_map says "must be a scalar value"
    written = mapping.plain.get(name, "")
    what = "null (no value)" if v is None else f"{_YAML_TYPES.get(type(v), 'a value')} ({v!r})"
    ctx.fail(_line_of(mapping, name),
             f"{written or '(empty)'} is not a string: YAML reads it as {what}",
             f'quote it: {name}: "{written}"', key=f"{where}.{name}")


def _as_python(ctx: _Ctx, value: Any, line: int, where: str) -> str:
    """The interpreter path reaches PATH, .deepspeed_env and pdsh command lines verbatim:
    refuse what they cannot carry here, naming ``python:`` (not PATH, set from it later)."""
    text = _as_abs_path(ctx, value, line, where)
    bad = sorted({c for c in text if c in _UNSAFE_PATH_CHARS or not c.isprintable()})
    if bad:
        ctx.fail(line, f"{where} {text!r} contains {' '.join(repr(c) for c in bad)}",
                 "write the interpreter's literal path: nothing expands variables or quotes "
                 "there, and the path reaches remote shells")
    return text


def _parse_ssh(ctx: _Ctx, value: Any, line: int, where: str) -> dict[str, Any]:
    mapping = _require_mapping(ctx, value, line, where)
    _check_keys(ctx, mapping, _SSH_KEYS, where)
    out: dict[str, Any] = {}
    for key, v in mapping.items():
        kl = _line_of(mapping, key)
        if key == "port":
            out[key] = _as_int(ctx, v, kl, f"{where}.port", 1, 65535)
        else:
            out[key] = text = _as_str(ctx, v, kl, f"{where}.{key}")
            # Every job renders these into its ssh_config (render/ssh_config.py).
            _shell_rule(ctx, kl, f"{where}.{key}", ssh_config_value, text, f"ssh.{key}")
    return out


def _parse_ckpt(ctx: _Ctx, value: Any, line: int, where: str) -> dict[str, Any]:
    mapping = _require_mapping(ctx, value, line, where)
    _check_keys(ctx, mapping, _CKPT_KEYS, where)
    return {k: _as_int(ctx, v, _line_of(mapping, k), f"{where}.{k}", 0, MAX_REPLICAS)
            if k == "replicas" else
            _as_env_path(ctx, v, _line_of(mapping, k), f"{where}.{k}", ENV_CKPT_DIR)
            for k, v in mapping.items()}


def _as_env_path(ctx: _Ctx, value: Any, line: int, where: str, env_name: str) -> str:
    """An absolute path every rank gets in its environment (``env_name``, the user-script
    contract): the launch refuses what the environment cannot carry, so refuse it here."""
    text = _as_abs_path(ctx, value, line, where)
    _shell_rule(ctx, line, where, check_env_value, env_name, text)
    return text


def _as_workdir(ctx: _Ctx, value: Any, line: int, where: str) -> str:
    return _as_env_path(ctx, value, line, where, ENV_JOB_DIR)  # <workdir>/.clusterkit/jobs/<id>


def _parse_allowlist(ctx: _Ctx, value: Any, line: int, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        ctx.fail(line, f"{where} must be a list of variable names or globs, got {value!r}")
    return tuple(value)


_Parser = Callable[[_Ctx, Any, int, str], Any]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNSAFE_PATH_CHARS = frozenset("$`\"\\' \t")
_FIELD_PARSERS: dict[str, _Parser] = {
    "address": _as_str,
    "transport": lambda c, v, ln, w: _choice(c, v, ln, w, TRANSPORTS),
    "ssh": _parse_ssh,
    "gpus": lambda c, v, ln, w: _as_int(c, v, ln, w, 0, 1024),
    "gpu_model": _as_str,
    "slots": lambda c, v, ln, w: _as_int(c, v, ln, w, 1, 4096),
    "python": _as_python,
    "workdir": _as_workdir,
    "checkpoint": _parse_ckpt,
    "env": _as_env_map,
    "env_allowlist": _parse_allowlist,
    "labels": _as_str_map,
}


def _choice(ctx: _Ctx, value: Any, line: int, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        ctx.fail(line, f"{where} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _parse_settings(ctx: _Ctx, value: Any, line: int, where: str) -> dict[str, Any]:
    mapping = _require_mapping(ctx, value, line, where)
    _check_keys(ctx, mapping, _HOST_KEYS, where)
    return {
        key: _FIELD_PARSERS[key](ctx, v, _line_of(mapping, key), f"{where}.{key}")
        for key, v in mapping.items()
    }


# --------------------------------------------------------------------------- building hosts


def _merge(defaults: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """Host keys override defaults; nested mappings merge key by key."""
    merged = dict(defaults)
    for key, value in own.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _make_host(name: str, address: str | None, s: dict[str, Any]) -> Host:
    gpus = int(s.get("gpus", 0))
    slots = int(s.get("slots", gpus if gpus > 0 else 1))
    transport = s.get("transport", "ssh")
    return Host(
        name=name,
        # A local-transport host is this machine: its default address is loopback, the
        # one every "node" of it reaches (its name, e.g. v0, resolves nowhere and would
        # be the master address ranks cannot connect to).
        address=address or (LOOPBACK if transport == "local" else name),
        transport=transport,
        ssh=SSHSettings(**s.get("ssh", {})),
        gpus=gpus,
        gpu_model=s.get("gpu_model"),
        slots=slots,
        python=s.get("python"),
        workdir=s.get("workdir"),
        checkpoint=CheckpointStorage(**s.get("checkpoint", {})),
        env=dict(s.get("env", {})),
        env_allowlist=tuple(s.get("env_allowlist", ())),
        labels=dict(s.get("labels", {})),
    )


def _expand_or_fail(ctx: _Ctx, pattern: str, line: int, what: str) -> list[str]:
    try:
        return expand(pattern)
    except HostRangeError as exc:
        ctx.fail(line, f"bad {what} range: {exc}", "use forms like node[01-07] or gpu[1-3,7]")
    raise AssertionError("unreachable")


def _hosts_for_entry(
    ctx: _Ctx, pattern: Any, line: int, settings: dict[str, Any], defaults: dict[str, Any]
) -> list[Host]:
    if not isinstance(pattern, str):
        ctx.fail(line, f"host name {pattern!r} must be a string", "quote it")
    names = _expand_or_fail(ctx, pattern, line, "host")
    for n in names:
        if not _HOST_NAME.fullmatch(n):
            ctx.fail(line, f"host name {n!r} is not a plain host name",
                     "use letters, digits, '.', '-' and '_' (it reaches shells and pdsh)")
    merged = _merge(defaults, settings)
    address = merged.pop("address", None)
    if address is None:
        return [_make_host(n, None, merged) for n in names]
    addresses = _expand_or_fail(ctx, address, line, "address")
    for a in addresses:
        if not ADDRESS.fullmatch(a):
            ctx.fail(line, f"address {a!r} is not a host name or IP address",
                     "use a name, an IPv4/IPv6 address or an ~/.ssh/config alias")
    if len(addresses) == 1 and len(names) > 1 and address == addresses[0]:
        ctx.fail(line, f"{pattern} names {len(names)} hosts but one address {address!r}",
                 "give a range of addresses, e.g. 10.0.0.[11-17], or one entry per host")
    if len(addresses) != len(names):
        ctx.fail(line, f"{pattern} has {len(names)} names but {address!r} has {len(addresses)}"
                 " addresses", "make both ranges the same length")
    return [_make_host(n, a, merged) for n, a in zip(names, addresses, strict=False)]


def _build(ctx: _Ctx, doc: Any) -> Inventory:
    if not isinstance(doc, _LineDict):
        ctx.fail(1, "the inventory must be a YAML mapping with schema_version and hosts",
                 "see docs/inventory.md for an example")
    assert isinstance(doc, _LineDict)
    _check_keys(ctx, doc, _TOP_KEYS, "the inventory")
    if "schema_version" not in doc:
        ctx.fail(1, "missing schema_version", f"add 'schema_version: {SCHEMA_VERSION}' at the top")
    if doc["schema_version"] != SCHEMA_VERSION:
        ctx.fail(_line_of(doc, "schema_version"),
                 f"schema_version {doc['schema_version']!r} is not supported",
                 f"this clusterkit reads schema_version {SCHEMA_VERSION}")
    cluster = _require_mapping(ctx, doc.get("cluster"), _line_of(doc, "cluster"), "cluster")
    _check_keys(ctx, cluster, _CLUSTER_KEYS, "cluster")
    name = _as_str(ctx, cluster["name"], _line_of(cluster, "name"), "cluster.name") \
        if "name" in cluster else "cluster"
    defaults = _parse_settings(ctx, doc.get("defaults"), _line_of(doc, "defaults"), "defaults")
    if "address" in defaults:
        ctx.fail(_line_of(doc, "defaults"), "defaults.address makes every host the same machine",
                 "set address per host")
    hosts_doc = doc.get("hosts")
    if not isinstance(hosts_doc, _LineDict) or not hosts_doc:
        ctx.fail(_line_of(doc, "hosts") or 1, "hosts must be a non-empty mapping of host names",
                 "add e.g. 'hosts: {node[01-07]: {address: 10.0.0.[11-17]}}'")
    assert isinstance(hosts_doc, _LineDict)
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    by_address: dict[tuple[str, int | None], str] = {}  # two names, one machine: refused
    for pattern, value in hosts_doc.items():
        line = _line_of(hosts_doc, pattern)
        settings = _parse_settings(ctx, value, line, f"hosts.{pattern}")
        for host in _hosts_for_entry(ctx, pattern, line, settings, defaults):
            if host.name in seen:
                ctx.fail(line, f"duplicate host {host.name!r} (already defined at line "
                         f"{seen[host.name]})", "list each host once")
            seen[host.name] = line
            where = (host.address, host.ssh.port)
            if host.transport == "ssh" and where in by_address:
                ctx.fail(line, f"{host.name} has the same address {host.address!r} as "
                         f"{by_address[where]}", "each host needs its own address (or its own "
                         "ssh.port); list a machine once")
            by_address.setdefault(where, host.name)
            hosts.append(host)
    return Inventory(hosts=tuple(hosts), name=name, path=ctx.path,
                     spares=_spares(ctx, doc, seen))


def _spares(ctx: _Ctx, doc: _LineDict, known: Mapping[str, int]) -> tuple[str, ...]:
    """``spares: [node8]`` (names or host ranges of hosts listed under ``hosts``)."""
    raw = doc.get("spares")
    if raw is None:
        return ()
    line = _line_of(doc, "spares")
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        ctx.fail(line, "spares must be a list of host names", "e.g. 'spares: [node8]'")
    names: list[str] = []
    for item in items:
        try:
            names += expand(item)
        except HostRangeError as exc:
            ctx.fail(line, f"spares: {exc}")
    unknown = [n for n in names if n not in known]
    if unknown:
        ctx.fail(line, f"spares: {', '.join(unknown)} not among the hosts",
                 "list each spare under hosts too (its address, slots, ...)")
    return tuple(dict.fromkeys(names))


def parse_inventory(text: str, path: str = "<inventory>") -> Inventory:
    """Parse inventory YAML text. Pure; ``path`` is only used in messages."""
    ctx = _Ctx(path)
    try:
        doc = yaml.load(text, Loader=_LineLoader)
    except _Located as exc:
        raise InventoryError(exc.message, path=path, line=exc.line, hint=exc.hint) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise InventoryError(f"YAML syntax error: {problem}", path=path, line=line,
                             hint="check indentation and quoting on that line") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"YAML error: {exc}", path=path) from None
    return _build(ctx, doc)


def load_inventory(path: str | os.PathLike[str]) -> Inventory:
    """Read and parse an inventory file."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise InventoryError("inventory file not found", path=p,
                             hint="pass --inventory PATH or create one (see docs/inventory.md)"
                             ) from None
    except IsADirectoryError:
        raise InventoryError("is a directory, not an inventory file", path=p) from None
    except UnicodeDecodeError:
        raise InventoryError("not a UTF-8 text file", path=p) from None
    except OSError as exc:
        raise InventoryError(f"cannot read: {exc.strerror}", path=p) from None
    return parse_inventory(text, p)


def local_inventory(base_dir: str, nodes: int = 4, slots: int = 2) -> Inventory:
    """The embedded default: virtual nodes on this machine, no SSH, no root.

    Each virtual node gets its own node-local checkpoint directory under
    ``base_dir`` so node-local storage behaves like separate disks.
    """
    hosts = tuple(
        Host(
            name=f"local{i}",
            address=LOOPBACK,
            transport="local",
            slots=slots,
            checkpoint=CheckpointStorage(
                shared_dir=f"{base_dir}/shared/ckpt",
                local_dir=f"{base_dir}/nodes/local{i}/ckpt",
            ),
        )
        for i in range(1, nodes + 1)
    )
    return Inventory(hosts=hosts, name="local", path=None)
