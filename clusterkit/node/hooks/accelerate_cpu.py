"""accelerate on ranks without a GPU: the process group its code does not name (issue 38).

accelerate 1.15 (``state.py``, ``PartialState._prepare_backend``) picks a backend from
the device it finds: under torchrun (``LOCAL_RANK`` set) with ``cpu=False`` and no GPU
none of its branches matches, so it returns ``DistributedType.NO`` and backend ``None``,
and ``PartialState.__init__`` then sets ``num_processes = 1, process_index = 0`` ("No
backend == no distributed training") on every rank, even though its DeepSpeed plugin
(``ACCELERATE_USE_DEEPSPEED``) has just made DeepSpeed initialise a gloo group of the
whole world. Every rank is then the main process of a world of one: each writes
``random_states_0.pkl``, none shards the data. ``cpu=True`` (``ACCELERATE_USE_CPU``,
what ``accelerate launch --cpu`` sets) picks MULTI_CPU and gloo, but also drops the
DeepSpeed plugin (``AcceleratorState``: ``ACCELERATE_USE_DEEPSPEED ... and not cpu``);
``accelerate launch`` with a DEEPSPEED config sets nothing that helps (measured: the same
world of one). Only the program's own ``InitProcessGroupKwargs(backend="gloo")`` does.

This module is the job dir's ``sitecustomize.py`` for such ranks (``spec/programs.py``,
``Profile.cpu_hook``; the plan puts the job dir first on their ``PYTHONPATH``): when
``accelerate.state`` is imported, ``_prepare_backend`` is wrapped so that where
accelerate found no backend for a launched rank (``LOCAL_RANK`` set, ``cpu=False``, the
answer ``NO``/``None``) it answers what it answers for ``cpu=True`` (MULTI_CPU, gloo or
mpi) while ``cpu`` stays False, so the DeepSpeed plugin stays. Everywhere else (a GPU,
a backend or ``cpu=True`` the program chose) accelerate's own answer stands. Importing
this module does nothing; :func:`install` does it, once, from the shipped file.

Standard library only; it runs in the user's ranks.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

TARGET = "accelerate.state"
MARK = "_clusterkit_cpu_backend"


def launched_rank(environ: Any = None) -> bool:
    """A rank started by a launcher (torchrun, accelerate launch, DeepSpeed's runner)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("LOCAL_RANK", -1)) != -1
    except ValueError:
        return False


def patch(state: ModuleType) -> None:
    """Wrap ``state.PartialState._prepare_backend`` (once)."""
    cls = state.PartialState
    own = cls._prepare_backend
    if getattr(own, MARK, False):
        return
    none = state.DistributedType.NO

    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False,
                         backend: str | None = None) -> Any:
        found, kind = own(self, cpu, sagemaker_dp, backend)
        if not cpu and found is None and kind == none and launched_rank():
            return own(self, True, sagemaker_dp, backend)
        return found, kind

    setattr(_prepare_backend, MARK, True)
    cls._prepare_backend = _prepare_backend


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``accelerate.state`` right after it is executed, whoever imports it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            with contextlib.suppress(AttributeError):  # another accelerate: its own way
                patch(module)

        loader.exec_module = exec_module
        return spec


def _next_sitecustomize(here: str) -> None:
    """Run the ``sitecustomize`` this file shadows (a distribution's, a venv's), if any."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def install(path: str) -> None:
    """From the shipped ``sitecustomize.py`` at ``path``: patch accelerate when it is
    imported (now, if it already is), then run the shadowed ``sitecustomize``."""
    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    _next_sitecustomize(os.path.dirname(os.path.abspath(path)))
