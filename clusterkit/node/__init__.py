"""Everything that runs on a node, and the one way it gets there.

Each module here except :mod:`clusterkit.node.ship` is a *node program*: standard
library only, Python >= 3.8 at run time (annotations are strings, no ``match``,
no walrus), with a ``main(argv) -> int``. None is ever imported from an installed
clusterkit on the node: :mod:`clusterkit.node.ship` sends the sources over the
SSH session (stdin of a tiny ``python -c`` bootstrap) every time, so a node needs
nothing but a Python. :mod:`clusterkit.node.protocol` is the typed, versioned
contract between the launcher and the agent.

Kept import-free: the launcher imports submodules one by one.
"""
