"""The bundled ZeRO training workload: ``python -m clusterkit.workload``.

A real (small) GPT trained with DeepSpeed ZeRO 0-3, natively or through accelerate,
with restartable checkpoints on shared or node-local storage. torch and deepspeed
are imported lazily by the submodules that need them, so importing this package
(e.g. for the memory advisor's presets) stays cheap.
"""
