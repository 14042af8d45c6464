"""This machine as clusterkit sees it: its home, the inventory it picks, the launch facts.

Every verb and the Python API (clusterkit/api.py) read these from here, so a job
launched from a notebook and one launched from the shell land in the same registry
(``<home>/jobs``), plan on the same inventory and carry the same facts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from clusterkit.inventory import Inventory, load_inventory, local_inventory
from clusterkit.spec.job import LaunchFacts
from clusterkit.spec.programs import PROFILES

ENV_HOME = "CLUSTERKIT_HOME"
ENV_INVENTORY = "CLUSTERKIT_INVENTORY"
DEFAULT_INVENTORY_FILE = "clusterkit.yaml"  # in the current directory


def clusterkit_home() -> Path:
    """Where the job registry and the embedded default's virtual nodes (disks, job dirs)
    live: ``$CLUSTERKIT_HOME``, else ``$XDG_CACHE_HOME/clusterkit`` (``~/.cache``)."""
    env = os.environ.get(ENV_HOME)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "clusterkit"


def inventory_path(path: str | None) -> str | None:
    """The inventory file to read: ``path``, else ``$CLUSTERKIT_INVENTORY``, else
    ``./clusterkit.yaml`` when there is one; None: the embedded local default."""
    candidate = path or os.environ.get(ENV_INVENTORY)
    if not candidate and Path(DEFAULT_INVENTORY_FILE).is_file():
        candidate = DEFAULT_INVENTORY_FILE
    return candidate or None


def find_inventory(path: str | None = None) -> Inventory:
    """The inventory at :func:`inventory_path`, or the embedded default (virtual nodes
    on this machine under ``<home>/local``)."""
    candidate = inventory_path(path)
    if candidate:
        return load_inventory(candidate)
    return local_inventory(str(clusterkit_home() / "local"))


def launch_facts(*, cluster: str, script: str | None = None,
                 master_addr: str | None = None, args: Sequence[str] = ()) -> LaunchFacts:
    """The only look at the launching machine (the plan never probes): its Python, cwd
    and environment, ``master_addr``, the user's script as it is here (its first MiB,
    when the path exists here), and the interface the last ``clusterkit doctor`` saved
    for each node of ``cluster`` (checks/netpick.py), which the plan turns into
    NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME where nothing else sets them; and the
    DeepSpeed config files the program's ``args`` name (``--deepspeed FILE``,
    ``--deepspeed_config FILE``), as they are here: on node-local storage the plan
    derives a copy with what node-local needs (spec/programs.py)."""
    from clusterkit.checks.netpick import saved_picks

    cwd = os.getcwd()
    return LaunchFacts(python=sys.executable, cwd=cwd, environ=dict(os.environ),
                       master_addr=master_addr, script_text=_read_script(script, cwd),
                       doctor_ifaces=saved_picks(clusterkit_home(), cluster),
                       program_files=_config_files(args, cwd))


def _config_files(args: Sequence[str], cwd: str) -> dict[str, str]:
    """path as the args give it -> its text, for each DeepSpeed config file the program's
    arguments name and this machine can read (the profiles' ``config_args``)."""
    flags = {f for p in PROFILES.values() for f in p.config_args}
    out: dict[str, str] = {}
    for i, word in enumerate(args):
        name, eq, value = word.partition("=")
        if name not in flags:
            continue
        path = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        text = _read_script(path, cwd) if path and not path.startswith("-") else None
        if text is not None:
            out[path] = text
    return out


def _read_script(script: str | None, cwd: str) -> str | None:
    """The script's first MiB, if it is here (with a node-only path it is not)."""
    if script is None:
        return None
    try:
        with open(os.path.join(cwd, script), encoding="utf-8", errors="replace") as fh:
            return fh.read(1 << 20)
    except OSError:
        return None
