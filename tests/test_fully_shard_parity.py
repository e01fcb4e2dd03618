"""Numerical parity of the implementation under test with torch FSDP2 and with
unsharded single-process training.

Every configuration trains the same model with
  A = the implementation under test (``fsdp_native``; ``FSDP_TEST_IMPL=torch``
      points it at ``torch.distributed.fsdp`` to validate the tests), and
  B = ``torch.distributed.fsdp.fully_shard`` with the same configuration, and
  R = the same model trained in one process without sharding on the global
      batch (each FSDP rank gets its own slice of it; gradients are averaged),
and compares the per-step losses, the gradients of the first step and all
parameters at the end (DTensors gathered with ``full_tensor()``).

One process spawn per test function; each runs a grid of configurations.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_utils import assert_close, full, full_params, grid, load_impl, placements_of, raises_exactly, ref_impl, run_distributed, run_grid
from models import Cfg, Transformer, build_fsdp, freeze_some, make_mesh, train_fsdp, train_reference

# A (impl under test) vs B (torch FSDP2), fp32.
FP32_TOL = dict(rtol=1e-6, atol=1e-6)
# A vs B with bf16 parameters (bf16 compute: tolerance of bf16).
BF16_TOL = dict(rtol=1.6e-2, atol=1e-2)
# A vs R (unsharded single-process reference), fp32.
REF_TOL = dict(rtol=1e-5, atol=1e-5)
# A vs R with bf16 compute: only a sanity bound on the losses.
REF_BF16_LOSS_TOL = dict(rtol=5e-2, atol=5e-2)


def compare(tag: str, a: dict, b: dict, tol: dict, grad_scale: float = 1.0, losses_only=False, loss_tol=None):
    assert_close(f"{tag} losses per step", a["losses"], b["losses"], loss_tol or tol)
    if losses_only:
        return
    assert_close(f"{tag} clip_grad_norm_ total norms", a["norms"], b["norms"], tol)
    assert a["params"].keys() == b["params"].keys(), f"{tag}: parameter names differ"
    for n in b["grads0"]:
        gb = b["grads0"][n]
        assert_close(f"{tag} grad of {n!r} after step 0", a["grads0"][n], None if gb is None else gb * grad_scale, tol)
    for n in b["params"]:
        assert_close(f"{tag} param {n!r} after {len(a['losses'])} losses", a["params"][n], b["params"][n], tol)


def check_parity(**kw) -> None:
    """Body of every parity grid: train A, B and R and compare."""
    cfg = Cfg(**kw)
    impl, torch_impl = load_impl(), ref_impl()
    ws = dist.get_world_size()
    mesh = make_mesh(cfg)

    model_b = build_fsdp(torch_impl, cfg, mesh)
    model_a = build_fsdp(impl, cfg, mesh)
    if cfg.shard_dim is not None:  # shard_placement_fn: the same placements and local shards as torch's
        layout_a, layout_b = placements_of(model_a), placements_of(model_b)
        assert layout_a == layout_b, f"placements and local shapes differ from torch's: {layout_a} vs {layout_b}"
        assert any(f"Shard(dim={cfg.shard_dim % 2})" in v for v in layout_b.values()), layout_b
    if cfg.mesh in ("flat", "hsdp_flat"):  # the parameters live on the flattened dim, as torch's do
        names = {p.device_mesh.mesh_dim_names for m in (model_a, model_b) for p in m.parameters()}
        assert names == {mesh.mesh_dim_names} and "dp_shard_cp" in mesh.mesh_dim_names, names
    init_a, init_b = full_params(model_a), full_params(model_b)
    # Same init on both sides (meta init: same seed; otherwise sharding preserves values).
    for n in init_b:
        assert_close(f"initial param {n!r}", init_a[n], init_b[n], dict(rtol=0, atol=0))
    if not cfg.meta:
        torch.manual_seed(0)
        plain = Transformer(cfg.model_args)
        for n, p in plain.named_parameters():
            assert_close(f"initial param {n!r} vs unsharded init", init_a[n], p.detach(), dict(rtol=0, atol=0))

    res_b = train_fsdp(torch_impl, model_b, cfg)
    res_a = train_fsdp(impl, model_a, cfg)
    mp_on = cfg.mp is not None
    compare(f"[{impl.name} vs torch]", res_a, res_b, BF16_TOL if mp_on else FP32_TOL)

    if cfg.ignored:
        # Ignored parameters are neither sharded nor reduced: plain tensors with
        # rank-local gradients, so no unsharded reference exists.
        assert not isinstance(model_a.pos_embeddings.weight, DTensor), "ignored param must not be sharded"
        return
    ref = Transformer(cfg.model_args)
    if cfg.frozen:
        freeze_some(ref)
    ref.load_state_dict(init_b, strict=False)
    res_r = train_reference(ref, cfg, n_data_ranks=ws)
    if mp_on:
        compare(f"[{impl.name} vs unsharded fp32]", res_a, res_r, None, losses_only=True, loss_tol=REF_BF16_LOSS_TOL)
        return
    if cfg.divide_factor is not None:
        # Gradients are summed over ranks and divided by the factor instead of
        # averaged: the first step's gradients are the reference's * ws / factor
        # (the trajectories then differ, which the A-vs-torch check covers).
        assert_close("[vs unsharded] step-0 loss", res_a["losses"][0], res_r["losses"][0], REF_TOL)
        for n, g in res_r["grads0"].items():
            assert_close(
                f"[{impl.name} vs unsharded] grad of {n!r} with divide factor {cfg.divide_factor}",
                res_a["grads0"][n],
                None if g is None else g * ws / cfg.divide_factor,
                REF_TOL,
            )
        return
    compare(f"[{impl.name} vs unsharded]", res_a, res_r, REF_TOL)


# ---------------------------------------------------------------------------
# Grids (each function is one spawn)
# ---------------------------------------------------------------------------
def _ws1_grid():
    run_grid(
        grid(model=["even", "odd"], mp=[None, "bf16"], reshard=[True, False]) + [dict(shard_dim=1, model="odd", mp="bf16")],
        check_parity,
        name="ws1",
    )


def _ws2_core_grid():
    configs = grid(
        model=["even", "odd"],
        mp=[None, "bf16"],
        reshard=[True, False, 1],
        prefetch=[False, True],
    )
    configs += [
        dict(model="odd", mp="bf16_out32", reshard=True, prefetch=True),
        dict(model="odd", mp="bf16_blocks_out32", reshard=True),
        dict(model="even", mp="bf16_nocast", reshard=True),
        dict(model="even", mp="bf16_out32", reshard=False, optim="sgd"),
        dict(model="odd", optim="sgd", steps=5),
    ]
    run_grid(configs, check_parity, name="ws2")


def _ws2_feature_grid():
    configs = [
        dict(accum=2),
        dict(accum=3, model="odd", reshard=False),
        dict(accum=2, reshard_after_backward=False),
        dict(accum=2, mp="bf16"),
        dict(offload=True),
        dict(offload=True, model="odd", mp="bf16", accum=2),
        dict(ac=True),
        dict(ac=True, mp="bf16", model="odd"),
        dict(meta=True),
        dict(meta=True, model="odd", offload=True),
        dict(frozen=True),
        dict(frozen=True, mp="bf16", reshard=False),
        dict(tied=True),
        dict(tied=True, model="odd", optim="sgd"),
        dict(twice=True),
        dict(twice=True, reshard=False),
        dict(nested=True),
        dict(nested=True, model="odd", prefetch=True),
        dict(ignored=True),
        dict(async_unshard=True),
        dict(async_unshard=True, reshard=False, model="odd"),
        dict(divide_factor=1.0),
        dict(divide_factor=8.0, model="odd", optim="sgd"),
        dict(clip=0.05),
        dict(clip=0.05, model="odd", optim="sgd", accum=2),
        # shard_placement_fn: matrices on dim 1 (-1) where it divides the shard group, the
        # rest on dim 0, mixed within units (torchtitan shards MoE experts so).
        dict(shard_dim=1),
        dict(shard_dim=1, model="odd", mp="bf16", prefetch=True),
        dict(shard_dim=-1, model="odd", accum=2, reshard=False, clip=0.05),
        dict(shard_dim=1, offload=True, model="odd", mp="bf16", accum=2),
        dict(shard_dim=1, meta=True, tied=True, frozen=True),
        dict(shard_dim=1, nested=True, ac=True, async_unshard=True),
    ]
    run_grid(configs, check_parity, name="ws2-features")


def _ws4_grid():
    configs = grid(mesh=["hsdp"], model=["even", "odd"], mp=[None, "bf16"], reshard=[True, False])
    configs += [
        dict(mesh="hsdp", accum=2, prefetch=True),
        dict(mesh="hsdp", clip=0.05, model="odd"),
        dict(mesh="hsdp", meta=True, tied=True),
        # 1-D mesh over 4 ranks: reshard_after_forward=2 reshards to a group of 2.
        dict(mesh="1d", model="odd", reshard=2),
        dict(mesh="1d", model="even", reshard=2, mp="bf16", prefetch=True),
        dict(mesh="1d", model="odd", reshard=True, offload=True),
        dict(mesh="hsdp", shard_dim=1, model="odd", mp="bf16", accum=2),
        dict(mesh="1d", shard_dim=1, prefetch=True),
        # FSDP on a flattened mesh dim (context parallelism's dp_shard_cp), 1-D and HSDP.
        dict(mesh="flat", model="odd", mp="bf16", reshard=2, prefetch=True),
        dict(mesh="hsdp_flat", model="even", mp="bf16", accum=2, clip=0.05),
    ]
    run_grid(configs, check_parity, name="ws4")


def test_parity_world_size_1():
    run_distributed(_ws1_grid, 1)


def test_parity_world_size_2_core_grid():
    run_distributed(_ws2_core_grid, 2)


def test_parity_world_size_2_features():
    run_distributed(_ws2_feature_grid, 2)


def test_parity_world_size_4_hsdp_and_1d():
    run_distributed(_ws4_grid, 4, timeout=400)


# --- requires_grad changed after fully_shard ---------------------------------------------------
#
# torch FSDP2 gives the unsharded parameter the sharded one's requires_grad at every unshard, so
# freezing or unfreezing a parameter after fully_shard (fine-tuning schedules: freeze a block
# after some steps, unfreeze the base) takes effect from the next forward: a frozen parameter
# gets no gradient and the optimizer leaves it alone.

_REQUIRES_GRAD_CHANGES = {
    # Frozen and trainable parameters in the same units (block 0, root), set after fully_shard.
    "freeze_after_shard": {0: lambda m: freeze_some(m)},
    # After a step: a whole unit (block 1) and one root parameter frozen.
    "freeze_unit_mid_training": {1: lambda m: (m.layers[1].requires_grad_(False), m.norm.weight.requires_grad_(False))},
    # Frozen at fully_shard (Cfg.frozen), trainable again after a step; block 1 frozen then back.
    "unfreeze_mid_training": {
        1: lambda m: (m.requires_grad_(True), m.layers[1].requires_grad_(False)),
        2: lambda m: m.layers[1].requires_grad_(True),
    },
}


def _run_step(model, cfg: Cfg, batches, step: int, losses: list) -> None:
    """Forward and backward of one step's micro-batches on this rank's slice of the global
    batch (gradient sync on the last one only); appends the losses."""
    from models import lm_loss

    lo, hi = dist.get_rank() * cfg.local_bsz, (dist.get_rank() + 1) * cfg.local_bsz
    for micro in range(cfg.accum):
        if cfg.accum > 1:
            model.set_requires_gradient_sync(micro == cfg.accum - 1)
        x, y = batches[step * cfg.accum + micro]
        loss = lm_loss(model(x[lo:hi]), y[lo:hi])
        loss.backward()
        losses.append(loss.detach().float().item())


def _train_with_changes(impl, cfg: Cfg, mesh, changes: dict) -> dict:
    from models import _data

    model = build_fsdp(impl, cfg, mesh)
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-2, weight_decay=0.01)
    batches = _data(cfg, dist.get_world_size())
    losses, grads = [], []
    for step in range(cfg.steps):
        if step in changes:
            changes[step](model)
        _run_step(model, cfg, batches, step, losses)
        grads.append({n: None if p.grad is None else full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, grads=grads, params=full_params(model))


def _check_requires_grad_changes(change: str, **kw) -> None:
    cfg = Cfg(frozen=change == "unfreeze_mid_training", steps=4, **kw)
    mesh = make_mesh(cfg)
    changes = _REQUIRES_GRAD_CHANGES[change]
    b = _train_with_changes(ref_impl(), cfg, mesh, changes)
    a = _train_with_changes(load_impl(), cfg, mesh, changes)
    exact = dict(rtol=0, atol=0)
    assert_close("losses per step", a["losses"], b["losses"], exact)
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        for n in gb:
            assert_close(f"grad of {n!r} after step {step}", ga[n], gb[n], exact)
    # The frozen parameters got no gradient in some step, so the schedule was exercised.
    assert any(g is None for gs in b["grads"] for g in gs.values()), "the schedule froze nothing"
    for n in b["params"]:
        assert_close(f"param {n!r}", a["params"][n], b["params"][n], exact)


def _requires_grad_grid():
    configs = grid(change=list(_REQUIRES_GRAD_CHANGES), reshard=[True, False])
    configs += [
        dict(change="freeze_unit_mid_training", mp="bf16", prefetch=True),
        dict(change="unfreeze_mid_training", accum=2, model="odd"),
        dict(change="freeze_after_shard", reshard=1, nested=True),
    ]
    run_grid(configs, _check_requires_grad_changes, name="requires_grad")


def test_requires_grad_changed_after_fully_shard_matches_torch():
    run_distributed(_requires_grad_grid, 2)


# --- optimizer in backward ---------------------------------------------------------------------
#
# torch FSDP2 runs a sharded parameter's post-accumulate-grad hooks once it has written the
# parameter's sharded gradient, so an optimizer stepped from those hooks (torchtune's
# optimizer_in_bwd) trains the model during the backward, with no optimizer.step() after it.


def _train_optimizer_in_backward(impl, cfg: Cfg, mesh) -> dict:
    from models import _data

    model = build_fsdp(impl, cfg, mesh)
    names = {p: n for n, p in model.named_parameters()}
    opts = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.01) for p in model.parameters() if p.requires_grad}
    calls = []

    def step_in_backward(p) -> None:
        calls.append((names[p], isinstance(p.grad, DTensor)))
        opts[p].step()
        opts[p].zero_grad()

    for p in opts:
        p.register_post_accumulate_grad_hook(step_in_backward)
    batches = _data(cfg, dist.get_world_size())
    losses, calls_per_step = [], []
    for step in range(cfg.steps):
        _run_step(model, cfg, batches, step, losses)
        calls_per_step.append(sorted(calls))
        calls.clear()
    return dict(losses=losses, calls=calls_per_step, params=full_params(model))


def _check_optimizer_in_backward(**kw) -> None:
    cfg = Cfg(**kw)
    mesh = make_mesh(cfg)
    b = _train_optimizer_in_backward(ref_impl(), cfg, mesh)
    a = _train_optimizer_in_backward(load_impl(), cfg, mesh)
    assert a["calls"] == b["calls"], f"hook calls per step (name, grad is a DTensor): {a['calls']} vs torch {b['calls']}"
    n_trainable = len(b["calls"][0])
    assert n_trainable > 0 and all(len(c) == n_trainable for c in b["calls"]), b["calls"]
    exact = dict(rtol=0, atol=0)
    assert_close("losses per step", a["losses"], b["losses"], exact)
    for n in b["params"]:
        assert_close(f"param {n!r}", a["params"][n], b["params"][n], exact)


def _optimizer_in_backward_grid():
    configs = grid(reshard=[True, False], mp=[None, "bf16"])
    configs += [
        dict(accum=2, model="odd", frozen=True),
        dict(prefetch=True, tied=True, reshard=1),
        dict(offload=True, mp="bf16"),
    ]
    if dist.get_world_size() == 4:
        configs = [dict(mesh="hsdp"), dict(mesh="hsdp", accum=2, mp="bf16")]
    run_grid(configs, _check_optimizer_in_backward, name="optimizer_in_backward")


def test_optimizer_in_backward_matches_torch():
    run_distributed(_optimizer_in_backward_grid, 2)


def test_optimizer_in_backward_matches_torch_hsdp():
    run_distributed(_optimizer_in_backward_grid, 4, timeout=300)


# --- inference_mode between training steps -----------------------------------------------------
#
# An evaluation or rollout under torch.inference_mode() before or between training steps (RL
# loops): torch FSDP2 runs the inference forward, but a training forward after it raises
# ("Inplace update to inference tensor outside InferenceMode", torch 2.11 to 2.15), since the
# unsharded parameters made in inference mode persist. fsdp_native makes them outside inference
# mode, so training goes on with torch's numbers under torch.no_grad() for the same evaluations.


def _train_with_evals(impl, cfg: Cfg, mesh, eval_mode) -> dict:
    from models import _data, lm_loss, make_optim

    model = build_fsdp(impl, cfg, mesh)
    opt = make_optim(cfg, model.parameters())
    rank, ws = dist.get_rank(), dist.get_world_size()
    batches = _data(cfg, ws)
    lo, hi = rank * cfg.local_bsz, (rank + 1) * cfg.local_bsz
    losses, evals = [], []
    for step in range(cfg.steps):
        x, y = batches[step]
        with eval_mode():  # the first forward ever is this one
            evals.append(model(x[lo:hi]).float().clone())
        loss = lm_loss(model(x[lo:hi]), y[lo:hi])
        loss.backward()
        losses.append(loss.detach().float().item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, evals=evals, params=full_params(model))


def _check_inference_mode_then_training(**kw) -> None:
    cfg = Cfg(**kw)
    mesh = make_mesh(cfg)
    b = _train_with_evals(ref_impl(), cfg, mesh, torch.no_grad)
    if load_impl().name == "torch":  # FSDP_TEST_IMPL=torch: what the comment above says of torch
        try:
            _train_with_evals(ref_impl(), cfg, mesh, torch.inference_mode)
        except RuntimeError as e:
            assert "inference tensor" in str(e).lower(), e
            return
        raise AssertionError("torch FSDP2 trained after an inference_mode forward; update the comment above")
    a = _train_with_evals(load_impl(), cfg, mesh, torch.inference_mode)
    assert all(e.is_inference() for e in a["evals"])
    exact = dict(rtol=0, atol=0)
    for step, (ea, eb) in enumerate(zip(a["evals"], b["evals"])):
        assert_close(f"inference_mode logits before step {step}", ea.clone(), eb, exact)
    assert_close("losses per step", a["losses"], b["losses"], exact)
    for n in b["params"]:
        assert_close(f"param {n!r}", a["params"][n], b["params"][n], exact)


def _inference_mode_grid():
    configs = grid(reshard=[True, False], mp=[None, "bf16"])
    configs += [dict(reshard=1, prefetch=True, model="odd"), dict(offload=True, tied=True)]
    run_grid(configs, _check_inference_mode_then_training, name="inference_mode")


def test_inference_mode_then_training_matches_torch_no_grad():
    run_distributed(_inference_mode_grid, 2)


# --- dtype conversions after fully_shard -------------------------------------------------------
#
# torch FSDP2 takes a sharded model's dtype as it finds it at its lazy init, so module.to(dtype),
# .half() or .float() after fully_shard and before the first forward hold: Accelerate 1.6 to
# 1.12 upcast a bf16 model sharded with a bf16 mixed precision policy by model.to(torch.float32)
# right after its fully_shard calls. fsdp_native lays a unit out again when its parameters'
# dtypes change, before the first forward or between steps (where torch FSDP2 raises).

_CONVERSIONS = {
    "to_bf16": lambda m: m.to(torch.bfloat16),
    "half_then_float": lambda m: (m.half(), m.float()),
    "upcast": lambda m: m.to(torch.float32),  # of a model sharded in bf16 (Cfg.dtype)
    # One module of each block unit: mixed dtypes in a unit (torch FSDP2 raises, it wants one
    # original dtype per unit with mixed precision; fsdp_native shards such units).
    "one_module": lambda m: [layer.attention.wq.to(torch.bfloat16) for layer in m.layers],
}


def _train_converted(impl, cfg: Cfg, mesh, conversion: str, at: int, rebuild: bool = False) -> dict:
    """Trains `cfg.steps` steps with the conversion before step `at` and a fresh optimizer from
    there (the old one's states keep the old dtypes). `rebuild`: instead of converting the model,
    a new one is sharded, converted before its first forward and given the old one's values."""
    from models import _data, make_optim

    model = build_fsdp(impl, cfg, mesh)
    batches = _data(cfg, dist.get_world_size())
    losses, opt = [], None
    for step in range(cfg.steps):
        if step == at:
            if rebuild:
                old, model = model, build_fsdp(impl, cfg, mesh)
                _CONVERSIONS[conversion](model)
                with torch.no_grad():
                    for p, q in zip(model.parameters(), old.parameters()):
                        p.copy_(q)
            else:
                _CONVERSIONS[conversion](model)
            opt = None
        if opt is None:
            opt = make_optim(cfg, model.parameters())
        _run_step(model, cfg, batches, step, losses)
        opt.step()
        opt.zero_grad()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    return dict(losses=losses, params=full_params(model), dtypes=dtypes)


def _check_conversion(conversion: str, at: int = 0, **kw) -> None:
    cfg = Cfg(steps=3, dtype=torch.bfloat16 if conversion == "upcast" else None, **kw)
    mesh = make_mesh(cfg)
    if conversion == "one_module":
        # Against the same module converted before fully_shard (Cfg.dtype converts all).
        b = _train_converted(load_impl(), cfg, mesh, conversion, at, rebuild=True)
    else:
        # torch FSDP2 converts before its lazy init only: later, a rebuilt model stands in.
        b = _train_converted(ref_impl(), cfg, mesh, conversion, at, rebuild=at > 0)
    if at > 0 and load_impl().name == "torch":  # FSDP_TEST_IMPL=torch: what the comment above says of torch
        try:
            _train_converted(load_impl(), cfg, mesh, conversion, at)
        except RuntimeError as e:
            assert "Expected out tensor to have dtype" in str(e), e
            return
        raise AssertionError("torch FSDP2 trained after a dtype conversion between steps; update the comment above")
    a = _train_converted(load_impl(), cfg, mesh, conversion, at)
    assert a["dtypes"] == b["dtypes"], f"dtypes after the conversion: {a['dtypes']} vs {b['dtypes']}"
    assert len(set(a["dtypes"].values())) == (2 if conversion == "one_module" else 1), a["dtypes"]
    exact = dict(rtol=0, atol=0)
    assert_close("losses per step", a["losses"], b["losses"], exact)
    for n in b["params"]:
        assert_close(f"param {n!r}", a["params"][n], b["params"][n], exact)


def _conversion_errors() -> None:
    if load_impl().name != "fsdp_native":
        return
    cfg = Cfg(mp="bf16", accum=2)
    # Gradients accumulated in fp32 over a micro-batch without sync, then a conversion.
    model = build_fsdp(load_impl(), cfg, make_mesh(cfg))
    from models import _data

    x, y = _data(cfg, dist.get_world_size())[0]
    model.set_requires_gradient_sync(False)
    model(x[: cfg.local_bsz]).float().sum().backward()
    raises_exactly(
        RuntimeError,
        "fsdp_native: the dtype of parameters of unit 'layers.0' changed while the unit was unsharded or had gradients "
        "being reduced or accumulated; change dtypes between optimizer steps",
        lambda: model.to(torch.float64),
    )
    # A DTensor of an integer dtype loaded in place of a (frozen) parameter.
    model = build_fsdp(load_impl(), Cfg(), make_mesh(cfg))
    model.norm.weight.requires_grad_(False)
    sd = {k: v.to(torch.int32) if k == "norm.weight" else v for k, v in model.state_dict().items()}
    raises_exactly(
        ValueError,
        "fsdp_native: parameter 'weight' of LayerNorm (unit '') became a DTensor of dtype torch.int32, expected a "
        "floating-point dtype (it was torch.float32)",
        lambda: model.load_state_dict(sd, assign=True),
    )


def _conversion_grid():
    configs = grid(conversion=["to_bf16", "half_then_float"], mp=[None, "bf16"])
    configs += [
        dict(conversion="upcast", mp="bf16"),
        dict(conversion="upcast", mp="bf16", reshard=False, prefetch=True, at=1),
        dict(conversion="to_bf16", at=1, model="odd", accum=2),
        dict(conversion="to_bf16", meta=True, tied=True, reshard=1),
        dict(conversion="half_then_float", offload=True, nested=True),
        # One unit of two modules: the first converted leaves a unit of mixed dtypes (a byte
        # buffer) until the second is.
        dict(conversion="to_bf16", head_group=True),
        dict(conversion="half_then_float", head_group=True, mp="bf16"),
        dict(conversion="one_module", mp="bf16"),
        dict(conversion="one_module", mp="bf16", at=2, frozen=True),
    ]
    if load_impl().name != "fsdp_native":  # torch FSDP2 cannot run "one_module"
        configs = [c for c in configs if c["conversion"] != "one_module"]
    run_grid(configs, _check_conversion, name="conversion")
    _conversion_errors()


def test_dtype_conversion_after_fully_shard_matches_torch():
    run_distributed(_conversion_grid, 2)
