"""torch FSDP2's all-gather extension protocol, with torchao's NF4 weights (QLoRA: frozen
NF4 base weights, trainable low-rank adapters, fp32 norms, all in one unit per block).

fsdp_native and torch FSDP2 train the same model in the same process: the losses and the
trainable parameters are bit for bit equal, the NF4 shards are untouched, and each unit is
one all-gather per forward (the NF4 inner tensors and the plain shards packed as bytes).
Bad extension tensors get clear errors.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

from dist_utils import assert_close, full, grid, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import mesh_of

pytest.importorskip("torchao", reason="torchao is a test dependency (make test installs it)")
from torchao.quantization import to_nf4  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4  # noqa: E402

EXACT = dict(rtol=0, atol=0)
DIM = 64


class NF4Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int):
        super().__init__()
        w = torch.randn(d_out, d_in, dtype=torch.bfloat16) * 0.1
        self.weight = nn.Parameter(to_nf4(w, block_size=32, scaler_block_size=32), requires_grad=False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.05)

    def forward(self, x):
        return linear_nf4(x.to(torch.bfloat16), self.weight).to(x.dtype) + self.lora_b(self.lora_a(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = NF4Linear(DIM, DIM, 4)

    def forward(self, x):
        return x + torch.tanh(self.proj(self.norm(x)))


class Model(nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(impl, mp: bool, reshard: bool, hsdp: bool = False, offload: bool = False, compile: bool = False) -> dict:
    mesh = mesh_of("hsdp" if hsdp else "1d")
    torch.manual_seed(0)
    model = Model()
    kw = dict(mesh=mesh, reshard_after_forward=reshard)
    if offload:  # torchtune's QLoRA with fsdp_cpu_offload (no pinning: no GPU here)
        kw["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=False)
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    counters.clear()
    for b in model.blocks:
        if compile:  # torchtune's compile=True: each layer compiled, then sharded
            b.compile()
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    nf4_locals = [b.proj.weight.to_local() for b in model.blocks]
    for t in nf4_locals:  # a shard owns its bytes: no view keeping the unsharded NF4 tensor alive
        for name in ("quantized_data", "quantized_scalers", "quantization_factor"):
            inner = getattr(t, name)
            held, own = inner.untyped_storage().nbytes(), inner.numel() * inner.element_size()
            assert held == own, f"{impl.name}: the NF4 shard's {name} keeps {held} bytes of storage for its {own}"
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randn(4, DIM, generator=gen)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if compile:
        assert counters["stats"]["unique_graphs"] >= 1, f"{impl.name}: nothing was compiled: {dict(counters['stats'])}"
    params = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    dequant = [t.get_original_weight() for t in nf4_locals]
    return dict(losses=losses, params=params, nf4=dequant, model=model)


def _check(mp: bool, reshard: bool, hsdp: bool = False, offload: bool = False, compile: bool = False) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    ref = _train(torch_impl, mp, reshard, hsdp, offload, compile)
    got = _train(impl, mp, reshard, hsdp, offload, compile)
    tag = f"[{impl.name} vs torch, NF4 QLoRA mp={mp} hsdp={hsdp} offload={offload} compile={compile}]"
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    for n, v in ref["params"].items():
        assert_close(f"{tag} param {n!r}", got["params"][n], v, EXACT)
    for a, b in zip(got["nf4"], ref["nf4"]):
        assert_close(f"{tag} NF4 shard", a, b, EXACT)
    if impl.name == "fsdp_native" and not hsdp:
        import fsdp_native

        model = got["model"]
        x = torch.randn(4, DIM)
        with fsdp_native.record_trace() as rec:
            model(x).sum().backward()
        per_unit = rec.bytes_summary()[0]["blocks.0"]
        # NF4: 4 bits per weight plus block scales; LoRA and norm in their unsharded dtype.
        bf16_bytes = DIM * DIM * 2
        assert per_unit["all_gather"] < (2 if reshard else 1) * (bf16_bytes * 0.35 + 3 * DIM * 4 * 4), per_unit


def _grid():
    run_grid(
        [dict(mp=False, reshard=True), dict(mp=True, reshard=True), dict(mp=True, reshard=False), dict(mp=True, reshard=True, offload=True),
         dict(mp=True, reshard=True, compile=True)],
        _check,
        name="nf4",
    )


def test_nf4_qlora_parity_world_size_2():
    run_distributed(_grid, 2)


def _grid_hsdp():
    run_grid([dict(mp=True, reshard=True, hsdp=True)], _check, name="nf4-hsdp")


def test_nf4_qlora_parity_hsdp_2x2():
    run_distributed(_grid_hsdp, 4, timeout=360)


def _train_upcast(impl) -> dict:
    """A bf16 model with an NF4 weight, sharded, then model.to(torch.float32) before the first
    forward (Accelerate's upcast): torchao's NF4 tensor dequantizes into a plain fp32 one, and
    torch FSDP2 then gathers it as a plain parameter; so must fsdp_native."""
    mesh = mesh_of("1d")
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, 1)).to(torch.bfloat16)
    model[1].weight = nn.Parameter(to_nf4(model[1].weight.detach(), 32, 32), requires_grad=False)
    impl.fully_shard(model[1], mesh=mesh)
    impl.fully_shard(model, mesh=mesh)
    model.to(torch.float32)
    local = model[1].weight.to_local()
    assert type(local) is torch.Tensor and local.dtype == torch.float32, f"{impl.name}: {type(local).__name__} {local.dtype}"
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, DIM, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, params={n: full(p) for n, p in model.named_parameters()})


def _check_upcast() -> None:
    ref, got = _train_upcast(ref_impl()), _train_upcast(load_impl())
    assert_close("losses after the upcast", got["losses"], ref["losses"], EXACT)
    for n, v in ref["params"].items():
        assert_close(f"param {n!r} after the upcast", got["params"][n], v, EXACT)


def test_nf4_weight_upcast_after_fully_shard_matches_torch():
    run_distributed(_check_upcast, 2)


def _errors() -> None:
    import fsdp_native

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    lin = nn.Module()
    lin.weight = nn.Parameter(to_nf4(torch.randn(6, 64, dtype=torch.bfloat16), 32, 4), requires_grad=False)
    raises_exactly(
        ValueError,
        "fully_shard: parameter 'weight' of Module (NF4Tensor) has shape (6, 64); a tensor-subclass parameter with "
        "fsdp_pre_all_gather needs dim 0 divisible by the shard world size 4",
        lambda: fsdp_native.fully_shard(lin, mesh=mesh),
    )

    # A subclass whose fsdp_post_all_gather returns something else than (tensor, tensors to
    # free): a TypeError at the first unshard, on every rank (the subclass is the same on all).
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    mod = NF4Linear(DIM, DIM, 4)
    fsdp_native.fully_shard(mod, mesh=mesh)
    original = NF4Tensor.fsdp_post_all_gather

    def bad_post(self, outputs, metadata, param_dtype, *, out=None):
        return outputs[0]  # a bare tensor

    NF4Tensor.fsdp_post_all_gather = bad_post
    try:
        raises_exactly(
            TypeError,
            "fsdp_native: NF4Tensor.fsdp_post_all_gather returned Tensor, expected (unsharded tensor, tensors to free)",
            lambda: mod(torch.randn(2, DIM)),
        )
    finally:
        NF4Tensor.fsdp_post_all_gather = original


def test_extension_errors():
    if load_impl().name != "fsdp_native":
        pytest.skip("fsdp_native's own error messages")
    run_distributed(_errors, 4)


def _load_full_state_dict(model, full_sd: dict, offload: bool) -> None:
    """What torchtune's QLoRA recipe does after sharding a model built on the meta device: each
    NF4 weight is quantized again from the full bf16 weight and this rank's dim-0 chunk wrapped
    as a DTensor by hand, the other tensors are distributed; then load_state_dict(assign=True)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    sharded = {}
    for name, meta in model.state_dict().items():
        full_t = full_sd[name].to(meta.dtype)
        if isinstance(meta._local_tensor, NF4Tensor):
            mesh = meta.device_mesh
            local = torch.chunk(to_nf4(full_t, block_size=32, scaler_block_size=32), mesh.size(0), dim=0)[mesh.get_local_rank(0)]
            t = DTensor.from_local(local, mesh, meta.placements, run_check=False, shape=meta.shape, stride=meta.stride())
        else:
            t = distribute_tensor(full_t, meta.device_mesh, meta.placements)
        sharded[name] = nn.Parameter(t.cpu() if offload else t, requires_grad=meta.requires_grad)
    model.load_state_dict(sharded, assign=True)


def _full_state_dict(model) -> dict:
    """torchtune's full state dict of an NF4 model: each unit unsharded in turn, innermost
    first, its parameters read (NF4 dequantized), then resharded."""
    out = {}
    for prefix, module in reversed(list(model.named_modules())):
        if not hasattr(module, "unshard"):
            continue
        module.unshard()
        for name, p in module.named_parameters():
            fqn = f"{prefix}.{name}" if prefix else name
            if fqn not in out:
                out[fqn] = (p.get_original_weight() if hasattr(p, "get_original_weight") else p.detach()).clone()
        module.reshard()
    return out


def _train_torchtune_flow(impl, offload: bool) -> dict:
    mesh = mesh_of("1d")
    torch.manual_seed(0)
    full_sd = {n: (t.get_original_weight() if hasattr(t, "get_original_weight") else t.detach()) for n, t in Model().state_dict().items()}
    with torch.device("meta"):
        model = Model()
    kw = dict(mesh=mesh, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if offload:
        kw["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=False)
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    _load_full_state_dict(model, full_sd, offload)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, DIM, generator=gen)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, full=_full_state_dict(model))


def _check_torchtune_flow(offload: bool) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    ref = _train_torchtune_flow(torch_impl, offload)
    got = _train_torchtune_flow(impl, offload)
    tag = f"[{impl.name} vs torch, torchtune QLoRA flow offload={offload}]"
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    assert sorted(got["full"]) == sorted(ref["full"]), (sorted(got["full"]), sorted(ref["full"]))
    for n, v in ref["full"].items():
        assert_close(f"{tag} full state dict {n!r}", got["full"][n], v, EXACT)


def _grid_torchtune():
    run_grid([dict(offload=False), dict(offload=True)], _check_torchtune_flow, name="nf4-torchtune")


def test_nf4_qlora_torchtune_flow_world_size_2():
    """Meta-device model, fully_shard, the NF4 and plain weights loaded as sharded DTensors
    with assign=True, training, and the full state dict read by unsharding unit by unit."""
    run_distributed(_grid_torchtune, 2)


# --- torchao's quantized-training weights (prototype.quantized_training) ----------------------
#
# INT8 weight-only training, INT8 mixed-precision training and BitNet: trainable tensor
# subclasses whose fsdp_pre_all_gather returns two inner tensors (int8 data and scales, cast
# to the policy's param_dtype) and whose fsdp_post_all_gather ignores `out=` and views the
# gathered outputs; the optimizer updates the subclass in place (stochastic rounding for INT8).


def _local_inner(p) -> dict:
    t = p.to_local()
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return {name: getattr(t, name) for name in names}
    return {"": t}


def _train_ao(impl, recipe: str, mp: bool, reshard: bool) -> dict:
    from torchao import quantize_
    from torchao.prototype import quantized_training as qt

    config = {"int8": qt.int8_weight_only_quantized_training, "int8_mixed": qt.int8_mixed_precision_training, "bitnet": qt.bitnet_training}[recipe]
    mesh = mesh_of("1d")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    for i in (0, 2):
        quantize_(model[i], config())
    kw = dict(mesh=mesh, reshard_after_forward=reshard)
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in (0, 2, 4):
        impl.fully_shard(model[i], **kw)
    impl.fully_shard(model, **kw)
    kinds = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(100 + dist.get_rank())  # the INT8 weights' stochastic rounding draws from it
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(8, 32, generator=gen)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, kinds=kinds, params={n: _local_inner(p) for n, p in model.named_parameters()})


