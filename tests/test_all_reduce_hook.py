"""``FSDPModule.set_all_reduce_hook``: the hook gets each unit's reduced flat gradient after
its reduce-scatter (after the all-reduce with HSDP), before the divide factor and the cast,
and may change it in place, as in torch FSDP2. The hook calls (how many, on which units, the
shapes, dtypes and values they saw), the losses and the parameters are torch's, bit for bit.
The usual use: FSDP over a shard group and a gradient all-reduce over another group in the
hook (replication the user wires up, e.g. across pipeline or data-loader groups).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from dist_utils import native_linear, assert_close, assert_same_run, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, train_steps

EXACT = dict(rtol=0, atol=0)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def _train(impl, kind: str, mp: bool, accum: int, frozen: bool, factor: float | None) -> dict:
    ws = dist.get_world_size()
    if kind == "manual_replicate":  # FSDP on the shard dim, the replicas all-reduced by the hook
        mesh2 = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        mesh, replicate = mesh2["shard"], mesh2["replicate"].get_group()
    else:
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard")) if kind == "hsdp" else init_device_mesh("cpu", (ws,))
        replicate = None
    torch.manual_seed(0)
    model = BlockStack(lambda: Block(6), 6, 3)
    if frozen:
        model.blocks[1].fc1.weight.requires_grad_(False)
    kw = dict(mesh=mesh)
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    calls = []

    def hook(name, g):
        calls.append((name, tuple(g.shape), str(g.dtype), g.detach().clone()))
        if replicate is not None:
            dist.all_reduce(g, group=replicate)  # SUM (gloo has no AVG)
            g.div_(2)
        else:
            g.mul_(0.5)

    for i, b in enumerate(model.blocks):
        impl.fully_shard(b, **kw)
        if i != 2:  # block 2 without a hook
            b.set_all_reduce_hook(lambda g, i=i: hook(f"blocks.{i}", g))
    impl.fully_shard(model, **kw)
    model.set_all_reduce_hook(lambda g: hook("root", g))
    if factor is not None:  # divided after the hook (sum-only reductions: gloo has no PREMUL_SUM)
        model.set_gradient_divide_factor(factor)
        for m in model.modules():
            if isinstance(m, impl.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    losses = train_steps(model, 2, accum, batch=5)  # each rank (each replica too) its own batch
    return dict(losses=losses, params=full_params(model), calls=calls)


def check(kind: str, mp: bool = False, accum: int = 1, frozen: bool = False, factor: float | None = None) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    b = _train(torch_impl, kind, mp, accum, frozen, factor)
    a = _train(impl, kind, mp, accum, frozen, factor)
    what = f"[{impl.name} vs torch] {kind}"
    assert [c[:3] for c in a["calls"]] == [c[:3] for c in b["calls"]], f"{what}: hook calls {[c[:3] for c in a['calls']]} vs {[c[:3] for c in b['calls']]}"
    assert len(a["calls"]) == 2 * 3, a["calls"]  # blocks 0, 1 and the root, one sync per step
    for i, ((name, *_, ga), (*_, gb)) in enumerate(zip(a["calls"], b["calls"])):
        assert_close(f"{what}: {name} reduced gradient given to the hook (call {i})", ga, gb, EXACT)
    assert_same_run(what, a, b)


def check_errors() -> None:
    m = native_linear()
    if m is None:  # the messages are fsdp_native's
        return
    raises_exactly(TypeError, "set_all_reduce_hook: argument 'hook' must be callable, got int", lambda: m.set_all_reduce_hook(3))
    hsdp = load_impl().fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2, dist.get_world_size() // 2)))
    raises_exactly(
        ValueError,
        "set_all_reduce_hook: argument 'stream' cannot be set when using native HSDP (a 2-D mesh)",
        lambda: hsdp.set_all_reduce_hook(lambda g: None, stream=object()),
    )


def _grid():
    configs = [
        dict(kind="fsdp"),
        dict(kind="fsdp", factor=3.0),
        dict(kind="fsdp", mp=True, accum=2, frozen=True),
        dict(kind="manual_replicate"),
        dict(kind="manual_replicate", mp=True, accum=2),
        dict(kind="hsdp", frozen=True, factor=5.0),
    ]
    run_grid(configs, check, name="all-reduce-hook")
    run_grid([{}], check_errors, name="all-reduce-hook-errors")


def test_all_reduce_hook_matches_torch():
    run_distributed(_grid, 4, timeout=300)
