"""Conversions of a complete ZeRO checkpoint with DeepSpeed's own code (torch and
deepspeed imported lazily inside): :mod:`.consolidate` (one fp32 state dict) and
:mod:`.universal` (a universal checkpoint, to resume on another world size)."""
