"""``shard_placement_fn`` returning ``Shard(d)`` with d > 0, as torchtitan shards MoE experts
(``Shard(1)`` when there are fewer experts than FSDP ranks): each such parameter's local shard
is its contiguous chunk of dim d, its DTensor placement ``Shard(d)``, and the runtime gathers
and reduces it with one strided copy. The losses, parameters, placements and local shapes
are torch FSDP2's, bit for bit; across libraries the checkpoints load both ways.

The Transformer grids of tests/test_fully_shard_parity.py (``Cfg.shard_dim``) cover the
runtime features (mixed precision, accumulation, offload, meta init, HSDP, ...); here: 3-D
expert weights, units of several dtypes, tensor-subclass (torchao NF4) weights beside
dim-1 adapters, torchao's MoE training weights (torchtitan's float8 grouped-GEMM experts)
sharded on dims 1 and -1 themselves and built on the meta device, an int ``reshard_after_forward`` (which torch 2.11-2.15 cannot run with a dim
other than 0), fsdp_native's quantized all-gather (dim-d parameters travel unquantized),
dtype conversion after ``fully_shard``, and checkpoints.
"""
from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dist_utils import assert_close, full, full_params, load_impl, placements_of, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, train_steps

EXACT = dict(rtol=0, atol=0)


class Experts(nn.Module):
    """torchtitan's GroupedExperts shape: 3-D weights, experts on dim 0."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) * 0.1)
        self.w3 = nn.Parameter(torch.randn(n_experts, dim, hidden) * 0.1)

    def forward(self, x, weights):
        # Every token through every expert, mixed by the router's weights (dense MoE).
        w1, w2, w3 = (w.to(x.dtype) for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch.einsum("td,edh->eth", x, w1)) * torch.einsum("td,edh->eth", x, w3)
        out = torch.einsum("eth,ehd->etd", h, w2)
        return torch.einsum("etd,te->td", out, weights.to(x.dtype))


class MoEBlock(nn.Module):
    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden)

    def forward(self, x):
        h = self.norm(x)
        return x + self.experts(h, torch.softmax(self.router(h).float(), dim=-1))


class MoE(BlockStack):
    def __init__(self, n_experts=2, dim=8, hidden=12, n=2):
        super().__init__(lambda: MoEBlock(n_experts, dim, hidden), dim, n)


def experts_fn(dim: int, ws: int):
    """torchtitan's rule: experts sharded on dim `dim` when there are fewer of them than ranks."""

    def fn(p):
        if p.dim() == 3 and p.shape[0] < ws:
            return Shard(dim)
        return None

    return fn


def _train(model, steps: int = 3, accum: int = 1) -> dict:
    losses = train_steps(model, steps, accum)
    # The parameters (frozen tensor-subclass weights aside: torchao's NF4 cannot be cloned whole).
    params = {n: full(p) for n, p in model.named_parameters() if type(p.to_local()) is torch.Tensor}
    return dict(losses=losses, params=params)


def _compare(what: str, a: dict, b: dict) -> None:
    assert_close(f"{what}: losses", a["losses"], b["losses"], EXACT)
    assert a["params"].keys() == b["params"].keys()
    for n in b["params"]:
        assert_close(f"{what}: {n}", a["params"][n], b["params"][n], EXACT)


# --- MoE experts -----------------------------------------------------------------------------
def _ao_experts(model) -> None:
    """torchtitan's float8 grouped-GEMM converter (``quantize.grouped_mm.float8``): torchao's
    ``Float8TrainingOpConfig`` wraps each expert weight in a ``Float8TrainingWeightWrapperTensor``,
    whose all-gather extension gathers its data in the compute dtype. (Its fp8 grouped GEMM
    needs CUDA; these experts' einsums run through the wrapper as plain ops.)"""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda mod, fqn: isinstance(mod, Experts))
    kinds = {type(e.w1.data).__name__ for e in model.modules() if isinstance(e, Experts)}
    assert kinds == {"Float8TrainingWeightWrapperTensor"}, kinds


