"""The node side of ``clusterkit sync`` (docs/sync.md): node program ``sync.chain``.

``chain``: one node of the chain (receive, store, forward, check); ``store``: the
manifest, the digest and the chunks, shared with the launcher's engine
(``clusterkit/sync/``); ``wire``: the chain's authenticated TCP records.

Kept import-free: on a node the bootstrap makes this package an empty module.
"""
