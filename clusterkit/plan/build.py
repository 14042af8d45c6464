"""``plan_job``: inventory + options + facts -> :class:`JobPlan`, the decisions (pure).

Nothing is rendered here: ``render.artifacts.render_all(plan)`` turns the decisions
into files and command lines.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import PurePosixPath

from clusterkit.backend_timeouts import timeout_env
from clusterkit.errors import RenderError
from clusterkit.hostfile import select_hosts
from clusterkit.hostrange import fold, folded_lines
from clusterkit.inventory import Host, Inventory, replicas_problem
from clusterkit.launchers import BACKENDS, plan_backends
from clusterkit.node.contract import (
    DEEPSPEED_CONFIG_ARG,
    ENV_DS_CONFIG,
    Contract,
    JobDir,
    StorageKind,
)
from clusterkit.node.replicas.rules import ring
from clusterkit.plan.env import build_env
from clusterkit.plan.ifaces import added_env, apply_picks
from clusterkit.plan.profile import ProfileNode, profile_programs
from clusterkit.spec.job import (
    DS_LAUNCHERS,
    JOB_ID,
    RDZV_CHOICES,
    STORAGE_CHOICES,
    WORKLOAD_MODULE,
    JobOptions,
    JobPlan,
    LaunchFacts,
    NodePlan,
)
from clusterkit.spec.ports import master_port
from clusterkit.spec.programs import program_ds_config
from clusterkit.spec.zero import ZeroSpec, build_ds_config, resolve_precision

MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
JOBS_SUBDIR = ".clusterkit/jobs"


def _choice(value: str, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        raise RenderError(f"{key} must be one of {', '.join(choices)}, got {value!r}", key=key)


def _check_options(o: JobOptions) -> None:
    if not JOB_ID.fullmatch(o.job_id):
        raise RenderError(f"job id {o.job_id!r} is not a plain name", key="--job-id",
                          hint="use up to 64 letters, digits, '.', '_' and '-' (it names "
                               "directories and reaches shells)")
    _choice(o.backend, plan_backends(), "--launcher")
    _choice(o.storage, STORAGE_CHOICES, "--storage")
    _choice(o.rdzv, RDZV_CHOICES, "--rdzv")
    _choice(o.deepspeed_launcher, DS_LAUNCHERS, "--deepspeed-launcher")
    if o.script is not None and o.module is not None:
        raise RenderError("give a script or a module, not both", key="--module")
    if o.module is not None and not MODULE.fullmatch(o.module):
        raise RenderError(f"--module {o.module!r} is not a Python module name", key="--module",
                          hint="use dotted identifiers, e.g. mypkg.train")
    if o.script is not None and (not o.script or o.script.startswith("-") or "\n" in o.script):
        # A leading dash would be read as an option by every launcher.
        raise RenderError(f"SCRIPT {o.script!r} is not a script path", key="SCRIPT",
                          hint="give the path of a Python file, e.g. ./train.py")
    for key, value, minimum in (("--steps", o.steps, 1), ("--max-restarts", o.max_restarts, 0),
                                ("--save-every", o.save_every, 0)):
        if value < minimum:
            raise RenderError(f"{key} must be >= {minimum}, got {value}", key=key)
    if o.replicas is not None and (why := replicas_problem(o.replicas)):
        raise RenderError(why, key="--replicas")
    if o.hang_timeout_s < 0:
        raise RenderError(f"must be >= 0 (0: off), got {o.hang_timeout_s:g}",
                          key="--hang-timeout")
    if o.ckpt_dir is not None and o.storage == "auto":
        raise RenderError("--ckpt-dir needs --storage shared or --storage node-local", key="--ckpt-dir",
                          hint="say whether every node sees the directory (shared) or each has its own")


def _abs_path(path: str, key: str, host: str | None = None) -> str:
    """Paths reach argv and files verbatim: no ``~`` (nothing would expand it), absolute only."""
    if path.startswith("~") or not PurePosixPath(path).is_absolute():
        raise RenderError(f"{key} {path!r} must be an absolute path", key=key, host=host,
                          hint="clusterkit passes paths as literal arguments; write the full path")
    return path.rstrip("/") or "/"


def _storage(hosts: list[Host], o: JobOptions, inv_path: str | None) -> str:
    if o.storage != "auto":
        return o.storage
    if all(h.checkpoint.shared_dir for h in hosts):
        return "shared"
    if all(h.checkpoint.local_dir for h in hosts):
        return StorageKind.NODE_LOCAL.value
    raise RenderError("no checkpoint directory is configured for every selected host",
                      path=inv_path, key="checkpoint",
                      hint="add checkpoint: {shared_dir: ...} or {local_dir: ...} under defaults "
                           "in the inventory, or pass --storage and --ckpt-dir")


def _ckpt_dir(host: Host, storage: str, o: JobOptions, inv_path: str | None) -> str:
    """``<configured root>/<job_id>``: one directory per job, so a new job never resumes
    another's checkpoint; launching again with the same ``--job-id`` continues that job."""
    return f"{_ckpt_root(host, storage, o, inv_path).rstrip('/')}/{o.job_id}"


