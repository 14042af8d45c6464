"""Node preparation on the node (docs/getting-nodes-ready.md), the launcher's
``clusterkit/provision/`` counterpart.

Node programs ``provision.install`` (a clusterkit wheel installed offline),
``provision.jitops`` (DeepSpeed's JIT ops built and their locks read: ``nodes
build-ops``, doctor, the agent's stacks) and ``provision.jitbatch`` (the batch script's
JIT ops step); ``buildowner``: the owner record beside a build lock.

Kept import-free: on a node the bootstrap makes this package an empty module.
"""
