"""The DTensor type of fsdp_native's sharded parameters (``fsdp_native._dtensor.ShardedDTensor``).

* Every op, on the elementwise fast path or handed to DTensor, gives bitwise the result (values,
  shape, placements) that a plain DTensor with the same local tensor and spec gives.
* In-place ops that change the spec (``squeeze_``) keep the ShardedDTensor consistent.
* ``torch.save`` of ``model.state_dict()`` and ``optimizer.state_dict()`` works (the locals view
  a flat buffer at non-zero offsets) and loads with ``weights_only=True`` as plain DTensors whose
  shards equal torch FSDP2's.
* The optimizer implementations users pick (AdamW for-loop, foreach and fused; SGD with
  momentum) train to the same parameters as torch FSDP2.
"""
from __future__ import annotations

import contextlib
import io

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from dist_utils import assert_close, full, load_impl, ref_impl, run_distributed, run_grid
from models import Cfg, build_fsdp, lm_loss, make_batches, make_mesh, train_fsdp

EXACT = dict(rtol=0, atol=0)
FP32_TOL = dict(rtol=1e-6, atol=1e-6)


def _pair(shape, mesh, placements, seed):
    """A ShardedDTensor and a plain DTensor over equal (separate) local tensors and one spec,
    the local viewing a flat buffer at a non-zero offset as fsdp_native's parameters do."""
    from fsdp_native._dtensor import ShardedDTensor, make_sharded

    g = torch.Generator().manual_seed(seed + dist.get_rank())
    plain = DTensor.from_local(torch.randn(shape, generator=g), mesh, placements, run_check=False)
    n = plain._local_tensor.numel()
    flat = torch.zeros(n + 3)
    view = flat[3:].view(plain._local_tensor.shape)
    view.copy_(plain._local_tensor)
    sharded = make_sharded(view, plain._spec)
    assert type(sharded) is ShardedDTensor and isinstance(sharded, DTensor)
    assert sharded.storage_offset() == 0, f"wrapper storage offset {sharded.storage_offset()}, expected 0"
    return sharded, plain


def _same(what, a, b):
    assert isinstance(a, DTensor) == isinstance(b, DTensor), f"{what}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, DTensor):
        assert a.placements == b.placements, f"{what}: placements {a.placements} vs {b.placements}"
        assert a.shape == b.shape and a.stride() == b.stride(), f"{what}: {a.shape}/{a.stride()} vs {b.shape}/{b.stride()}"
        assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
        a, b = a._local_tensor, b._local_tensor
    assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num()), (
        f"{what}: values differ, max abs diff {(a - b).abs().max().item():.3e}"
    )


