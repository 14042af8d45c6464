"""The job flags and the program of ``launch``, ``render`` and ``sbatch``, from the job spec.

Every :class:`~clusterkit.spec.job.JobOptions` field declared with ``flag(...)`` becomes
one ``--flag`` here, with the field's type, default, choices and help; ``--launcher``
comes from the backend registry. The program is the same words in every verb
(:func:`add_program`): ``[-m MODULE] [SCRIPT] [ARGS...]``. The three verbs call
:func:`add_job_flags`, :func:`add_program` and :func:`job_options`, so their job flags
and program syntax cannot drift apart (tests/unit/test_jobflags.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
from collections.abc import Callable
from datetime import datetime
from typing import Any

from clusterkit.cli.argparser import nonempty
from clusterkit.cli.safety import SCRIPT_DESTS, NotForThisVerb
from clusterkit.errors import ClusterkitError
from clusterkit.inventory import ADDRESS  # the inventory's own address rule
from clusterkit.launchers import BACKENDS, DEFAULT_LAUNCHER, launchers_help
from clusterkit.spec.job import JOB_ID, JobOptions, RunOptions, default_job_id
from clusterkit.units import duration_type

# Flags that are not JobOptions fields one to one (the verb maps them).
LAUNCHER_DEST = "launcher"
LAUNCHER_GIVEN = "_launcher_given"  # set by --launcher when typed
SCRIPT_OPTION = "script_option"  # --script PATH, the deprecated spelling of SCRIPT
_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float}
# Job flag groups (spec/job.py) a training script commonly has flags of its own for
# (--steps, --lr, --micro-batch, --save-every, ...): after SCRIPT these words are the
# script's; every other flag of the verb is launch control there and refused
# (cli/safety.py). `-m`/`--script` after SCRIPT are the script's too.
SCRIPT_GROUPS: tuple[str, ...] = ("workload and ZeRO",)
# Job flag groups only `clusterkit sbatch` uses: the other verbs recognise them and refuse
# them with "only for clusterkit sbatch" (render writes sbatch.sh from the same flags,
# so it takes them as sbatch does).
SLURM_GROUP = "Slurm"


def job_fields() -> list[dataclasses.Field[Any]]:
    """The JobOptions fields that are job flags, in declaration order."""
    return [f for f in dataclasses.fields(JobOptions) if "flag" in f.metadata]


def run_fields() -> list[dataclasses.Field[Any]]:
    """The RunOptions fields: ``launch``'s runtime flags, in declaration order."""
    return [f for f in dataclasses.fields(RunOptions) if "flag" in f.metadata]


def add_run_flags(p: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """``launch``'s runtime flags (``--grace``, ``--keepalive-timeout``, ...) from
    :class:`RunOptions`; returns the groups made, for the verb's own flags."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in run_fields():
        name = f.metadata["group"]
        if name not in groups:
            groups[name] = p.add_argument_group(name)
        _add(groups[name], f)
    return groups


def run_options(args: argparse.Namespace) -> RunOptions:
    """RunOptions from the parsed runtime flags."""
    return RunOptions(**{f.name: getattr(args, f.name) for f in run_fields()})


def flag_name(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata["flag"] or "--" + f.name.replace("_", "-"))


def _value_type(f: dataclasses.Field[Any]) -> Callable[[str], Any]:
    # Fields in seconds end in _s (hang_timeout_s): the one duration rule (docs/units.md).
    if f.name.endswith("_s"):
        return duration_type(flag_name(f))
    # Annotations are strings here (from __future__ import annotations): "int | None" -> int.
    return _TYPES.get(str(f.type).split(" |")[0], nonempty)  # text: a path, a partition


def script_dests() -> frozenset[str]:
    """Dests that are a script's own words after SCRIPT (see ``SCRIPT_GROUPS``)."""
    return frozenset({f.name for f in job_fields() if f.metadata["group"] in SCRIPT_GROUPS}
                     | {"module", SCRIPT_OPTION})


def job_id_type(text: str) -> str:
    """``--job-id``/JOB: a plain name (it names directories and reaches shells)."""
    if not JOB_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a job id: use 1-64 letters, digits, '.', '_' and '-', "
            "starting with a letter or digit")
    return text


def address_type(text: str) -> str:
    """``--master-addr``: a host name or an IP address, as the inventory's ``address``."""
    try:
        ipaddress.ip_address(text)  # also ::1, which the name rule's first letter refuses
        return text
    except ValueError:
        pass
    if not ADDRESS.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a host name or IP address")
    return text


def _add(group: argparse._ArgumentGroup, f: dataclasses.Field[Any]) -> None:
    meta = f.metadata
    kw: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
    if meta["metavar"]:
        kw["metavar"] = meta["metavar"]
    kind = meta["kind"]
    if kind in ("switch", "negate"):
        kw.update(action="store_true" if kind == "switch" else "store_false", default=f.default)
    elif kind == "repeat":
        kw.update(action="append", default=[])
    else:
        default = meta["cli_default"]
        kw.update(type=_value_type(f), default=default)
        if meta["choices"]:
            kw["choices"] = meta["choices"]
        if default is not None:
            kw["help"] = f"{meta['help']} (default {default:g})" if isinstance(default, float) \
                else f"{meta['help']} (default {default})"
    group.add_argument(flag_name(f), **kw)


