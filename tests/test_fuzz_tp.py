"""Differential fuzzing of FSDP composed with tensor parallelism, against torch FSDP2
(hypothesis, as ``tests/test_fuzz.py``): 4 gloo ranks as a (dp 2, tp 2) mesh, random models
and TP plans; fsdp_native and torch.distributed.fsdp train the same model and must give the
same losses, the same placements and shapes, and every rank's local shards bit for bit
(``tests/test_tensor_parallel.py``'s comparison; bf16 included, as there).

Random per example (`TPSpec`): the width (2 to 9, odd ones included, so TP and FSDP shard
unevenly and FSDP gets ``_StridedShard`` placements), 1-3 blocks, each with its own hidden width
(even where TP shards it: DTensor.from_local takes the local sizes as even), a norm or
not, biases or not, and its plan: none, column/row-wise Linears, or sequence parallelism (the
norm on sequence shards, the block's input and output redistributed); each block a unit, a unit
with its ``w1`` nested as another, or in the root; reshard_after_forward per unit; fp32 or bf16
compute with fp32 reduction; 1 or 2 micro-batches without gradient sync but on the last; the
model built on the meta device and initialised after sharding, as torchtitan does.

    make test:  FSDP_FUZZ_TP_EXAMPLES=2, derandomized
    by hand:    FSDP_FUZZ_TP_EXAMPLES=100 (FSDP_FUZZ_SEED as in test_fuzz.py)
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, seed
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from dist_utils import load_impl, ref_impl, run_distributed
from test_fuzz import FUZZ_SEED, _settings, run_example
from test_tensor_parallel import _locals

TP_EXAMPLES = int(os.environ.get("FSDP_FUZZ_TP_EXAMPLES", "2"))
SEQ = 4  # divides the TP ranks: sequence parallelism shards it


@dataclasses.dataclass(frozen=True)
class TPBlockSpec:
    hidden: int
    norm: bool
    bias: bool
    plan: str  # "none" | "tp" | "sp"
    placement: str  # "root" | "unit" | "nested"
    reshard: bool | None


@dataclasses.dataclass(frozen=True)
class TPSpec:
    width: int
    blocks: tuple[TPBlockSpec, ...]
    root_reshard: bool | None
    mp: bool
    accum: int
    meta: bool


class Block(nn.Module):
    def __init__(self, width: int, b: TPBlockSpec):
        super().__init__()
        self.norm = nn.LayerNorm(width, bias=b.bias) if b.norm else nn.Identity()
        self.w1 = nn.Linear(width, b.hidden, bias=b.bias)
        self.w2 = nn.Linear(b.hidden, width, bias=b.bias)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, spec: TPSpec):
        super().__init__()
        self.inp = nn.Linear(4, spec.width)
        self.blocks = nn.ModuleList(Block(spec.width, b) for b in spec.blocks)
        self.out = nn.Linear(spec.width, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _parallelize(block: Block, b: TPBlockSpec, tp) -> None:
    if b.plan == "tp":
        parallelize_module(block, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    elif b.plan == "sp":
        plan = {"w1": ColwiseParallel(input_layouts=Shard(1)), "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
        if b.norm:
            plan["norm"] = SequenceParallel()
        parallelize_module(block, tp, plan)
        block.register_forward_pre_hook(lambda m, a: (DTensor.from_local(a[0], tp, (Replicate(),)).redistribute(tp, (Shard(1),)),))
        block.register_forward_hook(lambda m, a, out: out.redistribute(tp, (Replicate(),)).to_local())


def build(impl, spec: TPSpec, mesh) -> Model:
    torch.manual_seed(0)
    with torch.device("meta" if spec.meta else "cpu"):
        model = Model(spec)
    tp, dp = mesh["tp"], mesh["dp"]
    for block, b in zip(model.blocks, spec.blocks):
        _parallelize(block, b, tp)
    kw = dict(mesh=dp)
    if spec.mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block, b in zip(model.blocks, spec.blocks):
        if b.placement == "nested":
            impl.fully_shard(block.w1, reshard_after_forward=b.reshard, **kw)
        if b.placement != "root":
            impl.fully_shard(block, reshard_after_forward=b.reshard, **kw)
    impl.fully_shard(model, reshard_after_forward=spec.root_reshard, **kw)
    if spec.meta:  # torchtitan's order: initialise the sharded DTensors
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.fill_(1.0) if n.endswith("norm.weight") else torch.nn.init.normal_(p, std=0.3)
    return model


def train(model: Model, spec: TPSpec, dp_rank: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + dp_rank)  # the same on both TP ranks of a dp rank
    losses = []
    for _ in range(2):
        for micro in range(spec.accum):
            if spec.accum > 1:
                model.set_requires_gradient_sync(micro == spec.accum - 1)
            loss = model(torch.randn(2, SEQ, 4, generator=g)).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, local=_locals(model))


def compare(spec: TPSpec) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    ref = train(build(ref_impl(), spec, mesh), spec, dp_rank)
    got = train(build(load_impl(), spec, mesh), spec, dp_rank)
    assert got["losses"] == ref["losses"], f"losses: fsdp_native {got['losses']} vs torch {ref['losses']}"
    assert got["local"].keys() == ref["local"].keys()
    for n, (t, *meta) in ref["local"].items():
        a, *ameta = got["local"][n]
        assert ameta == meta, f"{n}: placements, shape {ameta} vs torch's {meta}"
        assert a.dtype == t.dtype and torch.equal(a, t), f"{n}: local shard differs, max abs diff {(a.float() - t.float()).abs().max().item():.3e}"


@st.composite
def specs(draw) -> TPSpec:
    # A TP-sharded hidden width divides the TP ranks: a column-wise Linear's local output goes
    # into the row-wise one as DTensor.from_local, which takes the local sizes as even (torch
    # FSDP2 or not, an odd one fails in the backward's matmul)
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        plan = draw(st.sampled_from(["none", "tp", "sp"]))
        blocks.append(TPBlockSpec(
            hidden=draw(st.integers(1, 9) if plan == "none" else st.sampled_from([2, 4, 6, 8])),
            norm=draw(st.booleans()),
            bias=draw(st.booleans()),
            plan=plan,
            placement=draw(st.sampled_from(["root", "unit", "nested"])),
            reshard=draw(st.sampled_from([True, False, None])),
        ))
    return TPSpec(
        width=draw(st.integers(2, 9)),
        blocks=tuple(blocks),
        root_reshard=draw(st.sampled_from([True, False, None])),
        mp=draw(st.booleans()),
        accum=draw(st.integers(1, 2)),
        meta=draw(st.booleans()),
    )


def _fuzz(n: int) -> None:
    @_settings(n)
    @given(spec=specs())
    def fuzz(spec):
        run_example(spec, compare)

    if FUZZ_SEED is not None:
        fuzz = seed(int(FUZZ_SEED))(fuzz)
    fuzz()


def test_fuzz_tp_against_torch():
    run_distributed(_fuzz, 4, TP_EXAMPLES, timeout=max(240, 8 * TP_EXAMPLES))
