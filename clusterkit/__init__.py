"""clusterkit: from SSH-reachable GPU servers to a restartable DeepSpeed ZeRO run."""

__version__ = "0.1.0"