def _check_ao(recipe: str, mp: bool, reshard: bool) -> None:
    ref = _train_ao(ref_impl(), recipe, mp, reshard)
    got = _train_ao(load_impl(), recipe, mp, reshard)
    tag = f"[torchao {recipe} mp={mp} reshard={reshard}]"
    assert got["kinds"] == ref["kinds"] and "Tensor" not in (ref["kinds"]["0.weight"], ref["kinds"]["2.weight"]), (got["kinds"], ref["kinds"])
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    for n, inner in ref["params"].items():
        for name, v in inner.items():
            assert_close(f"{tag} {n} {name} (this rank's shard)", got["params"][n][name], v, EXACT)


def _check_ao_dim1() -> None:
    """These weights sharded on dim 1 (``shard_placement_fn``), which torch FSDP2 cannot run
    either: INT8's cannot be split there (fully_shard names the parameter and passes torchao's
    reason on), and BitNet's packed data does not hold a shard's elements (torch FSDP2 fails
    in its copy-out with "shape '[128, 16]' is invalid for input of size 512"; fsdp_native
    says why at the first all-gather, on every rank)."""
    from torch.distributed.tensor import Shard
    from torchao import quantize_
    from torchao.prototype import quantized_training as qt

    impl = load_impl()
    if impl.name != "fsdp_native":
        return
    dim1 = dict(shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    for recipe, config in (("int8", qt.int8_weight_only_quantized_training), ("bitnet", qt.bitnet_training)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        quantize_(model[0], config())
        if recipe == "int8":
            raises_exactly(
                NotImplementedError,
                "fully_shard: argument 'shard_placement_fn' returned Shard(1) for parameter 'weight', a "
                "Int8QuantizedTrainingLinearWeight gathered by its fsdp_pre_all_gather, which cannot be split on dim 1: "
                "NotImplementedError: Int8QTLinearWeight only supports split at dim=0",
                lambda: impl.fully_shard(model[0], **dim1),
            )
            continue
        impl.fully_shard(model[0], **dim1)
        impl.fully_shard(model)
        raises_exactly(
            NotImplementedError,
            "fsdp_native: parameter 'weight' of FSDPLinear is sharded on dim 1, and its fsdp_pre_all_gather returned "
            "all-gather inputs of shapes [(64, 4)]; a tensor-subclass parameter sharded on a dim other than 0 must "
            "gather tensors of its shard's 1024 elements (shape (64, 16))",
            lambda: model(torch.randn(4, 32)),
        )


def _grid_ao():
    run_grid(grid(recipe=["int8", "int8_mixed", "bitnet"], mp=[False, True], reshard=[True]) + [dict(recipe="int8", mp=True, reshard=False)], _check_ao, name="torchao-training")
    run_grid([{}], _check_ao_dim1, name="torchao-training on dim 1")


def test_torchao_quantized_training_parity_world_size_2():
    run_distributed(_grid_ao, 2)