def _ckpt_root(host: Host, storage: str, o: JobOptions, inv_path: str | None) -> str:
    if o.ckpt_dir is not None:
        return _abs_path(o.ckpt_dir, "--ckpt-dir")
    key = "shared_dir" if storage == "shared" else "local_dir"
    value = getattr(host.checkpoint, key)
    if not value:
        other = StorageKind.NODE_LOCAL.value if storage == "shared" else "shared"
        raise RenderError(f"--storage {storage} but checkpoint.{key} is not set for this host",
                          host=host.name, path=inv_path, key=f"checkpoint.{key}",
                          hint=f"set checkpoint.{key} in the inventory, pass --ckpt-dir, "
                               f"or use --storage {other}")
    return _abs_path(str(value), f"checkpoint.{key}", host.name)


def _program(o: JobOptions, job_dir: str, ckpt_dir: str, storage: str) -> tuple[str, ...]:
    # --deepspeed-config-arg: DeepSpeed's own convention, after the user's arguments
    ds_args = Contract(o.job_id, job_dir, ckpt_dir, storage).deepspeed_args() \
        if o.deepspeed_config_arg else ()
    if o.script is not None:
        return (o.script, *o.script_args, *ds_args)
    if o.module is not None:
        return ("-m", o.module, *o.script_args, *ds_args)
    words = ["-m", WORKLOAD_MODULE,
             "--engine", BACKENDS[o.backend].engine,
             "--model", o.model, "--steps", str(o.steps),
             "--ds-config", JobDir(job_dir).ds_config, "--run-dir", JobDir(job_dir).run_dir,
             "--ckpt-dir", ckpt_dir, "--storage", storage]
    if o.save_every:
        words += ["--save-every", str(o.save_every)]
    if o.save_16bit:
        words.append("--save-16bit")
    return (*words, *o.script_args)


def _node_plans(inventory: Inventory, o: JobOptions,
                facts: LaunchFacts) -> tuple[tuple[NodePlan, ...], str]:
    chosen = select_hosts(inventory, nodes=o.nodes, gpus_per_node=o.gpus_per_node,
                          include=o.include, exclude=o.exclude, replace=o.replace)
    storage = _storage([h for h, _ in chosen], o, inventory.path)
    nodes: list[NodePlan] = []
    first_rank = 0
    for index, (host, slots) in enumerate(chosen):
        python = _abs_path(host.python or facts.python, "python", host.name)
        workdir = _abs_path(host.workdir or facts.cwd, "workdir", host.name)
        job_dir = f"{workdir}/{JOBS_SUBDIR}/{o.job_id}"
        ckpt_dir = _ckpt_dir(host, storage, o, inventory.path)
        # The user-script contract (node/contract.py, Contract) rides in the node env, so every
        # backend delivers it: agent, torchrun, .deepspeed_env, accelerate, sbatch exports.
        contract = Contract(job_id=o.job_id, job_dir=job_dir, ckpt_dir=ckpt_dir, storage=storage)
        env = build_env(python=python, environ=facts.environ, host_env=host.env,
                        host_allowlist=host.env_allowlist, user_allowlist=o.env_allowlist,
                        set_env=(*_hang_env(o, host, job_dir), *o.set_env,
                                 *contract.env().items()),
                        cuda_lib_dirs=facts.cuda_lib_dirs, job_id=o.job_id,
                        gpu=host.gpus > 0)
        nodes.append(NodePlan(node_rank=index, host=host, slots=tuple(slots), first_rank=first_rank,
                              python=python, workdir=workdir, job_dir=job_dir,
                              ckpt_dir=ckpt_dir, env=env))
        first_rank += len(slots)
    return tuple(nodes), storage


def _hang_env(o: JobOptions, host: Host, job_dir: str) -> list[tuple[str, str]]:
    """Backend timeouts matched to the hang timeout (issue 14); the inventory's env wins."""
    env = timeout_env(o.hang_timeout_s, gpu=host.gpus > 0, job_dir=job_dir)
    return [(k, v) for k, v in env.items() if k not in host.env]