def _moe(impl, mesh, dim: int, mp: bool, reshard, accum: int, n_experts: int = 2, ao: bool = False, meta: bool = False) -> dict:
    """``meta``: torchtitan's initialisation: built (and converted) on the meta device, sharded,
    ``to_empty``, then every parameter filled from a seeded full tensor."""
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = MoE(n_experts=n_experts)
    if ao:
        _ao_experts(model)
    ws = mesh.size(mesh.ndim - 1)
    kw = dict(mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=experts_fn(dim, ws))
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        impl.fully_shard(b.experts, **kw)  # torchtitan: the experts a unit of their own
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    if meta:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(distribute_tensor(torch.randn(p.shape) * 0.1, p.device_mesh, p.placements))
    res = _train(model, accum=accum)
    res["placements"] = placements_of(model)
    res["locals"] = {n: (type(p.to_local()).__name__, tuple(p.to_local().shape)) for n, p in model.named_parameters()}
    if ao:  # the wrapped experts' full values (_train keeps plain parameters only)
        res["params"].update({n: full(p).float() for n, p in model.named_parameters() if n.endswith((".w1", ".w2", ".w3"))})
    return res


def check_moe(dim: int, mp: bool = False, reshard=True, accum: int = 1, hsdp: bool = False, n_experts: int = 2, ao: bool = False,
              meta: bool = False) -> None:  # fmt: skip
    """``ao``: the expert weights are torchao's MoE training subclass (:func:`_ao_experts`),
    sharded on dim `dim` by their all-gather extension. ``meta``: see :func:`_moe` (the
    experts' unit then holds subclass parameters only)."""
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("r", "s")) if hsdp else init_device_mesh("cpu", (ws,))
    impl, torch_impl = load_impl(), ref_impl()
    b = _moe(torch_impl, mesh, dim, mp, reshard, accum, n_experts, ao, meta)
    a = _moe(impl, mesh, dim, mp, reshard, accum, n_experts, ao, meta)
    assert a["placements"] == b["placements"], f"{a['placements']} vs torch {b['placements']}"
    assert a["locals"] == b["locals"], f"{a['locals']} vs torch {b['locals']}"
    if ao:
        assert a["locals"]["blocks.0.experts.w1"][0] == "Float8TrainingWeightWrapperTensor", a["locals"]
    want = f"Shard(dim={dim % 3})" if n_experts < mesh.size(mesh.ndim - 1) else "Shard(dim=0)"
    assert want in a["placements"]["blocks.0.experts.w1"], a["placements"]
    _compare(f"[{impl.name} vs torch] MoE Shard({dim})", a, b)


def _moe_grid():
    ws = dist.get_world_size()
    if ws == 4:
        configs = [dict(dim=1), dict(dim=2, mp=True, reshard=False), dict(dim=-1, accum=2)]
        configs += [dict(dim=1, hsdp=True, mp=True, n_experts=1)]  # HSDP: 2 shard ranks
        # torchao's MoE training weights, on dim 1 (bf16 compute) and dim -1 (fp32, accumulation)
        configs += [dict(dim=1, mp=True, ao=True, reshard=False), dict(dim=-1, accum=2, ao=True), dict(dim=1, mp=True, ao=True, meta=True)]
    else:
        configs = [dict(dim=1, mp=True, accum=2)]  # 2 experts, 2 ranks: dim 0, as torchtitan
        configs += [dict(dim=1, mp=True, ao=True, meta=True)]  # the same, torchao's experts from the meta device
    run_grid(configs, check_moe, name=f"moe-ws{ws}")


def test_moe_experts_sharded_on_dim_1_match_torch():
    run_distributed(_moe_grid, 4, timeout=400)


