"""``share_comm_ctx``: several roots (each pipeline stage's model chunk on a rank) share one
communication context. Two chunks, each its own root, trained one after the other in each
step: the losses and parameters are torch FSDP2's bit for bit with the call in both (and
fsdp_native's without it); a module that is not an FSDP module is refused. What is shared,
CUDA streams, is checked on a GPU (``tests/test_cuda_runtime.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import assert_same_run, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import ResidualMLP, shard_stack


class Chunk(nn.Module):
    """A pipeline stage's chunk: blocks (each a unit) plus a linear layer in the root's unit."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.inp = nn.Linear(d_in, 6)
        self.blocks = nn.ModuleList(ResidualMLP() for _ in range(2))
        self.out = nn.Linear(6, d_out)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _train(impl, share: bool, mp: bool, hsdp: bool) -> dict:
    torch.manual_seed(0)
    a = shard_stack(impl, Chunk(4, 6), hsdp=hsdp, mp=mp)
    b = shard_stack(impl, Chunk(6, 1), hsdp=hsdp, mp=mp)
    if share:
        impl.module.share_comm_ctx([a, b])
    params = [*a.parameters(), *b.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses = []
    for _ in range(3):
        loss = b(a(torch.randn(5, 4, generator=gen))).float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params={**{f"a.{k}": v for k, v in full_params(a).items()}, **{f"b.{k}": v for k, v in full_params(b).items()}})


def check(mp: bool = False, hsdp: bool = False) -> None:
    impl = load_impl()
    what = f"[{impl.name}] mp={mp} hsdp={hsdp}"
    got = _train(impl, True, mp, hsdp)
    assert_same_run(f"{what}: shared vs torch", got, _train(ref_impl(), True, mp, hsdp))
    assert_same_run(f"{what}: shared vs not", got, _train(impl, False, mp, hsdp))


def check_errors() -> None:
    impl = load_impl()
    assert impl.module.share_comm_ctx([]) is None
    if impl.name != "fsdp_native":  # the message is fsdp_native's
        return
    raises_exactly(
        ValueError,
        "share_comm_ctx: argument 'modules' holds a Linear, expected modules sharded by fsdp_native.fully_shard",
        lambda: impl.module.share_comm_ctx([nn.Linear(2, 2)]),
    )


def _grid():
    run_grid([dict(), dict(mp=True), dict(hsdp=True)], check, name="share-comm-ctx")
    run_grid([{}], check_errors, name="share-comm-ctx-errors")


def test_share_comm_ctx_matches_torch():
    run_distributed(_grid, 4, timeout=300)
