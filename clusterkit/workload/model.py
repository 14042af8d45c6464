"""A GPT-style decoder: pre-LN blocks with causal self-attention and a GELU MLP,
learned positions, tied input/output embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from clusterkit.workload.presets import ModelPreset


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy loss (a scalar), which
    is what DeepSpeed's ``engine(batch)`` / ``engine.backward(loss)`` expect."""

    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.preset = preset
        d = preset.d_model
        self.wte = nn.Embedding(preset.vocab_size, d)
        self.wpe = nn.Embedding(preset.seq_len, d)
        self.blocks = nn.ModuleList(Block(d, preset.n_head) for _ in range(preset.n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, preset.vocab_size, bias=False)
        # Tie as a shared Parameter of a real submodule: ZeRO-3 gathers parameters in
        # module pre-forward hooks, so F.linear(x, self.wte.weight) would see a shard.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        scaled_std = 0.02 / math.sqrt(2 * preset.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=scaled_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Decay matrices only; biases, LayerNorms (1-D) are not decayed."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]
