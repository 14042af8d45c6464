"""Shared inputs for the render tests: the three reference inventories, fixed facts."""

from __future__ import annotations

from pathlib import Path

from clusterkit.inventory import Inventory, load_inventory, local_inventory
from clusterkit.launchers import plan_backends
from clusterkit.plan.build import plan_job
from clusterkit.render.artifacts import render_all
from clusterkit.spec.job import JobOptions, LaunchFacts, LaunchPlan

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = plan_backends()  # every plan backend of the registry
INVENTORIES = ("a800-7x2", "h100-2x8-ib", "local")
# A launcher environment with things that must and must not travel.
ENVIRON = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "NCCL_DEBUG": "WARN",
    "NCCL_IB_TIMEOUT": "22",
    "HF_HUB_OFFLINE": "1",
    "HF_TOKEN": "hf_secret",
    "NCCL_SECRET_KEY": "glob-must-not-take-it",
    "WANDB_PROJECT": "lm",
    "WANDB_API_KEY": "wandb-secret",
    "HOME": "/home/me",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
}
FACTS = LaunchFacts(python="/opt/py/bin/python3", cwd="/home/me/proj", environ=ENVIRON)


def inventory(name: str) -> Inventory:
    if name == "local":
        return local_inventory("/home/me/.cache/clusterkit/local")
    return load_inventory(ROOT / "hostfiles" / f"{name}.yaml")


def plan_for(name: str, backend: str, **kw: object) -> LaunchPlan:
    options = JobOptions(job_id=f"golden-{name}", backend=backend, **kw)  # type: ignore[arg-type]
    return render_all(plan_job(inventory(name), options, FACTS))
