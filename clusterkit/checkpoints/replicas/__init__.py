"""Node parts of a node-local checkpoint and their replicas on other nodes:
:mod:`.assemble` decides, from every reachable node's listing, which copy of each part
is usable; :mod:`.health` is ``status``'s "replicated K/N" view of it."""
