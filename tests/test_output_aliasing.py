"""A unit whose forward returns its own parameter, or a view of it: prompt tuning's learned
tokens (``self.prompt.expand(batch, -1, -1)``), a learned position table sliced to the sequence
(``self.table[:n]``), or the parameter itself.

The output then shares memory with the unit's unsharded parameter, and the reshard after
forward frees that memory. Torch FSDP2 returns such outputs as they are, and the caller's next
op fails (``setStorage: ... out of bounds for storage of size 0`` for a slice or the parameter)
or the process dies of a segmentation fault (``expand``: torch 2.13 CPU, seen 2026-12-02).
fsdp_native raises a ValueError at the unit's post-forward instead, on every rank, naming the
unit, the parameter and the two ways out. Both ways out train here as torch FSDP2 does: the
unit sharded with ``reshard_after_forward=False`` (bit for bit torch FSDP2 and within 1e-6 of
unsharded), and a forward returning ``.clone()``. In fp32 and with a bf16 policy (there the
unsharded parameters are bf16 views of a bf16 buffer)."""
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import assert_same_run, full_params, rank_mean, grid, load_impl, raises_exactly, ref_impl, run_distributed, run_grid

STEPS = 3
TOL = dict(rtol=1e-6, atol=1e-6)


class Prompt(nn.Module):
    """Learned tokens; `mode` says how the forward returns them."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.prompt = nn.Parameter(torch.randn(3, 8))

    def forward(self, batch: int):
        p = self.prompt.clone() if self.mode.endswith("clone") else self.prompt
        if self.mode.startswith("expand"):
            return p.unsqueeze(0).expand(batch, -1, -1)
        if self.mode.startswith("slice"):
            return p[:2].unsqueeze(0).expand(batch, -1, -1)
        return p.unsqueeze(0).expand(batch, -1, -1) if self.mode.endswith("clone") else p


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


class PromptModel(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        torch.manual_seed(0)
        self.prompt = Prompt(mode)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        p = self.prompt(x.shape[0])
        h = self.inp(x).unsqueeze(1) + (p if p.dim() == 3 else p.unsqueeze(0))
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _shard(impl, model, mp: bool, prompt_reshard: bool):
    kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else impl.MixedPrecisionPolicy())
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model.prompt, reshard_after_forward=prompt_reshard, **kw)
    impl.fully_shard(model, **kw)
    return model


def _inputs(step: int, rank: int):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model, ranks) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        # The sharded runs pass their own rank's batch; the unsharded one all ranks' batches
        # at once (the loss is a mean over equal batches: the same as the ranks' mean).
        x = torch.cat([_inputs(step, r) for r in ranks])
        loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if dist.is_initialized() and len(ranks) == 1:
        losses = [rank_mean(l) for l in losses]
    return dict(losses=torch.stack(losses), params=full_params(model))


MESSAGE = (
    "fully_shard: the forward of unit 'prompt' returned a tensor (shape {shape}) that shares memory with the "
    "unsharded parameter 'prompt' of FSDPPrompt in unit 'prompt': resharding after forward frees that memory, "
    "so the output would point at freed memory. Return a copy (`.clone()`), or pass reshard_after_forward=False "
    "to that unit's fully_shard."
)
SHAPES = {"param": (3, 8), "slice": (5, 2, 8), "expand": (5, 3, 8)}


def _raises(mode: str, mp: bool) -> None:
    model = _shard(load_impl(), PromptModel(mode), mp, prompt_reshard=True)
    raises_exactly(ValueError, MESSAGE.format(shape=SHAPES[mode]), lambda: model(_inputs(0, dist.get_rank())))


def _trains(mode: str, mp: bool) -> None:
    """The ways out: reshard_after_forward=False on the unit (for the views), or a copy."""
    prompt_reshard = mode.endswith("clone")
    impl, ref = load_impl(), ref_impl()
    got = _train(_shard(impl, PromptModel(mode), mp, prompt_reshard), [dist.get_rank()])
    want = _train(_shard(ref, PromptModel(mode), mp, prompt_reshard), [dist.get_rank()])
    assert_same_run(f"{mode} against torch FSDP2", got, want)
    if not mp:
        unsharded = _train(PromptModel(mode), list(range(dist.get_world_size())))
        assert_same_run(f"{mode} against unsharded", got, unsharded, TOL)


def _body() -> None:
    if load_impl().name == "fsdp_native":  # torch FSDP2 crashes here (the module docstring)
        run_grid(grid(mode=["param", "slice", "expand"], mp=[False, True]), _raises, name="raises")
    run_grid(grid(mode=["param", "slice", "expand", "expand_clone"], mp=[False, True]), _trains, name="trains")


def test_unit_output_sharing_its_parameter_memory():
    run_distributed(_body, 2, timeout=300)
