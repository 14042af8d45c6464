"""Model size presets and the training FLOPs formula (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass

from clusterkit.errors import ClusterkitError

VOCAB_SIZE = 256  # byte-level tokens


@dataclass(frozen=True)
class ModelPreset:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int = VOCAB_SIZE

    @property
    def n_params(self) -> int:
        """Exact parameter count of :class:`clusterkit.workload.model.GPT` (tied
        embeddings counted once): embeddings + per-layer (attn + MLP + 2 LayerNorms)
        + final LayerNorm."""
        d = self.d_model
        per_layer = (3 * d * d + 3 * d) + (d * d + d) + (8 * d * d + 5 * d) + 4 * d
        return self.vocab_size * d + self.seq_len * d + self.n_layer * per_layer + 2 * d

    @property
    def largest_layer_params(self) -> int:
        """Largest single module's parameters (for ZeRO-3 estimates): the MLP up
        projection or the (tied) embedding, whichever is bigger."""
        d = self.d_model
        return max(4 * d * d + 4 * d, self.vocab_size * d, 3 * d * d + 3 * d)

    def train_flops_per_token(self) -> float:
        """Training FLOPs per token: 6·N (forward 2N + backward 4N for every weight,
        LM head included via the tied embedding) + the attention score/value matmuls
        12·n_layer·d_model·seq_len (PaLM appendix B, causal mask not discounted)."""
        return 6.0 * self.n_params + 12.0 * self.n_layer * self.d_model * self.seq_len


PRESETS: dict[str, ModelPreset] = {
    # A few 100k params: CPU tests and CI.
    "tiny": ModelPreset("tiny", n_layer=2, d_model=96, n_head=4, seq_len=64),
    # ~125M / ~350M with a byte vocabulary (GPT-2 small/medium budgets).
    "small": ModelPreset("small", n_layer=18, d_model=768, n_head=12, seq_len=1024),
    "medium": ModelPreset("medium", n_layer=28, d_model=1024, n_head=16, seq_len=1024),
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ClusterkitError(f"unknown model preset {name!r}", key="model",
                              hint=f"choose one of {', '.join(PRESETS)}") from None


# Dense bf16 peak TFLOP/s per GPU, used for MFU (matched on torch.cuda device name).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0), ("H100", 989.0), ("GH200", 989.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("A10G", 70.0), ("L4", 121.0), ("V100", 125.0), ("B200", 2250.0),
)


def peak_tflops_for(device_name: str) -> float | None:
    upper = device_name.upper()
    for key, value in PEAK_BF16_TFLOPS:
        if key in upper:
            return value
    return None
