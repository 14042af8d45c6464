"""DeepSpeed hostfiles and host selection, matching ``deepspeed/launcher/runner.py``.

Pure functions. The parser and the include/exclude filter reproduce DeepSpeed's
runner (``_parse_hostfile``, ``parse_resource_filter``,
``apply_num_nodes_and_gpus``) result for result; tests use DeepSpeed's own
functions as the oracle. Where DeepSpeed silently does something surprising we
are deliberately stricter, and say so here:

* ``--nodes N`` with fewer than N hosts available is an error (DeepSpeed takes all).
* ``--nodes 0`` / ``--gpus-per-node 0`` are errors (DeepSpeed treats 0 as "no limit").
* ``--gpus-per-node G`` above a host's slots is an error (DeepSpeed invents slots).
* ``slots=0`` is an error naming its line: DeepSpeed keeps such a host in the world
  with no rank unless ``--include``/``--exclude`` is given, and drops it when one is
  (two meanings; we had made it a 1-slot CPU node, a third).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from clusterkit.errors import InventoryError, SelectionError
from clusterkit.hostrange import HostRangeError, expand, fold
from clusterkit.inventory import Host, Inventory

# Exactly DeepSpeed's rule: trailing text after slots=N is ignored.
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def parse_hostfile(text: str, path: str = "<hostfile>") -> OrderedDict[str, int]:
    """Parse hostfile text into ``{host: slots}`` in file order (= rank order)."""
    pool: OrderedDict[str, int] = OrderedDict()
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line.startswith("#") or line == "":
            continue
        m = HOSTFILE_LINE.search(line)
        if not m:
            raise InventoryError(
                f"bad hostfile entry {line!r}", path=path, line=lineno,
                hint="each line must read 'HOSTNAME slots=N'",
            )
        host, slots = m.group(1), int(m.group(2))
        if host in pool:
            raise InventoryError(
                f"host {host!r} is listed twice (first at line {first_line[host]})",
                path=path, line=lineno, hint="list each host once",
            )
        if slots == 0:
            raise InventoryError(
                f"host {host!r} has slots=0: a host without slots runs no rank", path=path,
                line=lineno, hint="delete the line (or comment it out with #) to leave the "
                                  "host out, or give it slots=N with N >= 1")
        pool[host] = slots
        first_line[host] = lineno
    if not pool:
        raise InventoryError("hostfile is empty", path=path,
                             hint="add lines of the form 'HOSTNAME slots=N'")
    return pool


def render_hostfile(pool: Mapping[str, int] | Mapping[str, list[int]]) -> str:
    """``{host: slots}`` (or ``{host: [slot ids]}``) → DeepSpeed hostfile text."""
    lines = []
    for host, slots in pool.items():
        count = slots if isinstance(slots, int) else len(slots)
        lines.append(f"{host} slots={count}")
    return "\n".join(lines) + "\n"


def inventory_pool(inventory: Inventory) -> OrderedDict[str, int]:
    return OrderedDict((h.name, h.slots) for h in inventory.hosts)


# --------------------------------------------------------------------------- NODE_SPEC


def _parse_node_config(spec: str, flag: str) -> tuple[str, list[int]]:
    if ":" not in spec:
        return spec, []
    parts = spec.split(":")
    if len(parts) != 2:
        raise SelectionError(f"{flag} {spec!r}: more than one ':'",
                             hint="use NAME:SLOT[,SLOT...] separated by '@'")
    host, slots = parts
    try:
        return host, [int(x) for x in slots.split(",")]
    except ValueError:
        raise SelectionError(f"{flag} {spec!r}: slots must be integers",
                             hint="use NAME:SLOT[,SLOT...], e.g. node1:0,1") from None


def _parse_node_config_list(text: str, flag: str) -> dict[str, list[int]]:
    specs: dict[str, list[int]] = {}
    for spec in text.split("@"):
        host, slots = _parse_node_config(spec, flag)
        specs.setdefault(host, []).extend(slots)
    # A bare NAME next to NAME:SLOT keeps only the listed slots, as in DeepSpeed.
    return {k: sorted(set(v)) for k, v in specs.items()}


def _unknown_host(host: str, pool: Mapping[str, object], flag: str) -> SelectionError:
    return SelectionError(
        f"{flag}: host {host!r} is not in the inventory", key=flag,
        hint=f"known hosts: {', '.join(pool)}" if len(pool) <= 16 else "see 'clusterkit inventory show'",
    )


def filter_resources(
    pool: Mapping[str, list[int]], include: str = "", exclude: str = ""
) -> OrderedDict[str, list[int]]:
    """DeepSpeed's ``parse_resource_filter`` with clusterkit errors."""
    if include and exclude:
        raise SelectionError("--include and --exclude are mutually exclusive",
                             hint="use one of them")
    if not include and not exclude:
        return OrderedDict((h, list(s)) for h, s in pool.items())
    flag = "--include" if include else "--exclude"
    filtered: dict[str, list[int]] = {} if include else {h: list(s) for h, s in pool.items()}
    for host, slots in _parse_node_config_list(include or exclude, flag).items():
        if host not in pool:
            raise _unknown_host(host, pool, flag)
        for slot in slots:
            if slot not in pool[host]:
                raise SelectionError(f"{flag}: host {host!r} has no slot {slot}", key=flag,
                                     hint=f"{host} has slots {pool[host]}")
        if include:
            filtered[host] = slots if slots else list(pool[host])
        elif slots:
            for slot in slots:
                filtered[host].remove(slot)
        else:
            filtered[host] = []
    return OrderedDict(
        (h, list(dict.fromkeys(filtered[h]))) for h in pool if filtered.get(h)
    )