def _zero_spec(o: JobOptions, nodes: tuple[NodePlan, ...], world: int, storage: str) -> ZeroSpec:
    cpu = [n.name for n in nodes if n.host.gpus == 0]
    precision = resolve_precision(o.precision, not cpu, f"{fold(cpu)}'s ranks (gpus: 0)")
    on_gpu = not cpu
    nvme = o.nvme_path
    local = nodes[0].host.checkpoint.local_dir
    if nvme is None and "nvme" in (o.offload_optimizer, o.offload_param) and local:
        nvme = f"{local}/nvme-offload"  # NVMe offload wants a node-local disk
    run_dir = JobDir(nodes[0].job_dir).run_dir
    return ZeroSpec(
        stage=o.zero_stage, offload_optimizer=o.offload_optimizer,  # type: ignore[arg-type]
        offload_param=o.offload_param, nvme_path=nvme,  # type: ignore[arg-type]
        precision=precision,
        micro_batch=o.micro_batch, grad_accum=o.grad_accum, world_size=world, clip=o.clip,
        lr=o.lr, warmup_steps=o.warmup_steps, total_steps=o.steps,
        torch_adam=not on_gpu, node_local_checkpoints=storage == StorageKind.NODE_LOCAL,
        gather_16bit_on_save=o.save_16bit, csv_monitor_dir=f"{run_dir}/monitor",
        tensorboard_dir=f"{run_dir}/tensorboard" if o.tensorboard else None,
        monitor_job_name=o.job_id)


def _gpu_warnings(o: JobOptions, nodes: tuple[NodePlan, ...]) -> tuple[str, ...]:
    """Ranks that will not get a GPU of their own, though the job looks like a GPU job.

    One warning per distinct case, its hosts folded (``node[1-32]: ...``): 32 CPU hosts
    asked for GPU ranks are one line, not 32."""
    pairs = []
    for n in nodes:
        if n.host.gpus > 0 and n.nproc > n.host.gpus:
            pairs.append((n.name, f"{n.nproc} ranks but gpus: {n.host.gpus} in the inventory; "
                                  "ranks would share GPUs (set slots/--gpus-per-node to at most "
                                  "gpus)"))
        elif n.host.gpus == 0 and (o.gpus_per_node or 0) > 0 and n.host.transport != "local":
            # --gpus-per-node asks for GPU ranks; a CPU host runs them on the CPU. Virtual
            # nodes on this machine (the embedded default) are CPU ranks by design.
            pairs.append((n.name, f"--gpus-per-node {o.gpus_per_node} but gpus: 0 in the "
                                  f"inventory; its {n.nproc} ranks run on the CPU (set gpus: N "
                                  "in the inventory, or leave out --gpus-per-node for a CPU job)"))
    return tuple(folded_lines(pairs, order=[n.name for n in nodes]))


def _script_warnings(o: JobOptions, text: str | None) -> tuple[str, ...]:
    """A script that takes its DeepSpeed config DeepSpeed's way and would get none.

    Seen as a user: ``deepspeed.add_config_arguments(parser)`` + ``initialize(args=...)``
    failed on every rank with "DeepSpeed requires --deepspeed_config". A script that
    names $CLUSTERKIT_DS_CONFIG (docs/examples/train.py) knows where ours is."""
    if o.script is None or text is None or o.deepspeed_config_arg or ENV_DS_CONFIG in text:
        return ()
    if any(a.split("=", 1)[0] == DEEPSPEED_CONFIG_ARG for a in o.script_args):
        return ()  # the user passes a config of their own
    if "add_config_arguments" not in text and DEEPSPEED_CONFIG_ARG not in text:
        return ()
    return (f"{o.script} takes {DEEPSPEED_CONFIG_ARG} (DeepSpeed's convention) but would get "
            f"none: add --deepspeed-config-arg, or read ${ENV_DS_CONFIG} in the script",)


def _replica_count(o: JobOptions, nodes: tuple[NodePlan, ...], storage: str) -> int:
    """K: ``--replicas``, else the inventory's ``checkpoint.replicas`` (node 0's host:
    one number a job), else 1 with node-local storage; 0 where agents cannot copy."""
    asked = o.replicas if o.replicas is not None else nodes[0].host.checkpoint.replicas
    if not BACKENDS[o.backend].launchable:
        if o.replicas:
            raise RenderError(f"--replicas {o.replicas}: checkpoint replicas are copied by "
                              f"clusterkit launch's node agents, which the {o.backend!r} "
                              "backend does not run", key="--replicas",
                              hint="use clusterkit launch, or drop --replicas")
        return 0
    if storage != StorageKind.NODE_LOCAL:
        return 0
    return 1 if asked is None else asked


