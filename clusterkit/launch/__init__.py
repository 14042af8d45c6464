"""``clusterkit launch``: one node agent per node, a job-scoped teardown, restarts.

Kept import-light on purpose: ``python -m clusterkit.launch.agent`` runs on every
node at every launch, and its start-up time is part of the job's start-up time.
"""
