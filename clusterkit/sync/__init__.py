"""``clusterkit sync``: a directory onto every node's workdir, node to node (docs/sync.md).

Above the transport (``clusterkit.remote``), below the verbs: ``source`` (what travels,
its sha256s and their cache), ``plan`` (the pure decisions: chains, records, progress
lines), ``engine`` (the sessions, the feeders, the event loop), ``ssh`` (a node fed over
its SSH session), ``types`` (the results), ``check`` (each node's manifest, the chain's
ports: doctor). The node side is ``clusterkit/node/sync_*.py`` (the ``sync.chain`` program).
"""
