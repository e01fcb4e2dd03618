"""torch.func's transforms and forward-mode AD through sharded modules.

- ``torch.func.jvp``, ``vmap``, ``vmap`` of ``jvp``, ``grad``, ``jacrev`` and ``hessian`` in the
  model's input. Also a training step that takes a ``torch.func.jvp`` tangent as its target,
  as simplified consistency models do.
- ``torch.autograd.forward_ad`` dual tensors through the forward.

Torch FSDP2 2.13 runs the torch.func ones (2.11 does not); fsdp_native gives the same values
bit for bit, and the unsharded model's (with a bf16 policy, the unsharded model cast to bf16). Before 2026-12-02 fsdp_native failed every one of them: its
all-gather buffers, made under ``torch.func.jvp``, became wrappers without storage ("Cannot
access storage of TensorWrapper"), and its post-backward Function had no ``setup_context``,
which the transforms need.

Dual tensors fail in torch FSDP2 ("A custom Function's forward is returning a view (or an input
as-is) but the jvp is not returning a view"). fsdp_native gives the unsharded model's tangents:
bit for bit in fp32, and with a bf16 policy those of the unsharded model cast to bf16. A loss
of the tangents trains as unsharded training does (within 1e-6): its backward reaches a unit's
weights through the tangents' own graph, so the unit's pre-backward hook is on the tangents
too (without it, that backward found the weights freed: "setStorage: ... out of bounds").
"""
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn as nn

from dist_utils import assert_close, full_params, grid, load_impl, ref_impl, run_distributed, run_grid
from models import BlockStack, TanhResidual

EXACT = dict(rtol=0, atol=0)


def _model(impl, mp: bool):
    torch.manual_seed(0)
    # A smooth block, then a bare Linear: a loss of the tangents reaches the Linear's weight
    # only through the tangents' graph (_dual_training).
    blocks = iter([TanhResidual(8), nn.Linear(8, 8)])
    m = BlockStack(lambda: next(blocks), dim=8, n=2)
    if impl is None:  # unsharded: fp32, or the bf16 model a bf16 policy computes with
        return m.to(torch.bfloat16) if mp else m
    kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if mp else {}
    for mod in (*m.blocks, m):
        impl.fully_shard(mod, **kw)
    return m


def _x(mp: bool, unsharded: bool = False):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))  # the same on every rank
    return x.to(torch.bfloat16) if mp and unsharded else x


def _jvp(m, x):
    return torch.func.jvp(m, (x,), (torch.ones_like(x),))[1]


def _vmap(m, x):
    return torch.func.vmap(m)(x.unsqueeze(1))


def _vmap_jvp(m, x):
    return torch.func.vmap(lambda xi: torch.func.jvp(m, (xi,), (torch.ones_like(xi),))[1])(x.unsqueeze(1))


def _grad(m, x):
    return torch.func.grad(lambda x: m(x).sum())(x)


def _jacrev(m, x):
    return torch.func.jacrev(m)(x[0])


def _hessian(m, x):
    return torch.func.hessian(lambda x: m(x).sum())(x[0])


def _dual(m, x):
    with fwAD.dual_level():
        return fwAD.unpack_dual(m(fwAD.make_dual(x, torch.ones_like(x)))).tangent


TRANSFORMS = {"jvp": _jvp, "vmap": _vmap, "vmap_jvp": _vmap_jvp, "grad": _grad, "jacrev": _jacrev, "hessian": _hessian}


def _transform(name: str, mp: bool) -> None:
    fn = TRANSFORMS[name]
    got = fn(_model(load_impl(), mp), _x(mp))
    assert_close(f"{name} against unsharded", got, fn(_model(None, mp), _x(mp, True)), EXACT)
    if TORCH_RUNS_TRANSFORMS:
        assert_close(f"{name} against torch FSDP2", got, fn(_model(ref_impl(), mp), _x(mp)), EXACT)


# Torch 2.11's FSDP2 fails them as fsdp_native did ("Cannot access storage of TensorWrapper", in
# its all-gather output allocation); 2.13's runs them.
TORCH_RUNS_TRANSFORMS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def _forward_ad(mp: bool) -> None:
    got = _dual(_model(load_impl(), mp), _x(mp))
    assert_close("dual tangents against unsharded", got, _dual(_model(None, mp), _x(mp, True)), EXACT)


def _tangent_target_training(mp: bool) -> None:
    """A loss whose target is a torch.func.jvp tangent taken without grad: bit for bit torch
    FSDP2 where it runs this, and within 1e-6 of unsharded training (fp32; all ranks' batches
    at once)."""

    def train(m, ranks):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(3):
            x = torch.cat([torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + r)) for r in ranks])
            with torch.no_grad():
                target = _jvp(m, x)
            (m(x) - target).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return full_params(m)

    got = train(_model(load_impl(), mp), [dist.get_rank()])
    if not mp:
        want = train(_model(None, mp), list(range(dist.get_world_size())))
        for n in want:
            assert_close(f"{n} against unsharded", got[n], want[n], dict(rtol=1e-6, atol=1e-6))
    if TORCH_RUNS_TRANSFORMS:
        want = train(_model(ref_impl(), mp), [dist.get_rank()])
        for n in want:
            assert_close(f"{n} against torch FSDP2", got[n], want[n], EXACT)


def _dual_training(tangent_only: bool) -> None:
    """Training on dual tensors: a loss of the tangents (and of the primal output), its backward
    through the tangents' graph. Within 1e-6 of unsharded training (fp32; all ranks' batches at
    once). Torch FSDP2 fails as with any dual tensor."""

    def train(m, ranks):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(3):
            x = torch.cat([torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + r)) for r in ranks])
            with fwAD.dual_level():
                primal, tangent = fwAD.unpack_dual(m(fwAD.make_dual(x, torch.ones_like(x))))
                loss = tangent.float().pow(2).mean() + (0 if tangent_only else primal.float().pow(2).mean())
            loss.backward()
            opt.step()
            opt.zero_grad()
        return full_params(m)

    got = train(_model(load_impl(), False), [dist.get_rank()])
    want = train(_model(None, False), list(range(dist.get_world_size())))
    for n in want:
        assert_close(f"{n} against unsharded", got[n], want[n], dict(rtol=1e-6, atol=1e-6))


def _body() -> None:
    run_grid(grid(name=list(TRANSFORMS), mp=[False, True]), _transform, name="torch.func")
    if load_impl().name == "fsdp_native":  # torch FSDP2 fails (the module docstring)
        run_grid(grid(mp=[False, True]), _forward_ad, name="forward AD")
        run_grid(grid(tangent_only=[False, True]), _dual_training, name="forward AD training")
    run_grid(grid(mp=[False, True] if TORCH_RUNS_TRANSFORMS else [False]), _tangent_target_training, name="jvp target")


def test_func_transforms():
    run_distributed(_body, 2, timeout=300)