# (name, op on (x, y, s) where x and y share a spec and s is a 0-dim tensor, fast path expected)
_OPS = [
    ("mul_ number", lambda x, y, s: x.mul_(0.9), True),
    ("mul_ tensor", lambda x, y, s: x.mul_(y), True),
    ("mul_ 0-dim", lambda x, y, s: x.mul_(s), True),
    ("add_ alpha", lambda x, y, s: x.add_(y, alpha=-0.5), True),
    ("add_ number", lambda x, y, s: x.add_(1e-3), True),
    ("sub_", lambda x, y, s: x.sub_(y), True),
    ("div_ number", lambda x, y, s: x.div_(3.0), True),
    ("lerp_", lambda x, y, s: x.lerp_(y, 0.1), True),
    ("addcmul_", lambda x, y, s: x.addcmul_(y, y, value=0.01), True),
    ("addcdiv_", lambda x, y, s: x.addcdiv_(y, y.abs().add(1.0), value=-0.01), True),
    ("sqrt", lambda x, y, s: x.abs().sqrt(), True),
    ("div number", lambda x, y, s: x / 0.7, True),
    ("div 0-dim", lambda x, y, s: x / s, True),
    ("mul", lambda x, y, s: x * y, True),
    ("neg_", lambda x, y, s: x.neg_(), True),
    ("zero_", lambda x, y, s: x.zero_(), True),
    ("copy_", lambda x, y, s: x.copy_(y), True),
    ("clamp_", lambda x, y, s: x.clamp_(-0.1, 0.1), True),
    ("maximum", lambda x, y, s: torch.maximum(x, y), True),
    ("zeros_like", lambda x, y, s: torch.zeros_like(x, memory_format=torch.preserve_format), True),
    ("clone", lambda x, y, s: x.clone(), True),
    ("detach", lambda x, y, s: x.detach(), True),
    # a replicated 0-dim DTensor is a number to an elementwise op (clip_grad_norm_'s coefficient)
    ("mul_ replicated 0-dim DTensor", lambda x, y, s: x.mul_(_rep(x, 0.5)), True),
    ("div replicated 0-dim DTensor", lambda x, y, s: x / _rep(x, 0.25), True),
    ("replicated 0-dim DTensor * x", lambda x, y, s: _rep(x, 3.0) * x, True),
    # handed to DTensor:
    ("zeros_like dtype", lambda x, y, s: torch.zeros_like(x, dtype=torch.bfloat16), False),
    ("to bf16", lambda x, y, s: x.to(torch.bfloat16), False),
    ("sum", lambda x, y, s: x.sum(), False),
    ("norm", lambda x, y, s: torch.linalg.vector_norm(x, 2), False),
    ("matmul xT y", lambda x, y, s: x.t() @ y if x.dim() == 2 else x * y, False),
    ("view", lambda x, y, s: x.view(-1) if x.dim() == 1 else x.view(x.shape[0], -1), False),
    ("full_tensor", lambda x, y, s: x.full_tensor(), False),
    ("redistribute", lambda x, y, s: x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim), False),
    ("to_local", lambda x, y, s: x.to_local() * 1, False),
    ("mul_ partial 0-dim DTensor", lambda x, y, s: x.mul_(y.sum()), False),
]


def _rep(x, value: float):
    """A 0-dim DTensor replicated on x's mesh."""
    return DTensor.from_local(torch.tensor(value), x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)


@contextlib.contextmanager
def _delegations():
    """The ops ShardedDTensor hands to DTensor's own dispatch while the block runs."""
    from fsdp_native import _dtensor

    seen = []
    real = _dtensor._delegate
    _dtensor._delegate = lambda func, args, kwargs: seen.append(func) or real(func, args, kwargs)
    try:
        yield seen
    finally:
        _dtensor._delegate = real


def _ops_body(mesh_kind: str, shape: tuple):
    from fsdp_native._dtensor import ShardedDTensor, make_sharded

    mesh = make_mesh(Cfg(mesh=mesh_kind))
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    s = torch.tensor(1.5)
    for i, (name, op, fast) in enumerate(_OPS):
        x, xp = _pair(shape, mesh, placements, seed=10 * i)
        y, yp = _pair(shape, mesh, placements, seed=10 * i + 1)
        y = make_sharded(y._local_tensor, x._spec)  # share x's spec object, as a gradient does
        with torch.no_grad(), _delegations() as delegated:
            out = op(x, y, s)
        with torch.no_grad():
            ref = op(xp, yp, s)
        _same(f"{name}: result", out, ref)
        _same(f"{name}: first argument afterwards", x, xp)
        if fast:
            assert not delegated, f"{name}: handed to DTensor ({delegated}), expected the fast path"
            assert type(out) is ShardedDTensor, f"{name}: result is {type(out).__name__}, expected ShardedDTensor"
            if out is not x and isinstance(out, DTensor):
                assert out._spec is x._spec, f"{name}: the fast path must reuse the argument's spec"


