"""Options and helpers shared by several verbs."""

from __future__ import annotations

import argparse
from pathlib import Path

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.safety import HostfilePath, node_spec_hint
from clusterkit.errors import InventoryError
from clusterkit.fold import parse_ranks
from clusterkit.inventory import Inventory, parse_inventory
from clusterkit.jobs.here import ENV_INVENTORY, find_inventory, inventory_path, launch_facts
from clusterkit.spec.job import LaunchFacts


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


def job_facts(args: argparse.Namespace, inventory: Inventory) -> LaunchFacts:
    """The facts launch/render/sbatch plan with (``jobs.here.launch_facts``: this
    machine's, and the interface the last ``clusterkit doctor`` saved for each node)."""
    from clusterkit.cli.jobflags import program

    words = program(args)
    return launch_facts(cluster=inventory.name, script=words["script"],
                        master_addr=args.master_addr, args=words["script_args"])


def resolve_inventory(path: str | None) -> Inventory:
    """``-i``/``--hostfile``, else the chain of ``jobs.here.inventory_path``; a missing
    file that looks like a node spec says so (``-i node1,node2``)."""
    candidate = inventory_path(path)
    if isinstance(candidate, HostfilePath):  # --hostfile: DeepSpeed's host list
        return _from_hostfile(candidate)
    if candidate and not Path(candidate).exists() and (hint := node_spec_hint(candidate)):
        raise InventoryError("inventory file not found", path=candidate, key="-i", hint=hint)
    return find_inventory(candidate)


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
