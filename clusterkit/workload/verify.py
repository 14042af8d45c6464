"""Does a consolidated state dict load into the bundled GPT? (torch; cli passes it to
:func:`clusterkit.checkpoints.convert.consolidate.consolidate` as its ``model_check``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterkit.errors import CheckpointError


def check_against_workload(state: Mapping[str, Any]) -> str:
    """Load into the bundled GPT when shapes match a preset (strict); else say so."""
    import torch

    from clusterkit.workload.model import GPT
    from clusterkit.workload.presets import PRESETS

    shapes = {k: tuple(v.shape) for k, v in state.items()}
    for preset in PRESETS.values():
        if shapes.get("wte.weight") != (preset.vocab_size, preset.d_model) or \
                shapes.get("wpe.weight") != (preset.seq_len, preset.d_model):
            continue
        with torch.device("meta"):
            probe = GPT(preset)
        want = {k: tuple(v.shape) for k, v in probe.state_dict().items()}
        if want != shapes:
            continue
        model = GPT(preset)
        try:
            model.load_state_dict(dict(state), strict=True)
        except RuntimeError as exc:
            raise CheckpointError(f"consolidated weights do not load into GPT({preset.name}): "
                                  f"{exc}") from None
        return f"loads strictly into clusterkit.workload GPT({preset.name})"
    return "not a bundled workload model (no preset matches its tensors); not load-tested"
