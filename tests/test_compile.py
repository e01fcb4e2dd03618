"""torch.compile with fsdp_native (inductor on CPU), in the orders users apply it:

* ``blocks_first``: torchtitan's, every transformer block compiled (``block.compile()``)
  before ``fully_shard`` on it, then the root;
* ``blocks_after``: ``fully_shard`` first, then ``block.compile()``, whose compiled call runs
  the forward hooks;
* ``model_after``: Accelerate's (``torch_compile`` with FSDP2), ``torch.compile(model)`` of the
  sharded root.

fsdp_native's forward hooks run outside dynamo's tracing (graph breaks around them, as torch
FSDP2's under ``skip_fsdp_hooks``), the modules' forwards compiled. Training with AdamW and
``clip_grad_norm_``: bit for bit the losses and parameters of torch FSDP2 on the same flow, in
fp32 and with bf16 mixed precision, resharding after the forward or not; no recompilation after
the first step.

Also a compiled optimizer step (``torch.compile(optim.step)``, PyTorch's compiled-optimizer
recipe) over the sharded parameters, run after torch FSDP2's same flow in the same process:
bit for bit torch's. Before 2026-11-28 it raised "expected DTensor, got ShardedDTensor" in
the compiled function's input check (the traced inputs were rebuilt as plain DTensors, and
AOT autograd's cache key did not tell the two types apart).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from dist_utils import assert_close, full_params, load_impl, ref_impl, run_distributed, run_grid
from models import EVEN, Transformer

EXACT = dict(rtol=0, atol=0)
ARGS = EVEN.__class__(n_layers=3, vocab_size=64, max_seq_len=16, dim=32, n_heads=4)


def _run(impl, order: str, mixed_precision: bool, reshard_after_forward: bool) -> dict:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    kw = dict(reshard_after_forward=reshard_after_forward)
    if mixed_precision:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        if order == "blocks_first":
            layer.compile()
        impl.fully_shard(layer, **kw)
        if order == "blocks_after":
            layer.compile()
    impl.fully_shard(model, **kw)
    run = torch.compile(model) if order == "model_after" else model
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for step in range(3):
        if step == 1:
            counters.clear()
        x = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=gen)
        loss = run(x).float().pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert counters["stats"]["unique_graphs"] == 0, f"{impl.name}: recompiled after the first step: {dict(counters['stats'])}"
    return dict(losses=losses, params=full_params(model))


def _check(order: str, mixed_precision: bool, reshard_after_forward: bool) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    ref = _run(torch_impl, order, mixed_precision, reshard_after_forward)
    got = _run(impl, order, mixed_precision, reshard_after_forward)
    tag = f"[{impl.name} vs torch, compile {order}]"
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    for n, v in ref["params"].items():
        assert_close(f"{tag} param {n!r}", got["params"][n], v, EXACT)


def _grid():
    configs = [
        dict(order="blocks_first", mixed_precision=False, reshard_after_forward=True),
        dict(order="blocks_first", mixed_precision=True, reshard_after_forward=False),
        dict(order="blocks_after", mixed_precision=True, reshard_after_forward=True),
        dict(order="model_after", mixed_precision=False, reshard_after_forward=False),
        dict(order="model_after", mixed_precision=True, reshard_after_forward=True),
    ]
    run_grid(configs, _check, name="compile")


def test_compile_world_size_2():
    run_distributed(_grid, 2)


def _run_compiled_step(impl, mixed_precision: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    kw = {}
    if mixed_precision:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    impl.fully_shard(model[0], **kw)
    impl.fully_shard(model, **kw)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = torch.compile(optim.step)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 16, generator=gen)).float().pow(2).mean()
        loss.backward()
        step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return dict(losses=losses, params=full_params(model))


def _check_compiled_step(mixed_precision: bool) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    ref = _run_compiled_step(torch_impl, mixed_precision)  # first: its compiled code is cached
    got = _run_compiled_step(impl, mixed_precision)
    tag = f"[{impl.name} vs torch, compiled optimizer step]"
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    for n, v in ref["params"].items():
        assert_close(f"{tag} param {n!r}", got["params"][n], v, EXACT)


def _compiled_step_grid():
    run_grid([dict(mixed_precision=False), dict(mixed_precision=True)], _check_compiled_step, name="compiled-step")


def test_compiled_optimizer_step_world_size_2():
    run_distributed(_compiled_step_grid, 2)
