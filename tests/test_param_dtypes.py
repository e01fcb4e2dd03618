"""Parameter dtypes beyond float32, bfloat16 and float16 under a mixed precision policy.

**Not floating-point**: complex weights (a
Fourier layer, as in Fourier neural operators) and frozen int8 weights with a float scale (a
weight-only quantized layer). torch FSDP2 casts only floating-point parameters to
``param_dtype`` (from torch 2.12 on; 2.11 cast an int8 weight to bf16 and a complex one to its
real part), and reduces a unit of complex parameters in their own dtype when the policy has no
reduce dtype. fsdp_native does the same on every torch, and reduces complex gradients in their
own dtype whatever the policy's reduce dtype, which torch FSDP2 fails on (``torch.cat(): input
types can't be cast``). Before 2026-11-29 fsdp_native failed in its all-gather copy-in on both
kinds of parameter (``unsupported dtype pair ... torch.complex64 -> torch.bfloat16``).

Checked: the unsharded parameters' dtypes inside the forward; losses and parameters bit for bit
torch FSDP2's (fp32; a bf16 policy; a bf16 policy with an fp32 reduce dtype, against torch with
that policy on every unit but the complex ones, which get no reduce dtype) and, in fp32, within
1e-5 of an unsharded model trained on the mean of the ranks' losses; a unit that mixes complex
and real trainable parameters fails with a clear error, as in torch FSDP2.

**float64**: a float64 model with a float32 or bf16 policy (float64 master weights), and frozen
float64 parameters in a bf16 unit. The native packing kernels cast among float32, bfloat16 and
float16 only; before 2026-11-29 such a unit failed in its all-gather copy-in (``unsupported
dtype pair ... torch.float64 -> torch.bfloat16``). The ops now pack other floating dtypes
through torch casts (``fsdp_native.ops``). Checked bit for bit against torch FSDP2, with
gradient accumulation without sync (the gradient copy-out then adds in float64), on 2 ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import assert_same_run, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from fsdp_native import _compat

WIDTH, MODES, LENGTH, STEPS = 4, 3, 12, 3


class Spectral(nn.Module):
    """A Fourier layer: complex weights mix the channels of the lowest modes."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH, MODES, dtype=torch.cfloat) / WIDTH)
        self.seen: list[torch.dtype] = []

    def forward(self, x):  # (batch, WIDTH, LENGTH), real
        self.seen.append(self.w.dtype)
        xf = torch.fft.rfft(x.float())[..., :MODES]
        out = torch.einsum("bim,iom->bom", xf, self.w.to(torch.cfloat))
        return torch.fft.irfft(out, n=x.shape[-1]).to(x.dtype)