# --- int reshard_after_forward ---------------------------------------------------------------
def check_int_reshard() -> None:
    """reshard_after_forward=2 on 4 ranks: the backward gathers dim-1 chunks within the group
    of 2. torch 2.11 to 2.15 raise in their copy-out (``post_param_size[shard_dim]``: IndexError) with
    a dim other than 0, so fsdp_native is compared with torch at reshard_after_forward=True,
    which gives the same numbers (resharding moves no arithmetic)."""
    mesh = init_device_mesh("cpu", (4,))
    impl, torch_impl = load_impl(), ref_impl()
    if impl.name == torch_impl.name:
        with pytest.raises(IndexError):
            _moe(impl, mesh, 1, False, 2, 1)
        return
    for mp in (False, True):
        _compare(f"[{impl.name} reshard 2 vs torch reshard True]", _moe(impl, mesh, 1, mp, 2, 1), _moe(torch_impl, mesh, 1, mp, True, 1))


# --- units of several dtypes, torchao NF4 weights beside dim-1 adapters --------------------------
class LoRA(nn.Module):
    def __init__(self, d_in: int, d_out: int, base_dtype):
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False, dtype=base_dtype)
        self.base.weight.requires_grad_(False)
        self.a = nn.Linear(d_in, 4, bias=False)
        self.b = nn.Linear(4, d_out, bias=False)
        nn.init.normal_(self.b.weight, std=0.05)

    def forward(self, x):
        return self.base(x.to(self.base.weight.dtype)).to(x.dtype) + self.b(self.a(x))


class LoRAModel(nn.Module):
    def __init__(self, base_dtype=torch.bfloat16, dim=8):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(LoRA(dim, dim, base_dtype) for _ in range(2))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.out(h)


def _dim1(p):
    return Shard(1) if p.dim() == 2 and p.shape[1] % dist.get_world_size() == 0 else None


def _trainable_dim1(p):
    return _dim1(p) if p.requires_grad else None


def _lora_model(base: str) -> LoRAModel:
    torch.manual_seed(0)
    model = LoRAModel(base_dtype=torch.bfloat16, dim=64 if base == "nf4" else 8)
    if base == "nf4":  # torchtune's QLoRA: frozen NF4 base weights (dim 0), adapters on dim 1
        from torchao.quantization import to_nf4

        for b in model.blocks:
            b.base.weight = nn.Parameter(to_nf4(b.base.weight.detach(), 32, 2), requires_grad=False)
    return model


def _lora(impl, base: str, reshard: bool) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _lora_model(base)
    # bf16: the frozen base weights on dim 1 too (a unit of bf16 and fp32 parameters: bytes).
    kw = dict(mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=_trainable_dim1 if base == "nf4" else _dim1)
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    res = _train(model)
    res["placements"] = placements_of(model)
    return res


def check_lora(base: str, reshard: bool) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    b, a = _lora(torch_impl, base, reshard), _lora(impl, base, reshard)
    assert a["placements"] == b["placements"], f"{a['placements']} vs torch {b['placements']}"
    assert "Shard(dim=1)" in a["placements"]["blocks.0.a.weight"], a["placements"]
    assert ("Shard(dim=0)" if base == "nf4" else "Shard(dim=1)") in a["placements"]["blocks.0.base.weight"], a["placements"]
    _compare(f"[{impl.name} vs torch] {base} base, adapters on dim 1", a, b)
    if base == "nf4" and impl.name == "fsdp_native":  # torchao's NF4 cannot be chunked on dim 1
        model = _lora_model(base)
        raises_exactly(
            NotImplementedError,
            "fully_shard: argument 'shard_placement_fn' returned Shard(1) for parameter 'base.weight', a NF4Tensor "
            "gathered by its fsdp_pre_all_gather, which cannot be split on dim 1: NotImplementedError: "
            "aten.split(NF4Tensor, dim=1)",
            lambda: impl.fully_shard(model.blocks[0], shard_placement_fn=_dim1),
        )


