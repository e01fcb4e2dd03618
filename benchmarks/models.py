"""Benchmark models for benchmarks/bench_step.py.

A residual MLP: input ``Linear(dim, dim)``, ``n_blocks`` blocks
``x + Linear(hidden, dim)(GELU(Linear(dim, hidden)(LayerNorm(dim)(x))))``, output
``Linear(dim, dim)``. Each block is one ``fully_shard`` unit; the root unit holds the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, n_blocks: int):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dim: int
    hidden: int
    n_blocks: int
    input_shape: tuple[int, ...]  # per rank

    def num_params(self) -> int:
        d, h = self.dim, self.hidden
        block = 2 * d + d * h + h + h * d + d
        return 2 * (d * d + d) + self.n_blocks * block


MODEL_CONFIGS: dict[str, ModelConfig] = {
    # Many small units: per-unit runtime overhead dominates.
    "overhead": ModelConfig("overhead", dim=128, hidden=256, n_blocks=32, input_shape=(4, 8, 128)),
    # Few large units: GEMMs and collectives dominate.
    "compute": ModelConfig("compute", dim=768, hidden=3072, n_blocks=8, input_shape=(8, 128, 768)),
    # The compute model's units with 1/16 of its tokens: all-gather bytes dominate (what the
    # quantized all-gathers are for; not in bench_step's default set).
    "comm": ModelConfig("comm", dim=768, hidden=3072, n_blocks=8, input_shape=(1, 64, 768)),
}


def build_model(cfg: ModelConfig, seed: int = 0) -> ResidualMLP:
    """Same seed, same initial weights (on every rank and for every implementation)."""
    torch.manual_seed(seed)
    return ResidualMLP(cfg.dim, cfg.hidden, cfg.n_blocks)


def shard_model(model: nn.Module, fully_shard, mp_policy=None, compile_blocks: bool = False, **kwargs) -> nn.Module:
    """Each block (``model.blocks``) as a unit, then the root over the rest (input and output
    layers). ``kwargs`` (``mesh``, ...) go to every ``fully_shard`` call. ``compile_blocks``:
    ``block.compile()`` before its ``fully_shard`` (torchtitan's order)."""
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in model.blocks:
        if compile_blocks:
            block.compile()
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


# --------------------------------------------------------------------------------------------
# A Llama-style decoder (benchmarks/bench_gpu.py's compute-bound model)


@dataclass(frozen=True)
class LlamaConfig:
    """Llama-3-8B-sized by default (32 heads, 8 KV heads, SwiGLU, RMSNorm; no rotary
    embedding, which has no parameters), with ``n_layers`` decoder layers."""

    name: str = "llama8b"
    dim: int = 4096
    hidden: int = 14336
    n_layers: int = 4
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab: int = 32000
    seq: int = 4096
    batch: int = 1  # per rank

    def layer_shapes(self) -> list[tuple[int, ...]]:
        """Parameter shapes of one decoder layer, in registration order."""
        d, h, kv = self.dim, self.hidden, self.dim // self.n_heads * self.n_kv_heads
        return [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (h, d), (h, d), (d, h)]


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.n_heads, c.n_kv_heads, c.dim // c.n_heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv  # grouped-query attention: every KV head serves `rep` heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class LlamaLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim)
        self.attention = LlamaAttention(c)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(LlamaLayer(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Every submodule's own ``reset_parameters`` (after ``to_empty`` from the meta device)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
