"""``clusterkit launch``: one node agent per node, a job-scoped teardown, restarts.

The agent itself lives in :mod:`clusterkit.node.agent` and is shipped to every
node at every launch (:mod:`clusterkit.node.ship`); nodes need no clusterkit.
"""
