"""clusterkit plan: the memory advisor — which ZeRO strategy fits this cluster?"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from clusterkit.cli.common import add_inventory_option, add_selection_options, resolve_inventory
from clusterkit.errors import ClusterkitError
from clusterkit.spec.job import MODEL_NAMES
from clusterkit.units import size_type

MODELS = MODEL_NAMES  # the bundled workload presets (spec.job)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan", help="memory advisor: which ZeRO stage/offload fits, fastest first",
        description="Estimate per-GPU and per-node CPU memory of the model states for DDP, "
        "ZeRO-1/2/3 and CPU offload (DeepSpeed's own estimators) and recommend the fastest "
        "strategy that fits. Nodes and GPUs come from the flags, else from the inventory.",
    )
    add_inventory_option(p)
    add_selection_options(p)
    p.add_argument("--model", choices=MODELS, default="small", help="workload model preset")
    p.add_argument("--gpu-mem", required=True, metavar="SIZE", type=size_type("--gpu-mem", 1),
                   help="memory per GPU, e.g. 80G (= 80GiB; 80GB is 80*10^9; docs/units.md)")
    p.add_argument("--cpu-mem", metavar="SIZE", type=size_type("--cpu-mem", 1),
                   help="RAM per node, e.g. 512G (else not checked)")
    p.add_argument("--gpu-fraction", type=float, default=0.75,
                   help="share of GPU memory model states may use (rest: activations)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)


def _shape(args: argparse.Namespace) -> tuple[int, int]:
    """--nodes/--gpus-per-node when given; otherwise the selected inventory hosts."""
    if args.nodes is not None and args.gpus_per_node is not None:
        return args.nodes, args.gpus_per_node
    from clusterkit.hostfile import select_hosts

    chosen = select_hosts(resolve_inventory(args.inventory), nodes=args.nodes,
                          gpus_per_node=args.gpus_per_node, include=args.include,
                          exclude=args.exclude)
    return len(chosen), min(len(slots) for _, slots in chosen)


def cmd_plan(args: argparse.Namespace) -> int:
    # The advisor imports DeepSpeed's estimators; keep that out of CLI start-up.
    from clusterkit.workload.advisor import advise, format_table

    nodes, gpus = _shape(args)
    try:
        advice = advise(args.model, nodes=nodes, gpus_per_node=gpus,
                        gpu_mem_bytes=args.gpu_mem, cpu_mem_bytes_per_node=args.cpu_mem,
                        gpu_fraction=args.gpu_fraction)
    except ImportError as e:  # the estimators are DeepSpeed's own: one line, not exit 70
        raise ClusterkitError(f"needs DeepSpeed's memory estimators, but {e.name or e} cannot "
                              "be imported by this Python", key="deepspeed",
                              hint="install deepspeed (and torch) into the Python that runs "
                                   "clusterkit") from None
    if args.json:
        print(json.dumps(asdict(advice), indent=2))
    else:
        print(format_table(advice))
    return 0 if advice.recommended is not None else 2
