"""Checkpoints after (and between) training: find them on the nodes, verify, copy, convert.

The pipeline, and where each verb enters it:

``collect-ckpt`` -> :func:`clusterkit.checkpoints.collect.verb.collect`
    list every node -> verify completeness (:mod:`.collect.discover`) -> pick one copy per
    file (:mod:`.collect.choose`, :mod:`.collect.fromreplicas`) -> copy, hashed on both
    ends (a :mod:`.sources` data path) -> manifest (:mod:`.collect.manifest`) -> optional
    ``--prune-sources`` (:mod:`.collect.prune`) and ``--scatter``
    (:func:`.collect.scatter.scatter`).
``collect-ckpt --consolidate`` -> :func:`clusterkit.checkpoints.convert.consolidate.consolidate`
    (DeepSpeed's own zero_to_fp32; the only torch importer here besides ``universal``).
a shrink onto fewer nodes -> :func:`clusterkit.checkpoints.convert.universal.convert_to_universal`
    (DeepSpeed's ``ds_to_universal``).
``status JOB`` replica health -> :func:`clusterkit.checkpoints.replicas.health.job_health`;
    which copy of each node part is usable: :func:`.replicas.assemble.assemble`.

Sub-packages: ``collect`` (the verb and its decisions), ``sources`` (the data paths and
:func:`.sources.factory.open_source`, shared by collect, status and recovery),
``replicas`` (node parts and their replicas), ``convert`` (consolidate, universal).
Shared vocabulary stays at this level: :mod:`.layout` (DeepSpeed's file names and
clusterkit's marker), :mod:`.listing` (one node's checkpoint root), :mod:`.collectplan`
(what is complete and where). Sub-packages import that vocabulary and each other's
modules, never this package's ``__init__``.
"""