def _placement(o: JobOptions, nodes: tuple[NodePlan, ...],
               storage: str) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """Where each node's checkpoint copies go, and the warnings: node i's to the next K
    nodes in plan order (a ring), skipping a node on the same host name or address as i
    or as a target already chosen (one lost machine must not take a checkpoint and its
    copy): ``node/replicas/rules.ring``, the rule a Slurm job's nodes place theirs by. The
    default K (1) places silently what it can; a K the user asked for warns."""
    k = _replica_count(o, nodes, storage)
    asked = o.replicas is not None or nodes[0].host.checkpoint.replicas is not None
    if o.replicas and (storage != StorageKind.NODE_LOCAL or len(nodes) < 2):
        why = f"{storage} storage" if storage != StorageKind.NODE_LOCAL else "one node"
        return (), (f"--replicas {o.replicas}: no checkpoint replicas with {why} (they copy "
                    "node-local checkpoints to other nodes)",)
    if k == 0 or len(nodes) < 2:
        return (), ()
    targets: list[tuple[int, ...]] = []
    short: list[tuple[str, str]] = []
    identities = [(n.host.name, n.host.address) for n in nodes]
    for i, node in enumerate(nodes):
        chosen = ring(i, identities, k)  # the one placement rule (node/replicas/rules.py)
        targets.append(tuple(chosen))
        if len(chosen) < k and asked:
            short.append((node.name, f"{len(chosen)} of {k} checkpoint replicas placed (the "
                                     "other nodes share its host or address)"))
    warnings = tuple(folded_lines(short, order=[n.name for n in nodes]))
    return (tuple(targets) if any(targets) else ()), warnings


def _strict(o: JobOptions, warnings: tuple[str, ...], inv_path: str | None) -> None:
    if o.strict and warnings:
        raise RenderError(f"--strict: {warnings[0]}" + (f" (and {len(warnings) - 1} more)"
                                                         if len(warnings) > 1 else ""),
                          key="--strict", path=inv_path,
                          hint="do what the warning says, or drop --strict")


def plan_job(inventory: Inventory, options: JobOptions, facts: LaunchFacts) -> JobPlan:
    """Decide everything about a job: hosts, ranks, port, env, storage, ZeRO, programs.

    Pure: the same inputs give the same plan (and, through ``render_all``, the same
    bytes in every artifact). Raises :class:`RenderError`/:class:`SelectionError` for
    anything that cannot launch.
    """
    _check_options(options)
    given = inventory
    inventory = apply_picks(inventory, facts.doctor_ifaces, facts.environ)
    nodes, storage = _node_plans(inventory, options, facts)
    added = added_env(given, inventory)
    world = sum(n.nproc for n in nodes)
    replica_targets, replica_warnings = _placement(options, nodes, storage)
    # The program's profile (issue 38): what node-local storage adds to its arguments.
    prof = profile_programs(options, facts, storage,
                            [ProfileNode(n.name, n.job_dir, n.ckpt_dir, cpu=n.host.gpus == 0,
                                         pythonpath=n.env.get("PYTHONPATH")) for n in nodes],
                            lambda o, jd, cd: _program(o, jd, cd, storage))
    if prof.env:  # its library pointed at a node-local config, or its CPU hook
        nodes = tuple(dataclasses.replace(n, env={**n.env, **e})
                      for n, e in zip(nodes, prof.env, strict=True))
    warnings = _gpu_warnings(options, nodes) + _script_warnings(options, facts.script_text) \
        + replica_warnings + prof.warnings
    _strict(options, warnings, inventory.path)
    zero = _zero_spec(options, nodes, world, storage)
    return JobPlan(options=options, cluster=inventory.name, nodes=nodes, world_size=world,
                   master_addr=facts.master_addr or nodes[0].host.address,
                   master_port=master_port(options.job_id), storage=storage, zero=zero,
                   ds_config=program_ds_config(prof.choice.profile, build_ds_config(zero)),
                   programs=prof.programs, profile=prof.choice, program_files=prof.files,
                   warnings=warnings,
                   doctor_ifaces={n.name: added[n.name] for n in nodes if n.name in added},
                   replica_targets=replica_targets)