# (name, op on (xs, ys, s): lists of two tensors, position i of xs and ys sharing a spec, s a
# 0-dim tensor; fast path expected). The foreach forms torch's optimizers run on CUDA.
_FOREACH_OPS = [
    ("_foreach_mul_ number", lambda xs, ys, s: torch._foreach_mul_(xs, 0.9), True),
    ("_foreach_mul_ list", lambda xs, ys, s: torch._foreach_mul_(xs, ys), True),
    ("_foreach_mul_ 0-dim", lambda xs, ys, s: torch._foreach_mul_(xs, s), True),
    ("_foreach_add_ alpha", lambda xs, ys, s: torch._foreach_add_(xs, ys, alpha=-0.5), True),
    ("_foreach_add_ number", lambda xs, ys, s: torch._foreach_add_(xs, 1e-3), True),
    ("_foreach_div_ numbers", lambda xs, ys, s: torch._foreach_div_(xs, [2.0, 3.0]), True),
    ("_foreach_lerp_", lambda xs, ys, s: torch._foreach_lerp_(xs, ys, 0.1), True),
    ("_foreach_addcmul_", lambda xs, ys, s: torch._foreach_addcmul_(xs, ys, ys, value=0.01), True),
    ("_foreach_addcdiv_ numbers", lambda xs, ys, s: torch._foreach_addcdiv_(xs, ys, torch._foreach_add(torch._foreach_abs(ys), 1.0), [0.1, -0.2]), True),
    ("_foreach_maximum_", lambda xs, ys, s: torch._foreach_maximum_(xs, ys), True),
    ("_foreach_sqrt", lambda xs, ys, s: torch._foreach_sqrt(torch._foreach_abs(xs)), True),
    ("_foreach_neg", lambda xs, ys, s: torch._foreach_neg(xs), True),
    ("_foreach_zero_", lambda xs, ys, s: torch._foreach_zero_(xs), True),
    # handed to DTensor:
    ("_foreach_norm", lambda xs, ys, s: torch._foreach_norm(xs), False),
    ("_foreach_mul_ replicated 0-dim DTensor", lambda xs, ys, s: torch._foreach_mul_(xs, _rep(xs[0], 0.5)), True),
    ("_foreach_mul_ partial 0-dim DTensor", lambda xs, ys, s: torch._foreach_mul_(xs, ys[0].sum()), False),
]  # fmt: skip


def _foreach_body(mesh_kind: str, shape: tuple):
    from fsdp_native._dtensor import ShardedDTensor, make_sharded

    mesh = make_mesh(Cfg(mesh=mesh_kind))
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    s = torch.tensor(1.5)
    with _delegations() as delegated:
        for i, (name, op, fast) in enumerate(_FOREACH_OPS):
            # position 1 has a different shape and its own spec: specs are matched per position
            shapes = (shape, (shape[0] + 2,) + tuple(shape[1:]))
            xs, xps, ys, yps = [], [], [], []
            for j, shp in enumerate(shapes):
                x, xp = _pair(shp, mesh, placements, seed=100 * i + 10 * j)
                y, yp = _pair(shp, mesh, placements, seed=100 * i + 10 * j + 1)
                xs.append(x), xps.append(xp), ys.append(make_sharded(y._local_tensor, x._spec)), yps.append(yp)
            delegated.clear()
            with torch.no_grad():
                out = op(xs, ys, s)
                ref = op(xps, yps, s)
            for j in range(len(shapes)):
                if out is not None:
                    _same(f"{name}: result {j}", out[j], ref[j])
                _same(f"{name}: first argument {j} afterwards", xs[j], xps[j])
            if fast:
                assert not delegated, f"{name}: handed to DTensor ({delegated}), expected the foreach fast path"
                for j, o in enumerate(out or []):
                    assert type(o) is ShardedDTensor and o._spec is xs[j]._spec, f"{name}: result {j} is {type(o).__name__}"
            else:
                assert delegated, f"{name}: expected to be handed to DTensor"


