"""Units whose parameters have different dtypes, as torch FSDP2 allows: fp32 low-rank adapters
beside bf16 frozen base weights (QLoRA-style fine-tuning), fp32 norms beside bf16 weights.
One all-gather per unit (bytes, or the one ``param_dtype`` with a cast), one reduction; the
losses and parameters are bit for bit torch FSDP2's. Gradients of several dtypes in one unit
raise, as in torch, with a message that says what to set.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from dist_utils import assert_close, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, train_steps

EXACT = dict(rtol=0, atol=0)


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int, base_dtype: torch.dtype):
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False, dtype=base_dtype)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x):
        return self.base(x.to(self.base.weight.dtype)).to(x.dtype) + self.lora_b(self.lora_a(x))


class Block(nn.Module):
    def __init__(self, dim: int, rank: int, base_dtype: torch.dtype, trainable_base: bool):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = LoRALinear(dim, 3 * dim, rank, base_dtype)
        self.down = LoRALinear(3 * dim, dim, rank, base_dtype)
        if trainable_base:
            self.up.base.weight.requires_grad_(True)
            self.down.base.weight.requires_grad_(True)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(BlockStack):
    def __init__(self, dim=10, n=2, rank=3, base_dtype=torch.bfloat16, trainable_base=False):
        super().__init__(lambda: Block(dim, rank, base_dtype, trainable_base), dim, n)


def _train(impl, mesh, mp: str | None, reshard: bool, accum: int, dim: int, trainable_base: bool) -> dict:
    torch.manual_seed(0)
    model = Model(dim=dim, trainable_base=trainable_base)
    kw = dict(mesh=mesh, reshard_after_forward=reshard)
    if mp == "bf16":
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mp == "reduce32":
        kw["mp_policy"] = impl.MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    losses = train_steps(model, accum=accum)
    return dict(losses=losses, params=full_params(model))


def _check(mp, reshard, accum, dim, mesh_kind="1d", trainable_base=False) -> None:
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if mesh_kind == "hsdp" else init_device_mesh("cpu", (ws,))
    impl, torch_impl = load_impl(), ref_impl()
    ref = _train(torch_impl, mesh, mp, reshard, accum, dim, trainable_base)
    got = _train(impl, mesh, mp, reshard, accum, dim, trainable_base)
    tag = f"[{impl.name} vs torch, mixed dtypes mp={mp}]"
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    for n, v in ref["params"].items():
        assert_close(f"{tag} param {n!r}", got["params"][n], v, EXACT)
        assert got["params"][n].dtype == v.dtype, (n, got["params"][n].dtype, v.dtype)


def _grid():
    configs = [
        dict(mp=None, reshard=True, accum=1, dim=10),  # bytes all-gather: bf16 frozen + fp32 trainable
        dict(mp=None, reshard=False, accum=2, dim=7),  # dim 0 not divisible by the world size
        dict(mp="bf16", reshard=True, accum=2, dim=10),  # one param dtype: cast in the copy-in
        dict(mp="reduce32", reshard=True, accum=1, dim=10),
    ]
    run_grid(configs, _check, name="mixed-dtypes")


def test_mixed_dtypes_world_size_2():
    run_distributed(_grid, 2)


def _grid_ws1():
    run_grid([dict(mp=None, reshard=True, accum=1, dim=5), dict(mp="bf16", reshard=False, accum=2, dim=5)], _check, name="mixed-ws1")


def test_mixed_dtypes_world_size_1():
    run_distributed(_grid_ws1, 1)


def _grid_ws4():
    configs = [
        dict(mp=None, reshard=True, accum=2, dim=10, mesh_kind="hsdp"),
        # the post-forward shard of a bytes all-gather with padding, rebuilt from the unsharded
        # parameters after the forward and gathered again within 2 ranks in the backward
        dict(mp=None, reshard=2, accum=2, dim=7),
        dict(mp="bf16", reshard=2, accum=1, dim=7),
    ]
    run_grid(configs, _check, name="mixed-ws4")


def test_mixed_dtypes_hsdp_and_int_reshard():
    run_distributed(_grid_ws4, 4)


def _mixed_grads() -> None:
    impl = load_impl()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Model(dim=8, n=1, trainable_base=True)
    impl.fully_shard(model.blocks[0], mesh=mesh)
    impl.fully_shard(model, mesh=mesh)
    raises_exactly(
        ValueError,
        "fsdp_native: unit 'blocks.0' has gradients of dtypes ['torch.bfloat16', 'torch.float32'], expected one dtype "
        "per unit (as torch FSDP2); set mp_policy.param_dtype (one unsharded dtype) or mp_policy.reduce_dtype",
        lambda: model(torch.randn(3, 4)).sum().backward(),
    )


def test_mixed_gradient_dtypes_raise():
    if load_impl().name != "fsdp_native":
        pytest.skip("fsdp_native's own error message")
    run_distributed(_mixed_grads, 2)


def _aligned(mp: str | None) -> None:
    """Every unsharded parameter starts 64-byte aligned, as a tensor of its own (torch FSDP2's)
    would: some CPU kernels sum in an address-dependent order (an fp32 Linear with one output
    row on AMD EPYC), so views at any offset would not give torch's numbers bit for bit."""
    impl = load_impl()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Model(dim=7)
    kw = dict(mesh=mesh)
    if mp == "bf16":
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    seen = []

    def hook(mod, args):
        for n, p in mod.named_parameters(recurse=False):
            seen.append((f"{type(mod).__name__}.{n}", p.data_ptr() % 64))

    for m in model.modules():
        m.register_forward_pre_hook(hook)
    model(torch.randn(3, 4)).float().sum().backward()
    assert len(seen) == len(list(model.parameters())), seen
    assert all(r == 0 for _, r in seen), [s for s in seen if s[1]]


def _aligned_grid():
    run_grid([dict(mp=None), dict(mp="bf16")], _aligned, name="aligned")


def test_unsharded_params_aligned_ws2():
    run_distributed(_aligned_grid, 2)


def test_unsharded_params_aligned_ws1():
    run_distributed(_aligned_grid, 1)
