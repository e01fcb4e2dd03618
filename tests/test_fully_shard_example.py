"""The flow of PyTorch's own FSDP2 example (pytorch/examples, distributed/FSDP2), in each of
its modes, with fsdp_native and with torch FSDP2: bit for bit the same losses and parameters.

The flow: build the model on the meta device; ``fully_shard`` every block, then the root,
on the default mesh; check the parameters are ``Shard(0)`` fp32 DTensors; with
``--explicit-prefetching`` set forward and backward prefetch of the next two blocks before
the parameters exist; then either initialise (``to_empty`` + ``reset_parameters``) or
resume from a full state dict, by ``load_state_dict(..., assign=True)`` of
``distribute_tensor``-ed parameters (the example's "dtensor api") or by
``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` ("dcp api");
with ``--mixed-precision`` call ``model.unshard()`` before any forward, check the
unsharded parameters are bf16, and ``model.reshard()``; train with Adam and
``clip_grad_norm_``, calling ``model.unshard()`` before each step's forward with explicit
prefetching.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dist_utils import assert_close, full_params, load_impl, ref_impl, run_distributed, run_grid
from models import EVEN, Transformer

EXACT = dict(rtol=0, atol=0)
ARGS = EVEN.__class__(n_layers=4, vocab_size=64, max_seq_len=16, dim=32, n_heads=4)


def _prefetch(model, n: int) -> None:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if i + n < len(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + n])
        if i >= n:
            layer.set_modules_to_backward_prefetch([layers[i - j] for j in range(1, n + 1)])


def _run(impl, mixed_precision: bool, explicit_prefetching: bool, load: str) -> dict:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ARGS)
    kw = {}
    if mixed_precision:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        impl.fully_shard(layer, **kw)
    impl.fully_shard(model, **kw)
    assert isinstance(model, impl.FSDPModule)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.dtype == torch.float32, name
    if explicit_prefetching:
        _prefetch(model, 2)
    if load == "fresh":
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        model.reset_parameters()
    else:
        torch.manual_seed(7)
        full_sd = Transformer(ARGS).state_dict()
        if load == "dtensor_api":
            meta_sd = model.state_dict()
            sharded = {
                k: nn.Parameter(distribute_tensor(v, meta_sd[k].device_mesh, meta_sd[k].placements)) for k, v in full_sd.items()
            }
            model.load_state_dict(sharded, strict=False, assign=True)
        else:
            model.to_empty(device="cpu")
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model=model, model_state_dict=full_sd, options=opts)
    if mixed_precision:
        model.unshard()
        for name, p in model.named_parameters(recurse=True):
            if name.startswith(("tok_embeddings", "output", "norm")):
                assert p.dtype == torch.bfloat16 and not isinstance(p, DTensor), f"{name}: {type(p).__name__} {p.dtype}"
        model.reshard()
        assert all(isinstance(p, DTensor) for p in model.parameters())
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(4):
        if explicit_prefetching:
            model.unshard()
        x = torch.randint(0, ARGS.vocab_size, (4, ARGS.max_seq_len), generator=gen)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach().float().item())
    return dict(losses=losses, params=full_params(model))


def _check(mixed_precision: bool, explicit_prefetching: bool, load: str) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    ref = _run(torch_impl, mixed_precision, explicit_prefetching, load)
    got = _run(impl, mixed_precision, explicit_prefetching, load)
    tag = f"[{impl.name} vs torch, example flow]"
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    for n, v in ref["params"].items():
        assert_close(f"{tag} param {n!r}", got["params"][n], v, EXACT)


def _grid():
    configs = [
        dict(mixed_precision=mp, explicit_prefetching=pf, load="fresh") for mp in (False, True) for pf in (False, True)
    ]
    configs += [
        dict(mixed_precision=False, explicit_prefetching=True, load="dtensor_api"),
        dict(mixed_precision=True, explicit_prefetching=False, load="dtensor_api"),
        dict(mixed_precision=True, explicit_prefetching=True, load="dcp_api"),
    ]
    run_grid(configs, _check, name="fsdp2-example")


def test_fsdp2_example_flow_world_size_2():
    run_distributed(_grid, 2)