def select(
    pool: Mapping[str, int],
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    include: str = "",
    exclude: str = "",
) -> OrderedDict[str, list[int]]:
    """Choose hosts and slot ids the way ``deepspeed --num_nodes/--num_gpus/--include`` does."""
    if (nodes is not None or gpus_per_node is not None) and (include or exclude):
        raise SelectionError("--nodes/--gpus-per-node cannot be combined with --include/--exclude",
                             hint="select hosts with one or the other")
    active = filter_resources(
        OrderedDict((h, list(range(n))) for h, n in pool.items()), include, exclude
    )
    if not active:
        raise SelectionError("the selection leaves no hosts", hint="check --include/--exclude")
    if nodes is not None:
        if nodes < 1:
            raise SelectionError(f"--nodes must be at least 1, got {nodes}")
        if nodes > len(active):
            raise SelectionError(
                f"--nodes {nodes} but only {len(active)} hosts are available", key="--nodes",
                hint="add hosts to the inventory or ask for fewer nodes",
            )
        active = OrderedDict(list(active.items())[:nodes])
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise SelectionError(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
        short = [h for h in active if pool[h] < gpus_per_node]
        if short:
            raise SelectionError(
                f"--gpus-per-node {gpus_per_node} exceeds the slots of {', '.join(short)}",
                key="--gpus-per-node", hint="lower --gpus-per-node or fix slots in the inventory",
            )
        active = OrderedDict((h, list(range(gpus_per_node))) for h in active)
    return active


def select_hosts(
    inventory: Inventory,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    include: str = "",
    exclude: str = "",
    replace: Sequence[str] = (),
) -> list[tuple[Host, list[int]]]:
    """The inventory hosts chosen by the selection flags, with their slot ids, in rank order."""
    pool = inventory_pool(inventory)
    # Spares are never selected; they only take a replaced host's place.
    chosen = select(OrderedDict((h, n) for h, n in pool.items() if h not in inventory.spares),
                    nodes=nodes, gpus_per_node=gpus_per_node, include=include, exclude=exclude)
    chosen = apply_replace(chosen, pool, parse_replace(replace), inventory.spares)
    return [(inventory.host(name), slots) for name, slots in chosen.items()]


def parse_replace(words: Sequence[str]) -> dict[str, str]:
    """``--replace OLD=NEW`` (or ``OLD``: the first free spare, NEW "") as ``{OLD: NEW}``."""
    out: dict[str, str] = {}
    for word in words:
        old, sep, new = word.partition("=")
        if not old or (sep and not new) or old == new:
            raise SelectionError(f"--replace {word!r}: expected OLD=NEW (two different hosts) "
                                 "or OLD (the inventory's first free spare)", key="--replace",
                                 hint="e.g. --replace node6=node8")
        if old in out or (new and new in out.values()):
            raise SelectionError(f"--replace {word!r}: {old if old in out else new} is named "
                                 "twice", key="--replace")
        out[old] = new
    return out


def apply_replace(chosen: OrderedDict[str, list[int]], pool: Mapping[str, int],
                  replace: Mapping[str, str], spares: Sequence[str] = ()
                  ) -> OrderedDict[str, list[int]]:
    """NEW takes OLD's place: its position (node index, ranks) and its slot ids, so the
    rank->node mapping is OLD's with one name changed (what a node-local checkpoint
    restored onto NEW needs). NEW must be an inventory host outside the selection with
    at least OLD's slots; no NEW: the first spare free for it."""
    replace = _pick_spares(chosen, pool, replace, spares)
    for old, new in replace.items():
        if old not in chosen:
            raise SelectionError(f"--replace {old}={new}: {old} is not among the selected hosts "
                                 f"({fold(list(chosen))})", key="--replace",
                                 hint="select the job's hosts as before (same --nodes/--include/"
                                      "--exclude) and name one of them")
        if new not in pool:
            raise SelectionError(f"--replace {old}={new}: {new} is not an inventory host",
                                 key="--replace", hint=f"add {new} to the inventory's hosts")
        if new in chosen:
            raise SelectionError(f"--replace {old}={new}: {new} is already selected",
                                 key="--replace", hint=f"leave {new} out of the selection "
                                 "(--exclude, --nodes) or pick another spare")
        if pool[new] < len(chosen[old]):
            raise SelectionError(f"--replace {old}={new}: {new} has {pool[new]} slots, {old} "
                                 f"ran {len(chosen[old])}", key="--replace",
                                 hint="a spare needs at least the slots of the node it replaces")
    return OrderedDict((replace.get(h, h), slots) for h, slots in chosen.items())


def _pick_spares(chosen: Mapping[str, list[int]], pool: Mapping[str, int],
                 replace: Mapping[str, str], spares: Sequence[str]) -> dict[str, str]:
    """``--replace OLD`` alone: the first spare (inventory order) not selected, not named
    by another replacement and with at least OLD's slots."""
    out = dict(replace)
    taken = set(out.values())
    for old, new in replace.items():
        if new:
            continue
        need = len(chosen.get(old, ()))
        free = [s for s in spares if s not in chosen and s not in taken and pool[s] >= need]
        if not free:
            raise SelectionError(f"--replace {old}: no free spare"
                                 + (f" with {need} slots" if need else ""), key="--replace",
                                 hint="list one under the inventory's spares:, or name it: "
                                      f"--replace {old}=NEW")
        out[old] = free[0]
        taken.add(free[0])
    return out


_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _single_pattern(names: list[str]) -> str | None:
    """One host pattern (``node[1-7]``) that expands to exactly ``names`` in order, or None."""
    folded = fold(names)
    try:  # "node[1-3],gpu7" expands to other names, so this also rejects several patterns
        return folded if expand(folded) == names else None
    except HostRangeError:
        return None


def _fold_runs(pool: Mapping[str, int]) -> list[tuple[list[str], int]]:
    """Consecutive hosts with the same slots that one range key can name, in file order."""
    runs: list[tuple[list[str], int]] = []
    for host, slots in pool.items():
        if runs and runs[-1][1] == slots and _single_pattern([*runs[-1][0], host]):
            runs[-1][0].append(host)
        else:
            runs.append(([host], slots))
    return runs


_PLACEHOLDERS = """\
defaults:
  # What a hostfile cannot say. Fill these in (remove the '#'), then run
  # `clusterkit inventory validate` and `clusterkit doctor`:
  # python: /opt/conda/envs/train/bin/python   # same absolute path on every node
  # workdir: /srv/train                         # where the code is (clusterkit sync puts it there)
  # checkpoint:
  #   local_dir: /scratch/ckpt                  # node-local disk
  #   shared_dir: /mnt/nfs/ckpt                 # or a directory every node sees
  # gpu_model: A800-80GB-PCIe
  # ssh:
  #   user: root                                # else ~/.ssh/config and /etc/ssh/ssh_config decide
  transport: ssh
"""


def inventory_yaml_from_hostfile(pool: Mapping[str, int], path: str = "<hostfile>", *,
                                 cpu: bool = False) -> str:
    """Inventory YAML text for an imported hostfile (hosts keep file order).

    A hostfile's ``slots=N`` are N GPUs on that host (DeepSpeed's meaning), so
    ``gpus`` is set from them unless ``cpu``. Consecutive hosts with the same slots
    fold into one range key; placeholders (commented) name what a hostfile cannot
    say. DeepSpeed accepts any non-blank name; the inventory only takes names that
    are safe as host names (they reach shells and pdsh host lists).
    """
    for host in pool:
        if not _SAFE_NAME.fullmatch(host):
            raise InventoryError(f"host name {host!r} is not a plain host name", path=path,
                                 hint="use letters, digits, '.', '-' and '_' only")
    why = ("slots are CPU ranks (--cpu): gpus 0" if cpu else
           "slots=N in a DeepSpeed hostfile means N GPUs: gpus is set from it (CPU slots: "
           "import again with --cpu)")
    lines = [f"# Imported from {path} by `clusterkit inventory import-hostfile`.", f"# {why}.",
             "schema_version: 1", *_PLACEHOLDERS.splitlines(), "hosts:"]
    for names, slots in _fold_runs(pool):
        key = _single_pattern(names) or names[0]
        lines.append(f"  {key}:")
        lines.append(f"    # address: {_address_hint(names)}   (default: the host name)")
        lines.append(f"    slots: {slots}" if cpu else f"    gpus: {slots}   # from slots={slots}")
    return "\n".join(lines) + "\n"


def _address_hint(names: list[str]) -> str:
    return f"10.0.0.[11-{10 + len(names)}]" if len(names) > 1 else "10.0.0.11"
