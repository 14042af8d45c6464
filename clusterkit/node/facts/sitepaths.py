"""Node helper: the package directories a normal start would put on sys.path, without its hooks.

Node programs that only read files (probe, gatefacts, listing, hashing, ...) run
with ``python -S``: the interpreter then skips ``site``, which on a real node runs
every ``.pth`` file's ``import`` line (editable installs' finders, conda and vendor
hooks; 30-40 ms of the probe's ~110 ms of CPU on the development machine) and
``sitecustomize``. Nothing of that is needed to read files, and a broken hook can no
longer break a probe.

Environment parity still needs the package directories, so :func:`add` puts them on
sys.path the way ``site`` does (a venv's prefix and its ``pyvenv.cfg``, the user site
when enabled, site-packages, and the directory lines of ``.pth`` files), using
``site``'s own functions with one change: a ``.pth`` line that starts with ``import``
is remembered instead of run. :func:`finish` runs what a normal start would run
before asking where a package is imported from (the editable clusterkit's finder,
sitecustomize). Under a normal start (no ``-S``) both are no-ops.
"""

from __future__ import annotations

import os
import sys

# (.pth file, line) of every import line add() left unrun, in site's order.
_HOOKS: list[tuple[str, str]] = []
_DONE = False
_FINISHED = False


def add() -> None:
    """Put the site directories on sys.path as ``site`` would, running no ``.pth`` code."""
    global _DONE
    if _DONE or not sys.flags.no_site:
        return
    _DONE = True
    import site

    real = site.addpackage
    site.addpackage = _paths_only  # addsitedir() looks it up in site's globals
    try:
        known = site.venv(site.removeduppaths()) or set()  # a venv's sys.prefix: getpath leaves it to site
        if site.ENABLE_USER_SITE is None:
            site.ENABLE_USER_SITE = site.check_enableusersite()
        site.addsitepackages(site.addusersitepackages(known))
    finally:
        site.addpackage = real


def finish(word: str) -> None:
    """The rest of a normal start, for the question "what would ``import <word>`` find?".

    Runs the import lines :func:`add` skipped in ``.pth`` files whose name holds
    ``word`` (an editable install's finder), then ``sitecustomize`` and
    ``usercustomize``, which run after every ``.pth`` file and may change the import
    system too. Only under ``-S``, once.
    """
    global _FINISHED
    if _FINISHED or not sys.flags.no_site:
        return
    _FINISHED = True
    add()
    import site

    for path, line in [h for h in _HOOKS if word in os.path.basename(h[0])]:
        try:
            exec(line)  # what site.addpackage does with such a line
        except Exception as exc:  # reported like site does, never fatal
            print(f"Error processing line of {path}: {exc!r}", file=sys.stderr)
    site.execsitecustomize()
    if site.ENABLE_USER_SITE:
        site.execusercustomize()


def _paths_only(sitedir: str | os.PathLike[str], name: str | os.PathLike[str],
                known_paths: set[str] | None) -> set[str] | None:
    """site.addpackage without running code: directory lines only, import lines kept."""
    import site

    sitedir, fullname = os.fspath(sitedir), os.path.join(sitedir, name)
    try:
        with open(fullname, encoding="utf-8-sig", errors="replace") as fh:  # as site (3.13)
            lines = fh.read().splitlines()
    except OSError:
        return known_paths
    for line in lines:
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith(("import ", "import\t")):
            _HOOKS.append((fullname, line))
            continue
        line = line.rstrip()
        path, case = site.makepath(sitedir, line)
        if known_paths is not None and case not in known_paths and os.path.exists(path):
            sys.path.append(path)
            known_paths.add(case)
    return known_paths
