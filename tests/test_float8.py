"""torchao Float8 training (``convert_to_float8_training`` with
``enable_fsdp_float8_all_gather=True`` and ``precompute_float8_dynamic_scale_for_fsdp``) on
fsdp_native against torch FSDP2, on CPU: torch's CPU ``_scaled_mm`` runs the fp8 matmuls.

The weights travel as float8 bytes through torchao's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``); fsdp_native packs the fp8 inner tensors
of every Float8Linear of a unit into its one all-gather. Losses and parameters are bit for bit
torch FSDP2's at world size 1, 2 and HSDP 2x2, with and without the precomputed scales and
with bf16 mixed precision; the all-gather bytes are the fp8 sizes.

With tensor parallelism (torchtitan's Float8 + TP + FSDP, 2 x 2 ranks): torchao's Float8 TP
styles make each Float8 weight a DTensor over TP whose local tensor keeps the extension, which
fsdp_native gathers over the data-parallel mesh. Losses, parameters and placements bit for bit
torch FSDP2's, with and without sequence parallelism (a replicated norm in the unit); such a
weight refuses a shard dim other than 0.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from dist_utils import assert_close, full, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import mesh_of

pytest.importorskip("torchao", reason="torchao is a test dependency (make test installs it)")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: E402
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel  # noqa: E402

EXACT = dict(rtol=0, atol=0)
DIM, HIDDEN = 64, 128


class Block(nn.Module):
    def __init__(self, norm_last: bool = False):
        super().__init__()
        if not norm_last:
            self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.fc2 = nn.Linear(HIDDEN, DIM, bias=False)
        if norm_last:  # plain parameters after the Float8 ones in the unit's order
            self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, n=3, norm_last: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(norm_last) for _ in range(n))
        self.head = nn.Linear(DIM, 16)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _parallelize(model: Model, tp_mesh, sp: bool) -> None:
    """torchtitan's Float8 tensor parallelism: fc1 column-wise and fc2 row-wise with torchao's
    Float8 styles (the Float8 weights become DTensors over TP whose local tensors keep their
    all-gather extensions). With sequence parallelism (`sp`), the norm's input and the block's
    output are sharded on the sequence dim, the norm's weights replicated over TP (their
    gradients partial sums, reduced over TP). The activations move between the layouts in their
    own dtype: torchao's Float8 styles would move them as fp8 (``PrepareFloat8ModuleInput``,
    ``input_layouts=Shard(1)``, ``output_layouts=Shard(1)``), which gloo cannot gather
    ("Invalid scalar type", with torch FSDP2 too)."""
    for b in model.blocks:
        parallelize_module(b, tp_mesh, {"fc1": Float8ColwiseParallel(), "fc2": Float8RowwiseParallel()})
        if sp:
            parallelize_module(b, tp_mesh, {"norm": SequenceParallel(use_local_output=False)})
            parallelize_module(b, tp_mesh, {
                "norm": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False),
                "fc2": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            })  # fmt: skip


def _train(
    impl,
    hsdp: bool,
    precompute: bool,
    mp: bool,
    offload: bool = False,
    compile: bool = False,
    norm_last: bool = False,
    steps: int = 4,
    tp: str | None = None,
) -> dict:
    if tp:  # 2 data-parallel ranks x 2 TP ranks; "sp": with sequence parallelism
        full_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh = full_mesh["dp"]
    else:
        mesh = mesh_of("hsdp" if hsdp else "1d")
    torch.manual_seed(0)
    model = Model(norm_last=norm_last)
    cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    # The head stays in high precision, as torchtitan does for the output layer.
    convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, fqn: fqn != "head")
    if tp:
        _parallelize(model, full_mesh["tp"], tp == "sp")
    kw = dict(mesh=mesh)
    if offload:
        kw["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=False)
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    counters.clear()
    for b in model.blocks:
        if compile:  # torchtitan's order: each block compiled, then sharded
            b.compile()
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # With TP, the TP ranks of a data-parallel rank share its batch (with sequence
    # parallelism, each takes its part of the sequence).
    gen = torch.Generator().manual_seed(mesh.get_local_rank() if tp else dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, DIM, generator=gen) if tp else torch.randn(32, DIM, generator=gen)
        if tp == "sp":
            x = x.chunk(2, dim=1)[full_mesh["tp"].get_local_rank()]
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    if compile:
        assert counters["stats"]["unique_graphs"] >= 1, f"{impl.name}: nothing was compiled: {dict(counters['stats'])}"
    params = {n: full(p) for n, p in model.named_parameters()}
    layouts = {
        n: (p.device_mesh.mesh_dim_names, tuple(p.placements), type(p._local_tensor).__name__) for n, p in model.named_parameters()
    }
    return dict(losses=losses, params=params, layouts=layouts, model=model)


def _check(
    hsdp: bool, precompute: bool, mp: bool, offload: bool = False, compile: bool = False, norm_last: bool = False, tp: str | None = None
) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    ref = _train(torch_impl, hsdp, precompute, mp, offload, compile, norm_last, tp=tp)
    got = _train(impl, hsdp, precompute, mp, offload, compile, norm_last, tp=tp)
    tag = f"[{impl.name} vs torch, Float8 hsdp={hsdp} precompute={precompute} mp={mp} offload={offload} compile={compile} norm_last={norm_last} tp={tp}]"
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    assert got["layouts"] == ref["layouts"], (got["layouts"], ref["layouts"])
    for n, v in ref["params"].items():
        assert_close(f"{tag} param {n!r}", got["params"][n], v, EXACT)
    if tp == "tp" and impl.name == "fsdp_native":  # a Float8 local tensor is chunked on dim 0 only
        model = Model()
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _parallelize(model, mesh["tp"], sp=False)
        raises_exactly(
            NotImplementedError,
            "fully_shard: argument 'shard_placement_fn' returned Shard(1) for parameter 'fc1.weight', a "
            "WeightWithDynamicFloat8CastTensor gathered by its fsdp_pre_all_gather; fsdp_native shards tensor-parallel "
            "tensor-subclass parameters on dim 0 only",
            lambda: impl.fully_shard(model.blocks[0], mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(p.ndim - 1)),
        )
    if tp:  # the Float8 weights stay Float8 subclasses inside DTensors over dp x tp
        fc1 = (("dp", "tp"), (_StridedShard(0, split_factor=2), Shard(0)), "WeightWithDynamicFloat8CastTensor")
        norm = (("dp", "tp"), (Shard(0), Replicate()), "Tensor") if tp == "sp" else (("dp",), (Shard(0),), "Tensor")
        assert ref["layouts"]["blocks.0.fc1.weight"] == fc1 and ref["layouts"]["blocks.0.norm.weight"] == norm, ref["layouts"]
    if impl.name == "fsdp_native" and dist.get_world_size() > 1:
        import fsdp_native

        model = got["model"]
        x = torch.randn(4, 8 // (2 if tp == "sp" else 1), DIM) if tp else torch.randn(32, DIM)
        with fsdp_native.record_trace() as rec:
            model(x).sum().backward()
        per_unit = rec.bytes_summary()[0]["blocks.0"]
        # fc1 and fc2 as fp8 (one byte per weight; with TP each TP rank's part), the
        # LayerNorm in its own dtype; an all-gather in the forward and again in the backward
        # (resharded after forward).
        fp8_bytes = 2 * DIM * HIDDEN // (2 if tp else 1)
        norm_bytes = 2 * DIM * (2 if mp else 4)
        assert per_unit["all_gather"] <= 2 * (fp8_bytes + norm_bytes + 256), per_unit


def _grid(hsdp_ok: bool) -> None:
    configs = [dict(hsdp=False, precompute=p, mp=m) for p in (False, True) for m in (False, True)]
    configs += [dict(hsdp=False, precompute=True, mp=True, norm_last=True)]
    if hsdp_ok:
        configs += [dict(hsdp=True, precompute=True, mp=False)]
        # torchtitan's Float8 + tensor parallelism + FSDP's fp8 all-gather, on a 2 x 2 mesh
        configs += [dict(hsdp=False, precompute=True, mp=True, tp="tp"), dict(hsdp=False, precompute=False, mp=False, tp="sp")]
    elif dist.get_world_size() > 1:
        configs += [dict(hsdp=False, precompute=True, mp=True, offload=True), dict(hsdp=False, precompute=True, mp=True, compile=True)]
    run_grid(configs, _check, name="float8")


def test_float8_parity_world_size_1():
    run_distributed(_grid, 1, False)


def test_float8_parity_world_size_2():
    run_distributed(_grid, 2, False)


def test_float8_parity_hsdp_2x2():
    run_distributed(_grid, 4, True, timeout=360)
