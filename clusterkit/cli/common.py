"""Options and helpers shared by several verbs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from clusterkit.inventory import Inventory, load_inventory, local_inventory

ENV_INVENTORY = "CLUSTERKIT_INVENTORY"


def add_inventory_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-i", "--inventory", metavar="FILE",
        help=f"inventory YAML (default: ${ENV_INVENTORY}, else ./clusterkit.yaml, "
        "else the embedded local default)",
    )


def add_selection_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("host selection (DeepSpeed semantics)")
    g.add_argument("--nodes", type=int, metavar="N", help="the first N hosts in inventory order")
    g.add_argument("--gpus-per-node", type=int, metavar="G", help="ranks per node")
    g.add_argument("--include", default="", metavar="SPEC", help="NAME[:SLOT[,SLOT]][@...]")
    g.add_argument("--exclude", default="", metavar="SPEC", help="NAME[:SLOT[,SLOT]][@...]")


def clusterkit_home() -> Path:
    """Where the embedded default keeps its virtual nodes' disks and job dirs."""
    env = os.environ.get("CLUSTERKIT_HOME")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "clusterkit"


def resolve_inventory(path: str | None) -> Inventory:
    candidate = path or os.environ.get(ENV_INVENTORY)
    if not candidate and Path("clusterkit.yaml").is_file():
        candidate = "clusterkit.yaml"
    if candidate:
        return load_inventory(candidate)
    return local_inventory(str(clusterkit_home() / "local"))
