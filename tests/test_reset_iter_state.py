"""Recovery after a forward or backward raised (torch 2.15's ``FSDPModule.reset_iter_state``).

A block raises in its forward, or in its backward after later blocks have handed their
gradients to the reduce-scatter, on the last micro-batch of one step. The caller catches the
error and calls ``reset_iter_state()`` on the root: every unit is resharded, collectives in
flight complete, and the failed step's gradients are gone, including those that earlier
micro-batches accumulated without sync (fp32 accumulations of bf16 gradients too) and HSDP's
partial sums. The run then goes on exactly as one that skipped that step's micro-batches,
bit for bit, and as torch FSDP2 2.15. torch 2.13 and 2.14 have the method too, but keep the
gradients of the failed step (the sharded ones already reduced, and the no-sync
accumulations, added to the next step's), contrary to their own docstring; fsdp_native
discards them on every torch, as 2.15 does. Also: an asynchronous finalization's handle is
invalidated, and a non-root module refuses, with torch's messages.

Without the reset (the caller catches a failed backward and only zeroes the gradients, as
out-of-memory handlers do): the units stay mid-backward. Torch FSDP2 2.13 trains on from there,
and its losses drift from those of the run that skipped the step (seen 2026-12-02: 0.104
against 0.078 the step after). fsdp_native resets at the next forward, with a warning (checked
exactly, at that forward only), and the run is again the one that skipped the step, bit for bit.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.torch_version import TorchVersion

from dist_utils import assert_same_run, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from fsdp_native._state import ABORTED_BACKWARD_WARNING
from models import BlockStack, shard_stack

STEPS, FAIL_STEP, FAIL_BLOCK = 4, 1, 1
# torch FSDP2 discards the failed step's gradients from 2.15 (2.13 and 2.14 keep them).
TORCH_RESET_DISCARDS = TorchVersion(torch.__version__) >= "2.15"


class Boom(Exception):
    pass


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise Boom("backward")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 6)
        self.fail = None  # "forward" or "backward": raise there

    def forward(self, x):
        if self.fail == "forward":
            raise Boom("forward")
        h = self.fc1(x)
        if self.fail == "backward":
            h = _FailInBackward.apply(h)
        return x + self.fc2(torch.relu(h))


def _model(impl, cfg: dict) -> nn.Module:
    torch.manual_seed(0)
    kw = {"reshard_after_forward": cfg["raf"]} if "raf" in cfg else {}
    model = shard_stack(impl, BlockStack(Block, 6, 3), hsdp=cfg.get("hsdp", False), mp=cfg.get("mp", False), **kw)
    if cfg.get("max_inputs"):
        model.set_reduce_scatter_max_input_buffers(cfg["max_inputs"])
    return model


def _assert_clean(impl, model) -> None:
    """After reset_iter_state: every parameter registered sharded, no gradient anywhere."""
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{impl.name}: {n} is not resharded after reset_iter_state"
        assert p.grad is None, f"{impl.name}: {n} kept a gradient of the failed step"
    if impl.name == "fsdp_native":  # its own accounting of unsharded bytes
        current = impl.unsharded_stats(model).current_bytes
        assert current == 0, f"{impl.name}: {current} unsharded bytes after reset_iter_state"


def _train(impl, cfg: dict, fail: str | None, reset: bool = True) -> dict:
    """AdamW steps of `cfg["accum"]` micro-batches (sync on the last; HSDP `partial`: sync on
    every one, the all-reduce on the last). At step FAIL_STEP the last micro-batch fails in `fail` ("forward" or
    "backward") and the root's reset_iter_state recovers; `fail=None`: that step's
    micro-batches are skipped (their inputs drawn all the same), the expected outcome.
    `reset=False` (a failed backward): the caller only zeroes the gradients, as an
    out-of-memory handler does (fairseq's), and fsdp_native resets at the next forward, with
    a warning."""
    model = _model(impl, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    accum = cfg.get("accum", 1)
    losses = []
    warn_next = False
    for step in range(STEPS):
        for micro in range(accum):
            last = micro == accum - 1
            if cfg.get("partial"):  # reduce-scatter every micro-batch, all-reduce on the last
                model.set_requires_all_reduce(last)
            else:
                model.set_requires_gradient_sync(last)
            x = torch.randn(5, 4, generator=gen)
            if step != FAIL_STEP:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    loss = model(x).pow(2).mean()
                got = [str(w.message) for w in seen]
                want = [ABORTED_BACKWARD_WARNING] if warn_next else []
                assert got == want, f"{impl.name}: warnings at the forward after the failed step: {got}, expected {want}"
                warn_next = False
                loss.backward()
                losses.append(loss.item())
            elif fail is not None and last:
                model.blocks[FAIL_BLOCK].fail = fail
                try:
                    model(x).pow(2).mean().backward()
                except Boom:
                    pass
                else:
                    raise AssertionError(f"the {fail} did not raise")
                model.blocks[FAIL_BLOCK].fail = None
                if fail == "forward":  # the failing block was left unsharded
                    assert not isinstance(model.blocks[FAIL_BLOCK].fc1.weight, DTensor)
                if reset:
                    model.reset_iter_state()
                    _assert_clean(impl, model)
                else:
                    opt.zero_grad()
                    warn_next = True
            elif fail is not None:
                model(x).pow(2).mean().backward()  # accumulated, then discarded by the reset
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params=full_params(model))


def check(**cfg) -> None:
    impl = load_impl()
    if impl.name == "torch" and not TORCH_RESET_DISCARDS:  # FSDP_TEST_IMPL=torch before 2.15
        return
    skipped = _train(impl, cfg, None)
    for fail in ("forward", "backward"):
        got = _train(impl, cfg, fail)
        assert_same_run(f"[{impl.name}] {cfg} fails in {fail}, reset vs the step skipped", got, skipped)
        if TORCH_RESET_DISCARDS:
            assert_same_run(f"[{impl.name}] {cfg} fails in {fail}, reset vs torch", got, _train(ref_impl(), cfg, fail))
    if impl.name == "fsdp_native":  # torch FSDP2 trains on without the reset (the module docstring)
        got = _train(impl, cfg, "backward", reset=False)
        assert_same_run(f"[{impl.name}] {cfg} fails in backward, no reset vs the step skipped", got, skipped)


def check_handle_and_errors() -> None:
    """An asynchronous finalization's handle, invalidated by the reset (its gradients
    discarded), and a reset asked of a non-root module: torch's messages."""
    impl = load_impl()
    if impl.name == "torch" and not TORCH_RESET_DISCARDS:
        return
    model = _model(impl, {})
    model.set_manual_backward_finalization(True)
    model(torch.randn(5, 4)).sum().backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    raises_exactly(RuntimeError, "This gradient reduction handle was invalidated", handle.wait)
    _assert_clean(impl, model)
    raises_exactly(RuntimeError, "reset_iter_state must be called on the root FSDP module", model.blocks[0].reset_iter_state)
    # Training goes on: the next step's gradients are there, and reduced.
    model(torch.randn(5, 4)).sum().backward()
    model.finalize_backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    missing = [n for n, g in grads.items() if g is None]
    assert not missing, f"{impl.name}: no gradient after the reset for {missing}"


def _grid():
    configs = [
        dict(),
        dict(accum=3),
        dict(accum=3, mp=True),
        dict(accum=3, hsdp=True, partial=True),
        dict(max_inputs=3),
        dict(raf=2, accum=2),  # resharded to pairs of ranks after forward: the backward's shards dropped
    ]
    run_grid(configs, lambda **cfg: check(**cfg), name="reset-iter-state")
    run_grid([{}], check_handle_and_errors, name="reset-iter-state-handle")


def test_reset_iter_state():
    run_distributed(_grid, 4, timeout=400)
