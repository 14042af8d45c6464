"""``clusterkit launch``: one node agent per node, a job-scoped teardown, restarts.

The agent itself lives in :mod:`clusterkit.node.agent.core` and is shipped to every
node at every launch (:mod:`clusterkit.ship`); nodes need no clusterkit.
"""
