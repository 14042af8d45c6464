"""A job as a whole, above the packages that each know one side of it.

``launch`` (the plan, the run, the job record), ``slurm`` (a batch job's places) and
``checkpoints`` (the data path) are one layer and may not import each other
(tests/unit/test_layering.py). What joins them lives here, below ``cli``, so ``cli`` is argument
parsing and printing and the Python API calls the same code:

* ``recover``: readying a continued node-local job's checkpoint before its agents start
  (docs/lost-a-node.md): the decision and the refusal; ``restore`` copies a node index's
  part from a verified replica onto its node, ``reshard`` gathers, converts and pushes
  the checkpoint for another rank->node mapping;
* ``resolve``: a job id or job dir to its record, its nodes (``CollectNode``: SSH target
  or Slurm place) and their checkpoint dirs; without a job, the inventory's hosts;
* ``collect``: collect-ckpt end to end (``collect_job``: collect, consolidate, scatter,
  prune) with a typed result;
* ``launch``: one launch from this machine (``plan_launch``, ``run_launch``, the dry
  run's checks, the summary kept beside the job record);
* ``status``, ``stop``: a launched job's nodes asked (``JobStatus``, ``NodeStatus``) and
  stopped (``StopResult``);
* ``doctor``: a doctor run (which nodes, port, replicas, the interfaces kept);
* ``here``: this machine: the clusterkit home, the inventory chain, the launch facts.

``clusterkit/api.py`` (docs/api.md) is the Python API over these.
"""
