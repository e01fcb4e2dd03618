"""Quantized all-gathers on a GPU, on a one-rank NCCL group (``run_on_gpu`` of
test_cuda_runtime). Skipped without a GPU.

* torchao Float8 training (``enable_fsdp_float8_all_gather=True``, with
  ``precompute_float8_dynamic_scale_for_fsdp``; fp32 and bf16 mixed precision) and NF4 QLoRA
  (frozen ``to_nf4`` weights beside trainable LoRA adapters): fsdp_native's losses and
  parameters equal torch FSDP2's bit for bit for Float8, as on CPU (tests/test_float8.py), and
  for NF4 the unsharded model's (torch FSDP2 2.13 fails NF4 on one rank; tests/test_extension.py
  compares with it on 2 ranks). Deterministic algorithms on, TF32 off,
  ``foreach=False`` optimizers for both (see test_cuda_runtime).
* fsdp_native's own fp8 (tensorwise, rowwise) and NF4 all-gathers, which run the Triton kernels
  on CUDA: the unsharded parameters the forward computes with equal the plain-PyTorch reference
  (``fsdp_native._quant_ref``, on CPU) bit for bit, and 30 steps of training follow the bf16
  all-gather's losses within the tolerances of tests/test_quantized_all_gather.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from test_cuda_runtime import assert_no_failures, cuda, grid_failures, run_on_gpu

EXACT = dict(rtol=0, atol=0)
DEV = "cuda"  # a CPU dry run of the bodies on a one-rank gloo group sets "cpu"


def _deterministic() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def _impls():
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_native

    unsharded = type("Unsharded", (), {"fully_shard": staticmethod(lambda module, **kw: module)})
    return {"torch": torch_fsdp, "fsdp_native": fsdp_native, "unsharded": unsharded}


def _local(p: torch.Tensor) -> torch.Tensor:
    """A one-rank DTensor's whole value as a plain CPU tensor (torchao's Float8 weight wrapper
    unwrapped)."""
    t = (p.to_local() if hasattr(p, "to_local") else p).detach()
    t = getattr(t, "_tensor", t)
    return t.float().cpu()


def _check_same(tag: str, got: dict, ref: dict) -> None:
    from dist_utils import assert_close

    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    assert got["params"].keys() == ref["params"].keys(), (tag, sorted(got["params"]), sorted(ref["params"]))
    for n, v in ref["params"].items():
        assert_close(f"{tag} param {n!r}", got["params"][n], v, EXACT)


# ------------------------------------------------------------------------------------------
# torchao Float8 and NF4 against torch FSDP2


def _shard_and_train(impl, model, mp: bool, dim: int, batch: int, steps: int, after_step=None) -> torch.Tensor:
    """Each block a unit, then the root; AdamW on the trainable parameters; the losses."""
    from torch.distributed.device_mesh import init_device_mesh

    kw = dict(mesh=init_device_mesh(DEV, (1,)))
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(batch, dim, generator=gen).to(DEV)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)
        losses.append(loss.detach().cpu())
    return torch.stack(losses)


def _train_float8(impl, mp: bool) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from test_float8 import DIM, Model

    torch.manual_seed(0)
    with torch.device(DEV):
        model = Model()
    cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, fqn: fqn != "head")
    losses = _shard_and_train(impl, model, mp, DIM, 32, 4, after_step=precompute_float8_dynamic_scale_for_fsdp)
    return dict(losses=losses, params={n: _local(p) for n, p in model.named_parameters()})


def _train_nf4(impl, mp: bool) -> dict:
    from test_extension import DIM, Model

    torch.manual_seed(0)
    with torch.device(DEV):
        model = Model()
    losses = _shard_and_train(impl, model, mp, DIM, 4, 3)
    params = {n: _local(p) for n, p in model.named_parameters() if p.requires_grad}
    for i, b in enumerate(model.blocks):  # the frozen NF4 weights, dequantized
        w = b.proj.weight
        params[f"blocks.{i}.proj.weight (NF4)"] = (w.to_local() if hasattr(w, "to_local") else w).get_original_weight().float().cpu()
    return dict(losses=losses, params=params)


def _torchao_grid() -> list[str]:
    _deterministic()

    def body(kind: str, mp: bool, ref: str) -> None:
        train = _train_float8 if kind == "float8" else _train_nf4
        impls = _impls()
        want = train(impls[ref], mp)
        got = train(impls["fsdp_native"], mp)
        _check_same(f"[fsdp_native vs {ref}, {kind} mp={mp}]", got, want)

    # torch FSDP2 cannot run NF4 on one rank (its one-rank path hands NF4Tensor's
    # fsdp_post_all_gather one tensor where it unpacks three), so NF4 is checked against the
    # model trained unsharded there; on CPU, tests/test_extension.py checks it against torch
    # FSDP2 on 2 ranks and HSDP 2x2, with and without mixed precision.
    configs = [dict(kind="float8", mp=False, ref="torch"), dict(kind="float8", mp=True, ref="torch"),
               dict(kind="nf4", mp=False, ref="unsharded")]  # fmt: skip
    return grid_failures(configs, body)


@cuda
def test_torchao_float8_and_nf4_match_torch_fsdp2_on_gpu():
    pytest.importorskip("torchao", reason="torchao is a test dependency (make test installs it)")
    assert_no_failures(run_on_gpu(_torchao_grid))


# ------------------------------------------------------------------------------------------
# fsdp_native's own quantized all-gather (the Triton kernels)


def _build_own(fmt: str | None, frozen: bool):
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_native
    from models import Transformer
    from test_quantized_all_gather import ARGS, BF16

    mesh = init_device_mesh(DEV, (1,))
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Transformer(ARGS)
    if frozen:  # NF4: frozen base weights, trainable norms and head
        for layer in model.layers:
            for p in layer.parameters():
                if p.dim() >= 2:
                    p.requires_grad_(False)
    mp = fsdp_native.MixedPrecisionPolicy(**BF16)
    ag = None if fmt is None else fsdp_native.QuantizedAllGather(fmt, min_numel=256)
    for layer in model.layers:
        fsdp_native.fully_shard(layer, mesh=mesh, mp_policy=mp, all_gather=ag)
    fsdp_native.fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _own_values(fmt: str) -> None:
    from fsdp_native import _quant_ref
    from test_quantized_all_gather import ARGS

    model = _build_own(fmt, frozen=fmt == "nf4")
    block = model.layers[0]
    fulls = {n: p.to_local().detach().cpu() for n, p in block.named_parameters()}
    seen = {}
    block.register_forward_pre_hook(lambda m, a: seen.update({n: p.detach().clone().cpu() for n, p in m.named_parameters()}))
    model(torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), device=DEV))
    quantized = 0
    for n, w in fulls.items():
        if w.dim() >= 2 and w.numel() >= 256:  # one rank: the padded shard is the parameter
            row = math.prod(w.shape[1:])
            q = _quant_ref.quantize([w.reshape(-1)], [w.numel()], [row], fmt)
            want = _quant_ref.dequantize(q, [w.numel()], [row], 1, fmt, [w.numel()], [torch.bfloat16])[0].view(w.shape)
            quantized += 1
        else:
            want = w.to(torch.bfloat16)
        got = seen[n]
        assert got.dtype == torch.bfloat16 and got.shape == w.shape, (n, got.dtype, got.shape)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{fmt}: unsharded {n!r} differs from the reference"
    assert quantized >= 4, f"{fmt}: only {quantized} parameters were quantized"


def _own_losses(fmt: str | None, frozen: bool, steps: int = 30) -> list[float]:
    from models import copy_task
    from test_quantized_all_gather import ARGS

    model = _build_own(fmt, frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    return copy_task(model, opt, ARGS, steps, torch.Generator().manual_seed(5), DEV)


def _own_grid() -> list[str]:
    _deterministic()

    def body(fmt: str, frozen: bool, tol: float) -> None:
        _own_values(fmt)
        ref = _own_losses(None, frozen)
        got = _own_losses(fmt, frozen)
        assert ref[-1] < ref[0] - 0.3, f"the bf16 run did not learn: {ref[0]:.3f} -> {ref[-1]:.3f}"
        worst = max(abs(a - b) for a, b in zip(got, ref))
        assert worst <= tol, f"{fmt}: losses differ from the bf16 all-gather's by up to {worst:.4f} (tolerance {tol})"

    configs = [dict(fmt="fp8_rowwise", frozen=False, tol=0.05), dict(fmt="fp8_tensorwise", frozen=False, tol=0.05),
               dict(fmt="nf4", frozen=True, tol=0.15)]  # fmt: skip
    return grid_failures(configs, body)


@cuda
def test_own_quantized_all_gather_on_gpu():
    assert_no_failures(run_on_gpu(_own_grid))