# --- fsdp_native's quantized all-gather: dim-d parameters travel unquantized --------------------
def check_quantized(fmt: str) -> None:
    """fp8 or NF4 all-gather in units where the small adapters are sharded on dim 1 (not
    quantized either way: min_numel) and the base weights on dim 0: the same numbers as with
    every parameter on dim 0 (2 ranks: the sums do not depend on where an element sits)."""
    impl = load_impl()
    if impl.name != "fsdp_native":  # the quantized all-gather is fsdp_native's own
        return
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def adapters_dim1(p):
        return Shard(1) if p.dim() == 2 and p.numel() < 1024 and p.shape[1] % dist.get_world_size() == 0 else None

    def run(fn):
        torch.manual_seed(0)
        model = LoRAModel(base_dtype=torch.float32, dim=64)
        kw = dict(mesh=mesh, shard_placement_fn=fn, all_gather=impl.module.QuantizedAllGather(fmt, min_numel=1024))
        seen = {}
        for i, b in enumerate(model.blocks):
            impl.fully_shard(b, **kw)
            b.register_forward_pre_hook(functools.partial(record, seen, i))
        impl.fully_shard(model, mesh=mesh, shard_placement_fn=fn)
        full_a = [b.a.weight.full_tensor() for b in model.blocks]
        full_base = [b.base.weight.full_tensor() for b in model.blocks]
        res = _train(model)
        for i in range(2):  # the first forward: the adapter exact, the base weight quantized
            assert torch.equal(seen[i][0], full_a[i]), f"block {i}: the dim-1 adapter must be gathered unquantized"
            assert not torch.equal(seen[i][1], full_base[i]), f"block {i}: the base weight must be gathered {fmt}"
        res["placements"] = placements_of(model)
        return res

    def record(seen, i, m, args):  # a unit's own pre-hook has run: the parameters are unsharded
        if i not in seen:
            seen[i] = (m.a.weight.detach().clone(), m.base.weight.detach().clone())

    dim1, dim0 = run(adapters_dim1), run(None)
    assert "Shard(dim=1)" in dim1["placements"]["blocks.0.a.weight"], dim1["placements"]
    _compare(f"{fmt} all-gather, adapters on dim 1 vs on dim 0", dim1, dim0)


# --- dtype conversion after fully_shard, checkpoints ----------------------------------------
def check_convert_after_shard() -> None:
    """Accelerate 1.6-1.12's upcast after fully_shard of a bf16 model: the unit is laid out
    again with the same shard dims."""
    impl, torch_impl = load_impl(), ref_impl()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def run(impl):
        torch.manual_seed(0)
        model = LoRAModel(base_dtype=torch.float32).to(torch.bfloat16)
        kw = dict(mesh=mesh, shard_placement_fn=_dim1)
        for b in model.blocks:
            impl.fully_shard(b, **kw)
        impl.fully_shard(model, **kw)
        model.to(torch.float32)
        res = _train(model)
        res["placements"] = placements_of(model)
        return res

    a, b = run(impl), run(torch_impl)
    assert a["placements"] == b["placements"], f"{a['placements']} vs torch {b['placements']}"
    _compare(f"[{impl.name} vs torch] bf16 model upcast after fully_shard", a, b)


