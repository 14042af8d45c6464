"""Node preparation over the transport: ``clusterkit nodes env|install|build-ops``.

Above the transport (``clusterkit.remote``) and the sync engine (``envcopy`` copies an
environment through it), below the verbs that use it (the launch gate's ops step,
doctor's fixes, the CLI): ``envcopy`` (this machine's Python environment onto nodes
that lack it, docs/sync.md), ``install`` (a wheel of this clusterkit, offline),
``jitbuild`` (DeepSpeed's JIT ops built on every node before any rank starts). Each
runs a node program (``clusterkit/node/``) per node and returns per-node results.
"""