class Int8Pointwise(nn.Module):
    """Frozen int8 channel mixing with a trainable float scale and bias."""

    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randint(-127, 128, (WIDTH, WIDTH), dtype=torch.int8), requires_grad=False)
        self.scale = nn.Parameter(torch.full((WIDTH,), 0.01))
        self.bias = nn.Parameter(torch.zeros(WIDTH))
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        self.seen.append(self.q.dtype)
        w = self.q.to(self.scale.dtype) * self.scale[:, None]
        return torch.einsum("oi,bil->bol", w, x) + self.bias[:, None]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.spectral = Spectral()
        self.pointwise = Int8Pointwise()

    def forward(self, x):
        return torch.tanh(self.spectral(x) + self.pointwise(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lift = nn.Linear(1, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.proj = nn.Linear(WIDTH, 1)

    def forward(self, x):  # (batch, LENGTH)
        h = self.lift(x[..., None]).transpose(1, 2)
        for b in self.blocks:
            h = b(h)
        return self.proj(h.transpose(1, 2))[..., 0]


def _data(step: int, rank: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(3, LENGTH, generator=gen)
    return x, torch.roll(x, 1, dims=-1)


def _loss(model, x, y):
    return (model(x).float() - y).pow(2).mean()


def _comparable(params: dict) -> dict:
    return {n: torch.view_as_real(p) if p.is_complex() else p for n, p in params.items()}


def _train(impl, policy: str, torch_reference: bool = False) -> dict:
    torch.manual_seed(0)
    model = Net()
    rank = dist.get_rank()
    mp = {
        "fp32": None,
        "bf16": dict(param_dtype=torch.bfloat16),
        "bf16-fp32-reduce": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }[policy]
    kw = {} if mp is None else dict(mp_policy=impl.MixedPrecisionPolicy(**mp))
    for b in model.blocks:
        spectral_kw = kw
        if torch_reference and mp and "reduce_dtype" in mp:
            # torch FSDP2 casts complex gradients to a real reduce dtype and fails: give its
            # complex units the policy without one, which fsdp_native applies to them anyway.
            spectral_kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=mp["param_dtype"]))
        impl.fully_shard(b.spectral, **spectral_kw)
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, *_data(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    seen = {str(d) for b in model.blocks for d in b.spectral.seen + b.pointwise.seen}
    return dict(losses=torch.stack(losses), params=_comparable(full_params(model)), seen=seen)


def _train_unsharded(world_size: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        per_rank = [_loss(model, *_data(step, r)) for r in range(world_size)]
        loss = sum(per_rank) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(per_rank[dist.get_rank()].detach())
    return dict(losses=torch.stack(losses), params=_comparable({n: p.detach() for n, p in model.named_parameters()}))


def check(policy: str) -> None:
    impl = load_impl()
    got = _train(impl, policy, torch_reference=impl.name != "fsdp_native")
    assert got["seen"] == {"torch.complex64", "torch.int8"}, f"[{impl.name}] {policy}: forward saw dtypes {got['seen']}"
    if policy == "fp32":
        assert_same_run(f"[{impl.name}] {policy} vs unsharded", got, _train_unsharded(dist.get_world_size()), dict(rtol=1e-5, atol=1e-5))
    if _compat.TORCH_VERSION >= (2, 12):  # torch 2.9 to 2.11 cast int8 and complex parameters to param_dtype
        assert_same_run(f"[{impl.name}] {policy} vs torch", got, _train(ref_impl(), policy, torch_reference=True), dict(rtol=0, atol=0))


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.real = nn.Parameter(torch.ones(2))
        self.cplx = nn.Parameter(torch.ones(2, dtype=torch.cfloat))

    def forward(self, x):
        return (x * self.real * self.cplx).abs().sum()


def mixed_unit_fails() -> None:
    impl = load_impl()
    model = Mixed()
    impl.fully_shard(model)
    if impl.name != "fsdp_native":  # torch FSDP2 refuses the unit at its first forward
        try:
            model(torch.ones(2))
        except AssertionError as e:
            assert "FSDP expects uniform original parameter dtype" in str(e), str(e)
            return
        raise AssertionError("torch FSDP2 accepted a unit of complex and real trainable parameters")
    loss = model(torch.ones(2))
    raises_exactly(
        ValueError,
        "fsdp_native: unit '' has gradients of dtypes ['torch.complex64', 'torch.float32'], expected one dtype per "
        "unit (as torch FSDP2); give the complex parameters units of their own",
        loss.backward,
    )


def _grid():
    run_grid([dict(policy=p) for p in ("fp32", "bf16", "bf16-fp32-reduce")], check, name="non-float parameters")


class Float64Block(nn.Module):
    def __init__(self, table: bool):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)
        if table:  # a frozen float64 table in a float32 block
            self.table = nn.Parameter(torch.randn(4, 4, dtype=torch.float64), requires_grad=False)

    def forward(self, h):
        if hasattr(self, "table"):
            h = h + h @ self.table.to(h.dtype)
        return h + self.b(torch.tanh(self.a(h)))


class Float64Net(nn.Module):
    def __init__(self, frozen_only: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Float64Block(frozen_only) for _ in range(2))
        self.head = nn.Linear(4, 1)
        if not frozen_only:
            self.double()

    def forward(self, x):
        h = x.to(self.head.weight.dtype)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _train_float64(impl, cfg: dict) -> dict:
    torch.manual_seed(0)
    model = Float64Net(cfg["frozen_only"])
    kw = dict(mp_policy=impl.MixedPrecisionPolicy(**cfg["mp"]))
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x, y = _data(2 * step + micro, dist.get_rank())
            loss = (model(x[..., :4]).float()[..., 0] - y[..., 0]).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return dict(losses=torch.stack(losses), params=full_params(model))


def check_float64(**cfg) -> None:
    impl = load_impl()
    got = _train_float64(impl, cfg)
    assert_same_run(f"[{impl.name}] {cfg} vs torch", got, _train_float64(ref_impl(), cfg), dict(rtol=0, atol=0))


def _grid_float64():
    configs = [
        dict(frozen_only=False, mp=dict(param_dtype=torch.float32)),
        dict(frozen_only=False, mp=dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        dict(frozen_only=False, mp=dict(param_dtype=torch.bfloat16)),
        dict(frozen_only=True, mp=dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    ]
    run_grid(configs, check_float64, name="float64 parameters")


def test_complex_and_int8_parameters_match_torch():
    run_distributed(_grid, 2, timeout=300)


def test_float64_parameters_under_a_policy_match_torch():
    run_distributed(_grid_float64, 2, timeout=300)


def test_unit_of_complex_and_real_trainable_parameters_fails_clearly():
    run_distributed(mixed_unit_fails, 2, timeout=120)
