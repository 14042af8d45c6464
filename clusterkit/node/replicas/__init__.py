"""Checkpoint replicas on the nodes (issues 22, 31, 36; docs/lost-a-node.md).

``rules``: the replica rules, decided once (placement, copy validity, tag order, which
sources serve which node index), asked by the launcher's ``checkpoints/replicas`` and
the Slurm restore alike; ``wire``: the agent-to-agent push; ``area``: the replica area
on disk; ``done``: when a tag dir is finished on its node; ``service``: the replication
service (watch, push, record); ``proc``: the agent's copy process that runs it;
``priority``: the copies' CPU and I/O priority below the ranks'.

Kept import-free: on a node the bootstrap makes this package an empty module.
"""
