"""A node's checkpoint data as the launcher reads it (collect-ckpt, status, recovery).

Node programs ``ckpt.listing`` (one node's checkpoint root and replica area as one JSON
line) and ``ckpt.stream`` (one session from the listing to the last byte: list, hash,
send; docs/collect-ckpt.md). File hashing itself is the base module ``node/hashing.py``.

Kept import-free: on a node the bootstrap makes this package an empty module.
"""
