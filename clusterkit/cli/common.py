"""Options and helpers shared by several verbs."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.safety import HostfilePath, node_spec_hint
from clusterkit.errors import ClusterkitError, InventoryError
from clusterkit.fold import parse_ranks
from clusterkit.inventory import Inventory, load_inventory, local_inventory, parse_inventory
from clusterkit.spec.job import LaunchFacts

ENV_INVENTORY = "CLUSTERKIT_INVENTORY"


def add_inventory_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-i", "--inventory", metavar="FILE", type=nonempty,
        help=f"inventory YAML (default: ${ENV_INVENTORY}, else ./clusterkit.yaml, "
        "else the embedded local default)",
    )


def add_selection_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("host selection (DeepSpeed semantics)")
    g.add_argument("--nodes", type=int, metavar="N", help="the first N hosts in inventory order")
    g.add_argument("--gpus-per-node", type=int, metavar="G", help="ranks per node")
    g.add_argument("--include", default="", metavar="SPEC", help="NAME[:SLOT[,SLOT]][@...]")
    g.add_argument("--exclude", default="", metavar="SPEC", help="NAME[:SLOT[,SLOT]][@...]")


def add_ranks_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--ranks``: whose lines stream to the folded console (launch, sbatch --watch)."""
    parser.add_argument("--ranks", type=_rank_selection, default=None, metavar="all|N|N-M",
                        help="whose lines stream to the console (default all; identical lines "
                             "from several ranks print once as [r0-13]; the log files keep "
                             "every line)")


def _rank_selection(text: str) -> frozenset[int] | None:
    try:
        return parse_ranks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_ranks(ranks: frozenset[int] | None, world_size: int) -> None:
    """``--ranks`` against the job's size, once it is known (the parser cannot know it):
    a selection naming no rank of the job would show nothing, silently."""
    beyond = sorted(r for r in ranks or () if r >= world_size)
    if beyond:
        raise ClusterkitError(f"rank {beyond[0]} is not in this job: it has ranks 0-"
                              f"{world_size - 1}", key="--ranks",
                              hint=f"choose ranks below {world_size}, or all")


def clusterkit_home() -> Path:
    """Where the embedded default keeps its virtual nodes' disks and job dirs."""
    env = os.environ.get("CLUSTERKIT_HOME")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "clusterkit"


def job_facts(args: argparse.Namespace, inventory: Inventory) -> LaunchFacts:
    """The facts launch/render/sbatch plan with: the launching machine's
    (``jobflags.launch_facts``) and the interface the last ``clusterkit doctor`` saved
    for each node (checks/netpick.py), which the plan turns into NCCL_SOCKET_IFNAME==IF
    and GLOO_SOCKET_IFNAME=IF where neither the inventory nor this shell sets them
    (plan/ifaces.py; plan.json and the dry run show what it set)."""
    from clusterkit.checks.netpick import saved_picks
    from clusterkit.cli.jobflags import launch_facts

    return replace(launch_facts(args),
                   doctor_ifaces=saved_picks(clusterkit_home(), inventory.name))


def resolve_inventory(path: str | None) -> Inventory:
    candidate = path or os.environ.get(ENV_INVENTORY)
    if not candidate and Path("clusterkit.yaml").is_file():
        candidate = "clusterkit.yaml"
    if isinstance(candidate, HostfilePath):  # --hostfile: DeepSpeed's host list
        return _from_hostfile(candidate)
    if candidate:
        if not Path(candidate).exists() and (hint := node_spec_hint(candidate)):
            raise InventoryError("inventory file not found", path=candidate, key="-i",
                                 hint=hint)
        return load_inventory(candidate)
    return local_inventory(str(clusterkit_home() / "local"))


def _from_hostfile(path: str) -> Inventory:
    """``--hostfile FILE``: the hosts and slots of a DeepSpeed hostfile, as
    ``clusterkit inventory import-hostfile`` reads them (addresses = host names)."""
    from clusterkit.hostfile import inventory_yaml_from_hostfile, parse_hostfile

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InventoryError(f"cannot read the hostfile: {e.strerror}", path=path,
                             key="--hostfile") from None
    return parse_inventory(inventory_yaml_from_hostfile(parse_hostfile(text, path), path), path)
