"""torchao's low-bit optimizers over fsdp_native's sharded parameters: ``AdamW8bit`` keeps its
states as DTensors of 8-bit blocks (for shards of 4096 elements or more) and runs each
parameter's update as a ``torch.compile(fullgraph=True)`` function. Trained after torch
FSDP2's same run in the same process, the losses and parameters are bit for bit torch's, with
fp32 and with a bf16 policy. Before 2026-11-28 the compiled update raised "expected DTensor,
got ShardedDTensor" (see ``tests/test_compile.py``). torchao 0.18's ``AdamW4bit`` and
``AdamWFp8`` fail on CPU with either library (a dimension assertion and a missing ``qmap``).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import assert_same_run, full_params, load_impl, ref_impl, run_distributed, run_grid

pytest.importorskip("torchao", reason="torchao is a test dependency (make test installs it)")


def _train(impl, mixed_precision: bool) -> dict:
    import torchao.optim

    torch.manual_seed(0)
    # 128 x 128 weights: 8192-element shards on 2 ranks, so their states are 8-bit.
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    kw = {}
    if mixed_precision:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in (0, 2):
        impl.fully_shard(model[i], **kw)
    impl.fully_shard(model, **kw)
    optim = torchao.optim.AdamW8bit(model.parameters(), lr=1e-2, block_size=64)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 128, generator=gen)).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    states = {type(s["exp_avg"].to_local()).__name__ for s in optim.state.values()}
    assert "OptimState8bit" in states, f"{impl.name}: no 8-bit optimizer state ({states})"
    return dict(losses=losses, params=full_params(model))


def check(mixed_precision: bool) -> None:
    impl = load_impl()
    ref = _train(ref_impl(), mixed_precision)
    got = _train(impl, mixed_precision)
    assert_same_run(f"[{impl.name} vs torch] AdamW8bit, bf16 {mixed_precision}", got, ref)


def _grid():
    run_grid([dict(mixed_precision=False), dict(mixed_precision=True)], check, name="adamw8bit")


def test_adamw8bit_matches_torch():
    run_distributed(_grid, 2, timeout=400)
