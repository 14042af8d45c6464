"""A venv whose packages are this interpreter's, whether this interpreter is a venv or not.

``python -m venv --system-site-packages`` run from a venv's Python exposes the *base*
interpreter's site-packages, not the venv's: in a fresh venv (what most people have on
a PEP 668 system) the new venv saw no torch, no deepspeed and no clusterkit, and three
test-bed tests failed (issue 37). Here the new venv also lists this venv's site
directories in a ``.pth`` file of plain path lines (which ``python -S`` readers such
as clusterkit's probe follow too) and gets copies of their ``.pth`` files (the editable
clusterkit's finder among them), so it sees what a ``--system-site-packages`` venv of
the base interpreter would, plus this venv's packages, in that order of precedence.
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

# Sorts before the copied .pth files ('0' < '_' < letters): the directories are on
# sys.path before a copied finder's hook line imports from them.
PARENT_PTH = "00-parent-venv.pth"


def venv_over_this_python(dest: Path, *, pip: bool = False, system_site: bool = True) -> Path:
    """Create a venv at ``dest`` over this interpreter's packages; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", *([] if pip else ["--without-pip"]),
                    *(["--system-site-packages"] if system_site else []), str(dest)],
                   check=True, timeout=180)
    if system_site and sys.prefix != sys.base_prefix:
        own = next(dest.glob("lib/python3*/site-packages"))
        parents = [Path(d) for d in site.getsitepackages() if Path(d).is_dir()
                   and Path(d).is_relative_to(sys.prefix)]
        (own / PARENT_PTH).write_text("".join(f"{d}\n" for d in parents))
        for d in parents:
            for pth in sorted(d.glob("*.pth")):
                shutil.copy2(pth, own / pth.name)
    return dest / "bin" / "python"