def check_checkpoint_across_libraries() -> None:
    """A DCP checkpoint of a model with dim-1 shards, saved by one library, loaded by the
    other (and by a model sharded on dim 0 only): the parameters are the saved ones, and
    training goes on as in the library that saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    impl, torch_impl = load_impl(), ref_impl()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build(impl, fn=_dim1, seed=0):
        torch.manual_seed(seed)
        model = MoE(n_experts=2, dim=8)
        for b in model.blocks:
            impl.fully_shard(b, mesh=mesh, shard_placement_fn=fn)
        impl.fully_shard(model, mesh=mesh, shard_placement_fn=fn)
        return model

    path = tempfile.mkdtemp(prefix="shard_dim_ckpt_") if dist.get_rank() == 0 else None
    holder = [path]
    dist.broadcast_object_list(holder)
    path = holder[0]
    for saver, loader, fn in ((impl, torch_impl, _dim1), (torch_impl, impl, _dim1), (impl, impl, None)):
        src = build(saver)
        _train(src, steps=2)
        ckpt = os.path.join(path, f"{saver.name}-{loader.name}-{fn is None}")
        dcp.save(get_model_state_dict(src), checkpoint_id=ckpt)
        dst = build(loader, fn, seed=1)
        sd = get_model_state_dict(dst)
        dcp.load(sd, checkpoint_id=ckpt)
        set_model_state_dict(dst, sd)
        what = f"saved by {saver.name}, loaded by {loader.name}{' on dim 0' if fn is None else ''}"
        for n, v in full_params(src).items():
            assert_close(f"{what}: {n}", full_params(dst)[n], v, EXACT)
        _compare(what, _train(dst, steps=2), _train(src, steps=2))


def check_shard_placement_result() -> None:
    """torch 2.13+'s ShardPlacementResult: on the unit's own mesh, as Shard(d) (other meshes:
    tests/test_per_param_mesh.py); a mesh_info that is neither a 1-D FSDP nor a 2-D HSDP one
    raises NotImplementedError."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    except ImportError:  # torch before 2.13 has no such result
        import torch.distributed.fsdp._fully_shard._fsdp_common as common

        assert not hasattr(common, "ShardPlacementResult")
        return
    impl, torch_impl = load_impl(), ref_impl()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def run(impl, mesh_info):  # one FSDPMeshInfo object for every parameter (torch wants one per process group)
        def fn(p):
            return ShardPlacementResult(_dim1(p), mesh_info)

        model = _lora_model("bf16")
        for b in model.blocks:
            impl.fully_shard(b, mesh=mesh, shard_placement_fn=fn)
        impl.fully_shard(model, mesh=mesh, shard_placement_fn=fn)
        res = _train(model)
        res["placements"] = placements_of(model)
        return res

    a, b = run(impl, FSDPMeshInfo(mesh, shard_mesh_dim=0)), run(torch_impl, FSDPMeshInfo(mesh, shard_mesh_dim=0))
    assert a["placements"] == b["placements"], f"{a['placements']} vs torch {b['placements']}"
    _compare(f"[{impl.name} vs torch] ShardPlacementResult on the unit's mesh", a, b)
    if impl.name == "fsdp_native":
        other = init_device_mesh("cpu", (1, dist.get_world_size()))
        raises_exactly(
            NotImplementedError,
            "fully_shard: argument 'shard_placement_fn' returned a ShardPlacementResult for parameter 'base.weight' on "
            "a 2-D mesh with shard_mesh_dim=1 and replicate_mesh_dim=None; fsdp_native takes FSDPMeshInfo(mesh, "
            "shard_mesh_dim=0) on a 1-D mesh or HSDPMeshInfo(mesh, replicate_mesh_dim=0, shard_mesh_dim=1) on a 2-D one",
            lambda: impl.fully_shard(
                _lora_model("bf16").blocks[0], mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(None, FSDPMeshInfo(other, shard_mesh_dim=1))
            ),
        )


CASES = {
    "shard_placement_result": check_shard_placement_result,
    "int_reshard": check_int_reshard,
    "lora_bf16_base": lambda: check_lora("bf16", True),
    "lora_bf16_base_no_reshard": lambda: check_lora("bf16", False),
    "quantized_fp8_rowwise": lambda: check_quantized("fp8_rowwise"),
    "quantized_nf4": lambda: check_quantized("nf4"),
    "convert_after_shard": check_convert_after_shard,
    "checkpoint_across_libraries": check_checkpoint_across_libraries,
}


def _case(name: str) -> None:
    CASES[name]()


def _grid_ws2():
    run_grid([dict(name=n) for n in CASES if n != "int_reshard"], _case, name="shard-dim-ws2")


def _grid_nf4():
    run_grid([dict(base="nf4", reshard=True)], check_lora, name="shard-dim-nf4")


def _grid_ws4():
    run_grid([dict(name="int_reshard")], _case, name="shard-dim-ws4")


def test_shard_dim_1_features_match_torch():
    run_distributed(_grid_ws2, 2, timeout=400)


def test_shard_dim_1_beside_torchao_nf4_weights():
    pytest.importorskip("torchao", reason="torchao is a test dependency (make test installs it)")
    run_distributed(_grid_nf4, 2, timeout=300)


def test_shard_dim_1_with_int_reshard_after_forward():
    run_distributed(_grid_ws4, 4, timeout=300)


def test_moe_experts_ws2():
    run_distributed(_moe_grid, 2, timeout=300)
