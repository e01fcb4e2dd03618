"""torchao Float8 training (``convert_to_float8_training`` with
``enable_fsdp_float8_all_gather=True`` and ``precompute_float8_dynamic_scale_for_fsdp``) on
fsdp_native against torch FSDP2, on CPU: torch's CPU ``_scaled_mm`` runs the fp8 matmuls.

The weights travel as float8 bytes through torchao's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``); fsdp_native packs the fp8 inner tensors
of every Float8Linear of a unit into its one all-gather. Losses and parameters are bit for bit
torch FSDP2's at world size 1, 2 and HSDP 2x2, with and without the precomputed scales and
with bf16 mixed precision; the all-gather bytes are the fp8 sizes.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters

from dist_utils import assert_close, full, load_impl, ref_impl, run_distributed, run_grid
from models import mesh_of

pytest.importorskip("torchao", reason="torchao is a test dependency (make test installs it)")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: E402

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


def _train(
    impl, hsdp: bool, precompute: bool, mp: bool, offload: bool = False, compile: bool = False, norm_last: bool = False, steps: int = 4
) -> dict:
    mesh = mesh_of("hsdp" if hsdp else "1d")
    torch.manual_seed(0)
    model = Model(norm_last=norm_last)
    cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    # The head stays in high precision, as torchtitan does for the output layer.
    convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, fqn: fqn != "head")
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
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(32, DIM, generator=gen)
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
    return dict(losses=losses, params=params, model=model)


def _check(hsdp: bool, precompute: bool, mp: bool, offload: bool = False, compile: bool = False, norm_last: bool = False) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    ref = _train(torch_impl, hsdp, precompute, mp, offload, compile, norm_last)
    got = _train(impl, hsdp, precompute, mp, offload, compile, norm_last)
    tag = f"[{impl.name} vs torch, Float8 hsdp={hsdp} precompute={precompute} mp={mp} offload={offload} compile={compile} norm_last={norm_last}]"
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    for n, v in ref["params"].items():
        assert_close(f"{tag} param {n!r}", got["params"][n], v, EXACT)
    if impl.name == "fsdp_native" and dist.get_world_size() > 1:
        import fsdp_native

        model = got["model"]
        with fsdp_native.record_trace() as rec:
            model(torch.randn(32, DIM)).sum().backward()
        per_unit = rec.bytes_summary()[0]["blocks.0"]
        # fc1 and fc2 as fp8 (one byte per weight), the LayerNorm in its own dtype; an
        # all-gather in the forward and again in the backward (resharded after forward).
        fp8_bytes = 2 * DIM * HIDDEN
        norm_bytes = 2 * DIM * (2 if mp else 4)
        assert per_unit["all_gather"] <= 2 * (fp8_bytes + norm_bytes + 256), per_unit


def _grid(hsdp_ok: bool) -> None:
    configs = [dict(hsdp=False, precompute=p, mp=m) for p in (False, True) for m in (False, True)]
    configs += [dict(hsdp=False, precompute=True, mp=True, norm_last=True)]
    if hsdp_ok:
        configs += [dict(hsdp=True, precompute=True, mp=False)]
    elif dist.get_world_size() > 1:
        configs += [dict(hsdp=False, precompute=True, mp=True, offload=True), dict(hsdp=False, precompute=True, mp=True, compile=True)]
    run_grid(configs, _check, name="float8")


def test_float8_parity_world_size_1():
    run_distributed(_grid, 1, False)


def test_float8_parity_world_size_2():
    run_distributed(_grid, 2, False)


def test_float8_parity_hsdp_2x2():
    run_distributed(_grid, 4, True, timeout=360)
