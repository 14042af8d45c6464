"""The node agent (node program ``agent.core``) and its fork server.

One agent per node and attempt: it reads its spec on stdin, writes the job's files,
starts the node's launcher or the ranks themselves, labels and sends their output,
watches them (hangs, stacks) and tears the job down by its tag. ``core`` is the entry
and the loop; ``state``, ``procs``, ``files``, ``env``, ``output``, ``forkserver`` and
``hangs`` are its parts; ``zygote`` is the fork server it starts in native mode (its own
process, its own bootstrap). docs/architecture.md, "The node agent's modules".

Kept import-free: on a node the bootstrap makes this package an empty module.
"""
