"""torch.amp with fully_shard, as FSDP2 users run it.

* fp16 training with a gradient scaler (GPUs without bf16):
  ``MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)`` with torch's
  ``ShardedGradScaler`` or ``torch.amp.GradScaler``, unchanged. One rank's batch on step 2
  overflows fp16 in the backward. The scaler must skip that step on every rank, though only
  the rank owning the gradient shard that holds the inf sees it, and halve its scale. Checked
  against torch FSDP2, bit for bit: losses, scales, which steps ran, and the parameters. With
  gradient accumulation too.
* ``torch.autocast`` instead of (or on top of) a mixed precision policy: fp32 parameters,
  bf16 matmuls. Bit for bit torch FSDP2's."""
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from dist_utils import assert_same_run, full_params, grid, load_impl, ref_impl, run_distributed, run_grid
from models import BlockStack, ResidualMLP, shard_stack

STEPS, OVERFLOW_STEP = 5, 2


def _train(impl, scaler_kind: str, accum: int) -> dict:
    torch.manual_seed(0)
    model = shard_stack(impl, BlockStack(lambda: ResidualMLP(6, 10), dim=6, n=2),
                        mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if scaler_kind == "sharded":
        scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10, growth_interval=2)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses, scales, ran = [], [], []
    for step in range(STEPS):
        before = full_params(model)
        for micro in range(accum):
            if accum > 1:
                model.set_requires_gradient_sync(micro == accum - 1)
            x = torch.randn(4, 4, generator=gen)
            if step == OVERFLOW_STEP and dist.get_rank() == 1:
                x = x * 300  # the scaled gradients overflow fp16 on this rank only
            loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            losses.append(loss.item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        after = full_params(model)
        ran.append(any(not torch.equal(before[n], after[n]) for n in after))
    return dict(losses=losses, params=full_params(model), scales=scales, ran=ran)


def _body(scaler_kind: str, accum: int) -> None:
    ours, theirs = _train(load_impl(), scaler_kind, accum), _train(ref_impl(), scaler_kind, accum)
    expected = [step != OVERFLOW_STEP for step in range(STEPS)]
    assert ours["ran"] == expected, f"steps that changed the parameters: {ours['ran']}, expected {expected}"
    assert ours["scales"][OVERFLOW_STEP] == ours["scales"][OVERFLOW_STEP - 1] / 2, f"scales {ours['scales']}"
    assert ours["scales"] == theirs["scales"], f"scales {ours['scales']} vs torch's {theirs['scales']}"
    assert ours["ran"] == theirs["ran"]
    assert_same_run(f"[{scaler_kind}, accum {accum}]", ours, theirs)


def _check() -> None:
    run_grid(grid(scaler_kind=["sharded", "amp"], accum=[1, 2]), _body)


def test_fp16_grad_scalers_as_torch():
    run_distributed(_check, 2)


def _autocast_run(impl, policy: bool) -> dict:
    torch.manual_seed(0)
    kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if policy else {}
    model = shard_stack(impl, BlockStack(lambda: ResidualMLP(6, 10), dim=6, n=2), **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses = []
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(4, 4, generator=gen))
        assert out.dtype == torch.bfloat16, out.dtype
        loss = out.float().pow(2).mean()
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, params=full_params(model))


def _autocast_body(policy: bool) -> None:
    assert_same_run(f"[autocast, policy {policy}]", _autocast_run(load_impl(), policy), _autocast_run(ref_impl(), policy))


def _autocast_check() -> None:
    run_grid(grid(policy=[False, True]), _autocast_body)


def test_autocast_as_torch():
    run_distributed(_autocast_check, 2)