def _equal_spec_and_autograd_body():
    """An operand with an equal spec object of its own (an optimizer state loaded from a
    checkpoint) still takes the fast path; autograd through fast-path ops gives DTensor's grads."""
    from fsdp_native._dtensor import ShardedDTensor, make_sharded

    mesh = make_mesh(Cfg())
    x, xp = _pair((6, 4), mesh, (Shard(0),), seed=5)
    y, yp = _pair((6, 4), mesh, (Shard(0),), seed=6)
    y_plain_equal_spec = DTensor(yp._local_tensor.clone(), yp._spec, requires_grad=False)
    assert y_plain_equal_spec._spec is not x._spec and y_plain_equal_spec._spec == x._spec
    with torch.no_grad():
        out = x.addcdiv_(y_plain_equal_spec, y_plain_equal_spec.abs().add(1.0), value=0.5)
        ref = xp.addcdiv_(yp, yp.abs().add(1.0), value=0.5)
    assert out is x
    _same("addcdiv_ with an equal spec", x, ref)
    q = torch.zeros_like(x) / 2.0
    assert type(q) is ShardedDTensor and q._spec is x._spec, f"{type(q).__name__}"

    # autograd: d/dx sum(x * y * 0.5 + x / 3) = y * 0.5 + 1/3, through fast-path mul/div/add
    xs = make_sharded(xp._local_tensor.clone(), x._spec, requires_grad=True)
    xr = DTensor(xp._local_tensor.clone(), xp._spec, requires_grad=True)
    ys = make_sharded(yp._local_tensor.clone(), x._spec)
    for leaf, other in ((xs, ys), (xr, yp)):
        (leaf * other * 0.5 + leaf / 3.0).sum().full_tensor().backward()
    assert isinstance(xs.grad, DTensor) and xs.grad.placements == xr.grad.placements
    _same("autograd grad", xs.grad.to_local(), xr.grad.to_local())


def _inplace_spec_body():
    mesh = make_mesh(Cfg())
    x, xp = _pair((1, 3, 4), mesh, (Shard(1),), seed=3)
    with torch.no_grad():
        out = x.squeeze_(0)
        ref = xp.squeeze_(0)
    assert out is x, "an in-place op must return its own argument"
    _same("squeeze_", x, ref)
    assert x.placements == (Shard(0),), f"placements after squeeze_: {x.placements}, expected (Shard(dim=0),)"
    assert x.to_local().shape == xp.to_local().shape


def _ws2_ops():
    run_grid([dict(mesh_kind="1d", shape=shape) for shape in ((8, 5), (7,), (5, 3))], _ops_body, "ops")
    run_grid([dict(mesh_kind="1d", shape=shape) for shape in ((8, 5), (7,))], _foreach_body, "foreach ops")
    run_grid([{}], _inplace_spec_body, "in-place spec")
    run_grid([{}], _equal_spec_and_autograd_body, "equal spec, autograd")


def _ws4_ops():
    run_grid([dict(mesh_kind="hsdp", shape=(6, 4))], _ops_body, "ops")
    run_grid([dict(mesh_kind="hsdp", shape=(6, 4))], _foreach_body, "foreach ops")


def test_ops_match_plain_dtensor_ws2():
    run_distributed(_ws2_ops, 2)


def test_ops_match_plain_dtensor_hsdp():
    run_distributed(_ws4_ops, 4, timeout=300)


# ---------------------------------------------------------------------------
# torch.save / torch.load and optimizers, against torch FSDP2


def _train(impl, cfg: Cfg, opt_factory):
    """models.train_fsdp with the given optimizer; returns the model, the optimizer, the losses."""
    model = build_fsdp(impl, cfg, make_mesh(cfg))
    res = train_fsdp(impl, model, cfg, opt=opt_factory(model.parameters()))
    return model, res["opt"], res["losses"]


_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}


