"""Everything that runs on a node: standard library only, rooms by role.

Every module under this package is shipped to nodes as source (never imported from an
installed clusterkit there): Python >= 3.8 at run time (annotations are strings, no
``match``, no walrus), standard library only (``tests/unit/test_import_rules.py``). A *node
program* is a module with ``main(argv) -> int``; its name is its dotted name below this
package (``facts.probe``, ``agent.core``). The launcher's half, which modules each program
ships and its command line, is :mod:`clusterkit.ship` (never shipped); the bootstrap that
runs them is :data:`clusterkit.node.contract.BOOTSTRAP`.

At the top, only this face and five base modules every room shares:

* ``contract``: the node contract (every ``CLUSTERKIT_*`` name, the job-dir layout, the
  bundle and its bootstrap);
* ``protocol``: the typed, versioned contract between the launcher and the agent, and
  the one parser of a node program's JSON answer;
* ``hashing``: file digests and MACs (node program ``hashing``);
* ``hangrule``: the progress watchdog's rule, for ``launch`` and the batch script alike;
* ``files``: files written whole (an atomic write, an atomic link).

The rooms: ``agent/`` (the node agent and its fork server), ``replicas/`` (checkpoint
replicas), ``sync/`` (``clusterkit sync``'s chain), ``facts/`` (the gate's and doctor's
facts), ``provision/`` (install, JIT ops), ``slurm/`` (the batch script's programs),
``ckpt/`` (checkpoint listing and streaming), ``hooks/`` (code run inside the user's
ranks). docs/architecture.md, "Node modules".

Kept import-free: the launcher imports submodules one by one, and on a node the
bootstrap makes each package an empty module.
"""
