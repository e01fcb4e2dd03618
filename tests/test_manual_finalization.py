"""Manual backward finalization (torch 2.15's ``FSDPModule.set_manual_backward_finalization``
and ``finalize_backward``): backwards finish nothing at their end, and ``finalize_backward``
does it once per step. The flows of torchtitan's trainer (gradient accumulation with neither
sync nor reshard until the step's end, then one finalization) and of a pipeline stage
(``finalize_backward(async_op=True)``, waited before the optimizer step) train exactly as the
automatic flow (gradient sync on the last micro-batch only), bit for bit, and as torch FSDP2
where torch has the methods (2.15). Also with HSDP, bf16, unused parameters and a unit the
backward does not reach; the errors with their messages.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from dist_utils import assert_same_run, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, shard_stack

STEPS, MICRO = 2, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 6)
        self.spare = nn.Linear(6, 6)  # never used

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(BlockStack):
    """A BlockStack whose block 1 runs but has its output dropped (`dangling`)."""

    def __init__(self, dangling: bool):
        super().__init__(Block, 6, 3)
        self.dangling = dangling

    def forward(self, x):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if self.dangling and i == 1:
                b(h)
            else:
                h = b(h)
        return self.out(h)


def _model(impl, cfg: dict) -> nn.Module:
    torch.manual_seed(0)
    model = shard_stack(impl, Net(cfg.get("dangling", False)), hsdp=cfg.get("hsdp", False), mp=cfg.get("mp", False))
    if cfg.get("unused"):
        model.set_reduce_scatter_unused_params(True)
    return model


def _train(impl, cfg: dict, flow: str, micro: int = MICRO) -> dict:
    """`micro` micro-batches a step. flow: "auto" (sync on the last micro-batch), "titan"
    (manual: no sync and no reshard for every micro-batch, then sync and reshard on and one
    finalize_backward), "stage" (manual: sync on the last micro-batch,
    finalize_backward(async_op=True), waited before the step)."""
    model = _model(impl, cfg)
    if flow != "auto":
        model.set_manual_backward_finalization(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        if flow == "titan":
            model.set_reshard_after_backward(False)
            model.set_requires_gradient_sync(False)
        for m in range(micro):
            if flow in ("auto", "stage"):
                model.set_requires_gradient_sync(m == micro - 1)
            loss = model(torch.randn(5, 4, generator=gen)).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        if flow == "titan":
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            assert model.finalize_backward() is None
        elif flow == "stage":
            # The root's unit (reached through no module's inputs) is left for the finalization.
            assert not isinstance(model.out.weight, DTensor), f"{impl.name}: the root unit was finished before finalize_backward"
            handle = model.finalize_backward(async_op=True)
            handle.wait()
            assert isinstance(model.out.weight, DTensor), f"{impl.name}: the root unit is not resharded after finalize_backward"
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params=full_params(model))


def check(**cfg) -> None:
    impl = load_impl()
    if not hasattr(impl.FSDPModule, "finalize_backward"):  # FSDP_TEST_IMPL=torch before 2.15
        return
    torch_impl = ref_impl()
    torch_has = hasattr(torch_impl.FSDPModule, "finalize_backward")
    # One micro-batch a step as well: the manual flows with a synced backward.
    for flow, micro in (("titan", MICRO), ("stage", MICRO), ("titan", 1), ("stage", 1)):
        got = _train(impl, cfg, flow, micro)
        assert_same_run(f"[{impl.name}] {cfg} {flow} x{micro} vs automatic", got, _train(impl, cfg, "auto", micro))
        if torch_has:
            assert_same_run(f"[{impl.name}] {cfg} {flow} x{micro} vs torch", got, _train(torch_impl, cfg, flow, micro))


def check_errors() -> None:
    impl = load_impl()
    if impl.name != "fsdp_native":  # the messages are fsdp_native's
        return
    model = _model(impl, {})
    raises_exactly(TypeError, "set_manual_backward_finalization: argument 'enabled' must be a bool, got int",
                   lambda: model.set_manual_backward_finalization(1))  # fmt: skip
    assert model.finalize_backward() is None  # before the first forward: nothing to do
    model.finalize_backward(async_op=True).wait()
    model(torch.randn(2, 4)).sum().backward()
    raises_exactly(
        RuntimeError,
        "finalize_backward requires manual backward finalization; call set_manual_backward_finalization(True) "
        "on the root module before forward",
        model.finalize_backward,
    )
    for name, call in (
        ("set_manual_backward_finalization", lambda: model.blocks[0].set_manual_backward_finalization(True)),
        ("finalize_backward", model.blocks[0].finalize_backward),
    ):
        raises_exactly(RuntimeError, f"{name} must be called on the root module (the first one forwarded)", call)
    model.set_manual_backward_finalization(True)
    model(torch.randn(2, 4)).sum().backward()
    raises_exactly(
        RuntimeError,
        "set_manual_backward_finalization cannot change mode after backward starts, before finalize_backward",
        lambda: model.set_manual_backward_finalization(False),
    )

    def during_backward(grad):
        raises_exactly(RuntimeError, "set_manual_backward_finalization cannot change mode during backward",
                       lambda: model.set_manual_backward_finalization(False))  # fmt: skip
        raises_exactly(RuntimeError, "finalize_backward must be called after backward completes", model.finalize_backward)
        return grad

    out = model(torch.randn(2, 4))
    out.register_hook(during_backward)
    out.sum().backward()
    handle = model.finalize_backward(async_op=True)
    raises_exactly(
        RuntimeError,
        "finalize_backward: the previous gradient reduction must be waited on before finalizing backward again",
        model.finalize_backward,
    )
    handle.wait()
    model.set_manual_backward_finalization(False)  # between iterations: allowed
    model(torch.randn(2, 4)).sum().backward()
    # HSDP keeping reduce-scattered gradients for a later all-reduce: not supported, as in torch.
    hsdp = _model(impl, dict(hsdp=True))
    hsdp.set_manual_backward_finalization(True)
    hsdp.set_requires_all_reduce(False)
    hsdp(torch.randn(2, 4)).sum().backward()
    raises_exactly(
        RuntimeError,
        "finalize_backward: manual backward finalization does not support partial gradient reductions (unit 'root' has "
        "gradients and set_requires_all_reduce(False)); call set_requires_all_reduce(True) before finalizing, or use "
        "automatic finalization",
        hsdp.finalize_backward,
    )
    hsdp.set_requires_all_reduce(True)
    hsdp.finalize_backward()
    assert hsdp.out.weight.grad is not None, "the root unit's gradients after finalizing"
    # A non-root unit asking before the first forward: the first forward raises, on every rank.
    other = _model(impl, {})
    other.blocks[1].set_manual_backward_finalization(True)
    raises_exactly(
        RuntimeError,
        "set_manual_backward_finalization must be called on the root module (the first one forwarded)",
        lambda: other(torch.randn(2, 4)),
    )


def _grid():
    configs = [dict(), dict(mp=True), dict(hsdp=True), dict(unused=True, dangling=True)]
    run_grid(configs, lambda **cfg: check(**cfg), name="manual-finalization")
    run_grid([{}], check_errors, name="manual-finalization-errors")


def test_manual_backward_finalization():
    run_distributed(_grid, 4, timeout=400)