def _optim_body(optim: str, model: str):
    cfg = Cfg(model=model)
    impl = load_impl()
    ours, ours_opt, ours_losses = _train(impl, cfg, _OPTIMIZERS[optim])
    if impl.name == "fsdp_native":
        x, y = make_batches(cfg.model_args, 1, cfg.local_bsz, seed=9)[0]
        lm_loss(ours(x), y).backward()
        kinds = {type(p).__name__ for p in ours.parameters()} | {type(p.grad).__name__ for p in ours.parameters()}
        assert kinds == {"ShardedDTensor"}, f"parameter and gradient types {kinds}, expected ShardedDTensor"
        assert all(isinstance(p, impl.module.ShardedDTensor) for p in ours.parameters())
    ref, ref_opt, ref_losses = _train(ref_impl(), cfg, _OPTIMIZERS[optim])
    assert_close(f"{optim}: losses", torch.tensor(ours_losses), torch.tensor(ref_losses), FP32_TOL)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(f"{optim}: {name}", full(p), full(ref_params[name]), FP32_TOL)
    # The optimizer states are DTensors sharded like the parameter.
    for p in ours.parameters():
        for key, v in ours_opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert isinstance(v, DTensor) and v.placements == p.placements, (
                    f"{optim}: state {key!r} is {type(v).__name__} {getattr(v, 'placements', None)}, "
                    f"expected a DTensor with {p.placements}"
                )


def _save_body(model: str):
    cfg = Cfg(model=model, steps=2)
    ours, ours_opt, _ = _train(load_impl(), cfg, _OPTIMIZERS["adamw"])
    ref, ref_opt, _ = _train(ref_impl(), cfg, _OPTIMIZERS["adamw"])
    loaded = {}
    for who, m, o in (("ours", ours, ours_opt), ("torch", ref, ref_opt)):
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "optim": o.state_dict()}, buf)
        buf.seek(0)
        loaded[who] = torch.load(buf, weights_only=True)
    for key, v in loaded["ours"]["model"].items():
        assert type(v) is DTensor, f"{key}: loads as {type(v).__name__}, expected DTensor"
        r = loaded["torch"]["model"][key]
        assert v.placements == r.placements and v.shape == r.shape, f"{key}: {v.placements} {v.shape} vs {r.placements} {r.shape}"
        assert_close(f"saved {key}", v.to_local(), r.to_local(), EXACT)
    ours_state, ref_state = loaded["ours"]["optim"]["state"], loaded["torch"]["optim"]["state"]
    assert ours_state.keys() == ref_state.keys()
    for idx in ours_state:
        for key, v in ours_state[idx].items():
            r = ref_state[idx][key]
            if isinstance(v, DTensor):
                assert type(v) is DTensor, f"optimizer state {idx}.{key}: loads as {type(v).__name__}"
                assert_close(f"saved optimizer state {idx}.{key}", v.to_local(), r.to_local(), EXACT)
            else:
                assert_close(f"saved optimizer state {idx}.{key}", v, r, EXACT)
    # The loaded state dicts load into fresh sharded models and optimizers, and training goes on
    # as torch FSDP2's does from its own checkpoint.
    rank, ws = dist.get_rank(), dist.get_world_size()
    x, y = make_batches(cfg.model_args, 1, cfg.local_bsz * ws, seed=11)[0]
    lo, hi = rank * cfg.local_bsz, (rank + 1) * cfg.local_bsz
    after = {}
    for who, impl in (("ours", load_impl()), ("torch", ref_impl())):
        fresh = build_fsdp(impl, cfg, make_mesh(cfg), seed=1)
        fresh.load_state_dict(loaded[who]["model"])
        opt = _OPTIMIZERS["adamw"](fresh.parameters())
        opt.load_state_dict(loaded[who]["optim"])
        lm_loss(fresh(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        after[who] = {n: full(p) for n, p in fresh.named_parameters()}
    for name, v in after["ours"].items():
        assert_close(f"step after reloading: {name}", v, after["torch"][name], FP32_TOL)


def _ws2_optim():
    run_grid([dict(optim=o, model="odd") for o in _OPTIMIZERS], _optim_body, "optimizers")
    run_grid([dict(model=m) for m in ("even", "odd")], _save_body, "torch.save")


def test_optimizers_and_torch_save_ws2():
    run_distributed(_ws2_optim, 2, timeout=300)
