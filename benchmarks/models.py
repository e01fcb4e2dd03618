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
}


def build_model(cfg: ModelConfig, seed: int = 0) -> ResidualMLP:
    """Same seed, same initial weights (on every rank and for every implementation)."""
    torch.manual_seed(seed)
    return ResidualMLP(cfg.dim, cfg.hidden, cfg.n_blocks)


def shard_model(model: nn.Module, fully_shard, mp_policy=None, **kwargs) -> nn.Module:
    """Each block (``model.blocks``) as a unit, then the root over the rest (input and output
    layers). ``kwargs`` (``mesh``, ...) go to every ``fully_shard`` call."""
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model
