"""Code that runs inside the user's ranks, written into the job dir (not a node program).

``accelerate_cpu``: the job dir's ``sitecustomize.py`` for accelerate ranks without a
GPU (issue 38, docs/programs.md), read as a file by ``plan/profile.py``.

Kept import-free: on a node the bootstrap makes this package an empty module.
"""
