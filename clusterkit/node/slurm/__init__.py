"""The node programs of a ``clusterkit sbatch`` job's batch script (docs/sbatch.md).

``slurm.watch``: the hang watchdog beside the launch step (the rule is
``node/hangrule.py``); ``slurm.end``: what the end of a run means, a pure table (exit
status, requeue); ``slurm.replica``: the checkpoint replicas of a node-local job and a
run on another node set, whose list/plan/restore decisions are ``restore``'s (over the
replica rules, ``node/replicas/rules.py``).

Kept import-free: on a node the bootstrap makes this package an empty module.
"""
