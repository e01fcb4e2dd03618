"""Activation checkpointing around sharded blocks, in the forms users apply it.

* ``checkpoint(block, h, use_reentrant=...)`` called on each sharded block, FSDP's hooks
  inside the checkpoint, as Hugging Face models did under ``gradient_checkpointing_enable``
  up to transformers 4.x, whose default was ``use_reentrant=True`` (many QLoRA recipes still
  pass it; transformers 5 checkpoints the layer's ``forward`` instead, inside the hooks);
* ``checkpoint_wrapper(block, checkpoint_impl=REENTRANT | NO_REENTRANT)`` applied before
  ``fully_shard``, as torchtitan and Accelerate's ``activation_checkpointing`` do.
* one checkpoint around two sharded blocks together (a region of two units).

With ``use_reentrant=True`` the block's forward runs without grad, so it registers no backward
hooks, and the backward recomputes it and runs the recompute's own backward. Until
2026-11-28 fsdp_native then never reduced the block's gradients: every sharded block's
parameters kept ``grad=None`` and did not train, silently. Checked for every form, with a block
that holds a nested unit too, in fp32 and with a bf16 policy (and the reentrant form with
gradient accumulation and CPU offload): bit for bit torch FSDP2's
losses, gradients and parameters, and the same as training without checkpointing."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from dist_utils import assert_close, assert_same_run, full, full_params, grid, load_impl, ref_impl, run_distributed, run_grid
from models import BlockStack, ResidualMLP

EXACT = dict(rtol=0, atol=0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = ResidualMLP(6, 10)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(self.mlp(x))


class CheckpointedStack(BlockStack):
    """``checkpoint(block, h)`` around each block when `call` is set (the Hugging Face form);
    with `pairs`, one checkpoint around blocks 0 and 1 together (a region of two units)."""

    call: str | None = None  # None | "reentrant" | "non_reentrant"
    pairs: bool = False

    def forward(self, x):
        h = self.inp(x)
        if self.call is None:
            for b in self.blocks:
                h = b(h)
        else:
            regions = [lambda t: self.blocks[1](self.blocks[0](t)), self.blocks[2]] if self.pairs else list(self.blocks)
            for region in regions:
                h = checkpoint(region, h, use_reentrant=self.call == "reentrant")
        return self.out(h)


def _run(impl, form: str, nested: bool, mp: bool, accum: int = 1, offload: bool = False) -> dict:
    torch.manual_seed(0)
    model = CheckpointedStack(Block, dim=6, n=3)
    if form.startswith(("call_", "pairs_")):
        model.call = form.split("_", 1)[1]
        model.pairs = form.startswith("pairs_")
    elif form.startswith("wrapper_"):
        kind = CheckpointImpl.REENTRANT if form == "wrapper_reentrant" else CheckpointImpl.NO_REENTRANT
        model.blocks = nn.ModuleList(checkpoint_wrapper(b, checkpoint_impl=kind) for b in model.blocks)
    kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if mp else {}
    if offload:
        kw["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=False)
    for b in model.blocks:
        if nested:
            impl.fully_shard(b._checkpoint_wrapped_module.mlp if form.startswith("wrapper_") else b.mlp, **kw)
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses, grads = [], None
    for step in range(3):
        for micro in range(accum):  # gradient sync off but on the last micro-batch
            if accum > 1:
                model.set_requires_gradient_sync(micro == accum - 1)
            loss = model(torch.randn(4, 4, generator=gen)).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        if step == 0:
            grads = {n: None if p.grad is None else full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params=full_params(model), grads=grads)


def _strip(names_to_values: dict) -> dict:
    """Parameter names without checkpoint_wrapper's prefix, to compare with the plain model."""
    return {n.replace("._checkpoint_wrapped_module", ""): v for n, v in names_to_values.items()}


def _body(form: str, nested: bool, mp: bool, accum: int = 1, offload: bool = False) -> None:
    what = f"[{form}, nested {nested}, mp {mp}, accum {accum}, offload {offload}]"
    ours, theirs = _run(load_impl(), form, nested, mp, accum, offload), _run(ref_impl(), form, nested, mp, accum, offload)
    missing = sorted(n for n, g in ours["grads"].items() if g is None)
    assert not missing, f"{what}: parameters without a gradient after the first backward: {missing}"
    assert_same_run(what, ours, theirs)
    for n, g in theirs["grads"].items():
        assert_close(f"{what} first gradient of {n}", ours["grads"][n], g, EXACT)
    plain = _run(load_impl(), "none", nested, mp, accum, offload)  # no checkpointing: the same numbers
    assert_same_run(f"{what} against no checkpointing", dict(losses=ours["losses"], params=_strip(ours["params"])), plain)


def _check() -> None:
    forms = ["call_reentrant", "call_non_reentrant", "pairs_reentrant", "pairs_non_reentrant", "wrapper_reentrant",
             "wrapper_non_reentrant"]
    # and the reentrant form with gradient accumulation and CPU offload
    extra = [dict(form="call_reentrant", nested=True, mp=mp, accum=2, offload=offload) for mp, offload in ((False, True), (True, False))]
    run_grid(grid(form=forms, nested=[False, True], mp=[False, True]) + extra, _body)


def test_activation_checkpointing_forms_match_torch():
    run_distributed(_check, 2)