class _StoreLauncher(argparse.Action):
    """``--launcher X`` that also records that it was typed: every verb shares one default
    (``native``), and ``sbatch`` must tell the default from an explicit ``native``, which
    has no Slurm variant of its own (:func:`launcher_given`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, LAUNCHER_GIVEN, True)


def launcher_given(args: argparse.Namespace) -> bool:
    """Whether ``--launcher`` was on the command line (not the shared default)."""
    return bool(getattr(args, LAUNCHER_GIVEN, False))


def add_job_flags(p: argparse.ArgumentParser, *, slurm: bool = True) -> None:
    """The shared job flags, grouped as the spec groups them. ``slurm=False`` (launch):
    the Slurm group's flags are refused with "only for clusterkit sbatch"."""
    j = p.add_argument_group("job")
    j.add_argument("--launcher", dest=LAUNCHER_DEST, choices=tuple(BACKENDS),
                   action=_StoreLauncher, default=DEFAULT_LAUNCHER,
                   help=f"default {DEFAULT_LAUNCHER}. {launchers_help()}")
    j.add_argument("--job-id", metavar="JOB", type=job_id_type,
                   help="default: <cluster>-<date>-<time>; the checkpoint dir is <root>/JOB, so "
                        "launching with a previous job's id continues that job")
    j.add_argument("--master-addr", metavar="ADDR", type=address_type,
                   help="node 0's address on the network the nodes share (default: its "
                        "inventory address)")
    groups: dict[str, argparse._ArgumentGroup] = {"job": j}
    for f in job_fields():
        name = f.metadata["group"]
        if name == SLURM_GROUP and not slurm:
            p.add_argument(flag_name(f), dest=f.name, action=NotForThisVerb,
                           where="clusterkit sbatch", default=f.metadata["cli_default"])
            continue
        if name not in groups:
            groups[name] = p.add_argument_group(name)
        _add(groups[name], f)


def _set_env(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ClusterkitError(f"--set-env {item!r} needs NAME=VALUE", key="--set-env")
        out.append((name, value))
    return tuple(out)


def add_program(p: argparse.ArgumentParser) -> None:
    """``[-m MODULE] [SCRIPT] [ARGS...]``, last on the command line. clusterkit's flags go
    before SCRIPT; after it they are refused (cli/safety.py) unless they follow ``--``,
    which passes the rest to the program verbatim."""
    g = p.add_argument_group("the program (default: the bundled workload)")
    p.set_defaults(**{SCRIPT_DESTS: script_dests()})  # what safety lets through after SCRIPT
    g.add_argument("--module", "-m", dest="module", metavar="MODULE",
                   help="run python -m MODULE; the words after it are its arguments")
    # Deprecated spelling of SCRIPT (render and sbatch took it): same meaning, no warning.
    g.add_argument("--script", dest=SCRIPT_OPTION, metavar="PATH", help=argparse.SUPPRESS)
    g.add_argument("program", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]",
                   help="your training script and its arguments (to pass one of clusterkit's "
                        "flags to it: SCRIPT -- ARGS); `-- ARGS` with no script: arguments "
                        "for the bundled workload")


def program(args: argparse.Namespace) -> dict[str, Any]:
    """JobOptions' script/module/script_args from the program words.

    A leading ``--`` means "the rest is the program"; followed by a flag (``-- --steps
    5``) there is no script and the words go to the bundled workload (a script never
    starts with ``-``). With ``-m``/``--script`` every word is an argument.
    """
    words = list(args.program)
    lead = words[:1] == ["--"]
    words = words[1:] if lead else words
    script = getattr(args, SCRIPT_OPTION)
    if args.module or script or not words or (lead and words[0].startswith("-")):
        return {"script": script, "module": args.module, "script_args": tuple(words)}
    return {"script": words[0], "module": None, "script_args": tuple(words[1:])}


def job_options(args: argparse.Namespace, *, job_id: str) -> JobOptions:
    """JobOptions from the parsed job flags and program.

    The plan backend is the registry's ``plan_backend`` of ``--launcher`` (native runs
    the torchrun plan)."""
    values: dict[str, Any] = {}
    for f in job_fields():
        value = getattr(args, f.name)
        if f.name == "set_env":
            value = _set_env(value)
        elif f.metadata["kind"] == "repeat":
            value = tuple(value)
        values[f.name] = value
    return JobOptions(job_id=job_id, backend=BACKENDS[getattr(args, LAUNCHER_DEST)].plan_backend,
                      nodes=args.nodes, gpus_per_node=args.gpus_per_node, include=args.include,
                      exclude=args.exclude, **program(args), **values)


def default_job_id_now(cluster: str) -> str:
    return default_job_id(cluster, datetime.now())
