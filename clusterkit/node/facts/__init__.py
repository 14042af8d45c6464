"""What a node is: the facts the launch gate and doctor read (docs/doctor.md).

Node programs ``facts.gatefacts`` (the launch gate's facts, folded into the agent),
``facts.probe`` (doctor's probe), ``facts.envfacts`` (``clusterkit nodes env``'s record
of a replicated environment, and its verdict) and ``facts.bw_worker`` (doctor's
bandwidth test, the one node module that imports torch); ``parity`` (the one package
table and parity rule) and ``sitepaths`` (package directories under ``python -S``).

Kept import-free: on a node the bootstrap makes this package an empty module.
"""
