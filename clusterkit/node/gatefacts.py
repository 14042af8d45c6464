"""Node program: what every node of a job must agree on (the pre-launch gate's facts).

Interpreter path, Python version and the versions of the packages every rank
imports, read from package metadata only: importing torch here would cost
seconds on every launch. The agent reports these as its ``facts`` event; run on
its own it prints them as one JSON line. ``clusterkit`` is the version importable
by this interpreter (None when absent: only the bundled workload needs it) and
``clusterkit_digest`` a digest of its sources, so "the same version" means the
same code (``clusterkit nodes install`` compares it with the launcher's).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from clusterkit.node import sitepaths

PACKAGES = ("torch", "deepspeed", "accelerate")


def _version(name: str) -> str | None:
    try:
        from importlib import metadata  # Python >= 3.8; an older node reports nothing

        return metadata.version(name)
    except Exception:  # any broken metadata reads as "not installed"
        return None


def package_digest(directory: str) -> str:
    """sha256 over the package's ``.py`` files (relative path and content), in order.

    ``templates`` is left out: in a source tree it lives outside the package directory
    (pyproject maps it in), so only an installed copy has it there.
    """
    h = hashlib.sha256()
    for d, dirs, names in os.walk(directory):
        top = os.path.normpath(d) == os.path.normpath(directory)
        dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not (top and x == "templates"))
        for n in sorted(names):
            if n.endswith(".py"):
                path = os.path.join(d, n)
                h.update(os.path.relpath(path, directory).replace(os.sep, "/").encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(fh.read() + b"\0")
    return h.hexdigest()


def _clusterkit(version: Callable[[str], str | None] = _version) -> dict[str, Any]:
    """Version and digest of an importable clusterkit, found without importing it.

    ``version``: how to read a distribution's version (the probe passes a cheaper one).
    When shipped, ``clusterkit`` in sys.modules is the bootstrap's empty package:
    set it aside while asking the import system where the real one would come from.
    """
    import importlib.util

    sitepaths.finish("clusterkit")  # under -S: an editable install's finder, sitecustomize

    ours = {k: sys.modules.pop(k) for k in list(sys.modules)
            if k == "clusterkit" or k.startswith("clusterkit.")}
    try:
        spec = importlib.util.find_spec("clusterkit")
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.modules.update(ours)
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    if not where:
        return {"clusterkit": None, "clusterkit_digest": None}
    return {"clusterkit": version("clusterkit") or "unknown",
            "clusterkit_digest": package_digest(where[0])}


def gate_facts(needs: Sequence[str] = ()) -> dict[str, Any]:
    """``needs``: files the job's ranks open on this node; ``missing`` lists the absent."""
    sitepaths.add()  # shipped under -S: the package directories, as ranks will see them
    facts: dict[str, Any] = {"python": sys.executable, "version": sys.version.split()[0]}
    facts.update({name: _version(name) for name in PACKAGES})
    facts.update(_clusterkit())
    facts["missing"] = [p for p in needs if not os.path.isfile(p)]
    return facts


def main(argv: list[str] | None = None) -> int:
    """Arguments: the files the job needs on this node."""
    sys.stdout.write(json.dumps(gate_facts(sys.argv[1:] if argv is None else argv)) + "\n")
    sys.stdout.flush()
    return 0
