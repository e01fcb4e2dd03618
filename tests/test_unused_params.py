"""``FSDPModule.set_reduce_scatter_unused_params``: parameters that require grad but got no
gradient in a backward are reduced as zeros, so that every rank reduces the same parameters
when ranks use different ones (mixture of experts, multi-modal models). Without it, a rank
that used expert 0 and a rank that used expert 1 reduce-scatter inputs of the same size whose
slots hold different parameters, and the sum is silently wrong, in torch FSDP2 as in
fsdp_native.

4 ranks, each routing its tokens to its own experts, which change from step to step; an
expert unused on every rank; a unit the backward does not reach (it runs in the forward but
its output is dropped). Checked against torch FSDP2 bit for bit where torch has the method
(2.13 and later), and everywhere against training the unsharded model on every rank with the
gradients averaged by hand (a gradient that no rank produced is zero with the setting, and
absent without it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import native_linear, assert_same_run, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import shard_stack

DIM, STEPS = 6, 3


class Experts(nn.Module):
    """A gate, two experts and one expert no token is ever routed to; ``route``: the experts
    this rank's tokens go to in this forward."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.idle = nn.Linear(DIM, DIM)
        self.route: list[int] = []

    def forward(self, x):
        h = self.gate(x)
        for i in self.route:
            h = h + self.experts[i](x)
        return torch.tanh(h)


class Net(nn.Module):
    def __init__(self, dangling: bool):
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList(Experts() for _ in range(3))
        self.out = nn.Linear(DIM, 1)
        self.spare = nn.Linear(DIM, DIM)  # in the root's unit, never used
        self.dangling = dangling

    def forward(self, x):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if self.dangling and i == 1:
                b(h)  # runs; its output is dropped on every rank, so the backward never reaches it
            else:
                h = b(h)
        return self.out(h).pow(2).mean()


def _route(rank: int, step: int, micro: int) -> list[int]:
    """Ranks use different experts (rank is None: all the same ones), and a rank's experts
    change between steps and micro-batches; some forwards use none, one uses both."""
    k = ((rank or 0) + step + micro) % 4
    return [[0], [1], [], [0, 1]][k]


def _setup(impl, cfg: dict, torch_seed: int = 0) -> nn.Module:
    torch.manual_seed(torch_seed)
    model = Net(cfg.get("dangling", False))
    if cfg.get("frozen"):
        model.blocks[0].idle.requires_grad_(False)
    return model


def _sharded(impl, cfg: dict) -> nn.Module:
    model = shard_stack(impl, _setup(impl, cfg), hsdp=cfg.get("hsdp", False), mp=cfg.get("mp", False))
    flagged = cfg.get("flag", "all")
    if flagged == "all":
        model.set_reduce_scatter_unused_params(True)
    elif flagged == "root":  # this unit only: the blocks keep the default (every rank routes alike)
        model.set_reduce_scatter_unused_params(True, recurse=False)
    return model


def _train(model: nn.Module, cfg: dict, average=None) -> dict:
    """STEPS AdamW steps (weight decay, so a zero gradient moves a parameter that a missing one
    leaves alone) on this rank's own inputs; `average(model)` makes the gradients of the
    unsharded reference before each step."""
    accum = cfg.get("accum", 1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses, has_grad = [], []
    for step in range(STEPS):
        for micro in range(accum):
            if accum > 1 and average is None:
                model.set_requires_gradient_sync(micro == accum - 1)
            for b in model.blocks:
                b.route = _route(None if cfg.get("flag") == "root" else dist.get_rank(), step, micro)
            loss = model(torch.randn(5, 4, generator=gen))
            loss.backward()
            losses.append(loss.item())
        if average is not None:
            average(model)
        has_grad.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params=full_params(model), has_grad=has_grad)


def _averager(cfg: dict):
    """The unsharded reference's gradients: each parameter's summed over ranks and divided by
    the world size, a missing one taken as zero; a parameter no rank produced a gradient for
    gets a zero one where the setting applies to its unit, and none elsewhere."""
    ws = dist.get_world_size()
    flagged = cfg.get("flag", "all")

    def average(model):
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            local = p.grad if p.grad is not None else torch.zeros_like(p)
            got = torch.tensor([float(p.grad is not None)])
            dist.all_reduce(got)
            applies = flagged == "all" or (flagged == "root" and not name.startswith("blocks."))
            if got.item() == 0 and not applies:
                p.grad = None
                continue
            dist.all_reduce(local)
            p.grad = local / ws

    return average


def _torch_runs(torch_impl, cfg: dict) -> bool:
    """Whether torch FSDP2 trains `cfg`: it has the method from 2.13; with mixed precision and
    gradient accumulation, 2.13 fails its reduce-scatter's check ("FSDP reduce-scatter expects
    uniform gradient dtype": the accumulated fp32 gradients beside bf16 zeros), which 2.15
    passes."""
    if not hasattr(torch_impl.FSDPModule, "set_reduce_scatter_unused_params"):
        return False
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return not (cfg.get("mp") and cfg.get("accum", 1) > 1 and version < (2, 15))


def check(**cfg) -> None:
    impl = load_impl()
    if impl.name == "torch" and not _torch_runs(impl, cfg):  # FSDP_TEST_IMPL=torch: what torch cannot train
        return
    what = f"[{impl.name}] {cfg}"
    got = _train(_sharded(impl, cfg), cfg)
    # The unsharded reference: fp32 compute, so a bf16 run is compared within bf16's rounding.
    ref = _train(_setup(impl, cfg), cfg, average=_averager(cfg))
    tol = dict(rtol=2e-2, atol=2e-3) if cfg.get("mp") else dict(rtol=1e-5, atol=1e-6)
    assert got["has_grad"] == ref["has_grad"], f"{what}: parameters with a gradient {got['has_grad']} vs {ref['has_grad']}"
    assert_same_run(f"{what} vs unsharded", got, ref, tol)
    torch_impl = ref_impl()
    if _torch_runs(torch_impl, cfg):
        b = _train(_sharded(torch_impl, cfg), cfg)
        assert got["has_grad"] == b["has_grad"], f"{what}: parameters with a gradient {got['has_grad']} vs torch {b['has_grad']}"
        assert_same_run(f"{what} vs torch", got, b)


def check_errors() -> None:
    m = native_linear()
    if m is None:  # the message is fsdp_native's
        return
    raises_exactly(
        TypeError,
        "set_reduce_scatter_unused_params: argument 'reduce_scatter_unused_params' must be a bool, got str",
        lambda: m.set_reduce_scatter_unused_params("yes"),
    )


def _grid():
    configs = [
        dict(),
        dict(dangling=True, frozen=True),
        dict(flag="root", dangling=True),
        dict(accum=2),
        dict(hsdp=True, dangling=True),
        dict(mp=True, accum=2),
    ]
    run_grid(configs, lambda **cfg: check(**cfg), name="unused-params")
    run_grid([{}], check_errors, name="unused-params-errors")


def test_reduce_scatter_unused_params():
    run_distributed(_grid, 4, timeout=400)
