"""Training loops as users write them, beyond the plain step.

* **Layer drop** (stochastic depth, or conditional computation): some blocks, each a unit of its
  own, are skipped in some steps, the same on every rank. A skipped unit is neither gathered
  nor reduced that step, and its parameters get no new gradient. The loop alternates
  ``zero_grad(set_to_none=False)`` and ``zero_grad(set_to_none=True)``, so a skipped unit holds
  zero gradients in some steps (AdamW still moves its parameters then) and None in others
  (AdamW leaves them alone).
* **Fused AdamW with parameter groups** (weight decay on the matrices only, as Hugging Face
  and most training scripts set it).
* **Muon** (``torch.optim.Muon``) for the blocks' weight matrices, AdamW for the rest (the
  input and output layers, the biases), as the Muon recipes set it. Muon orthogonalizes each
  matrix's update with Newton-Schulz iterations, run on the sharded DTensor parameter.
* **A GAN**: two root modules, each with nested units and an optimizer of its own. The
  discriminator runs three times per step: on real data and on the detached generator output
  (its own backward), then on the generator output again in the generator's backward, whose
  gradients reach the discriminator's units too and are zeroed before its next step. Losses
  and parameters of both models are compared.

* **In-place ops on a unit's output that is a view** (``h = block(h); h += c``, each block
  returning a slice of its result), with ``reshard_after_forward=False``. The in-place op
  gives the view a new autograd node, so the pre-backward hook registered on its old one never
  runs. Torch FSDP2's end-of-backward callback still reduces those units' gradients; the first
  block, whose input needs no gradient, has nothing else that would (fsdp_native left its
  gradients unreduced, None on the sharded parameters, until 2026-12-02). fsdp_native warns of
  such outputs, as torch FSDP2 does since 2.13.

* **A unit that first runs in a later step** (a vision tower with text-only first batches), with
  gradient accumulation; torch 2.13's FSDP2 raises there with a bf16 policy (at the test).

* **A validation forward under no_grad after each step**, the parameters read right after it,
  with units resharded to 2 of 4 ranks after forward (``reshard_after_forward=2``), where
  torch FSDP2's registered parameters are wrong on some ranks (the comment at the test).

Bit for bit torch FSDP2's losses, gradients of the last step (None where torch has None) and
parameters, in fp32 and with a bf16 policy; in fp32 also an unsharded model trained on the mean
of the ranks' losses, within 1e-6 (Muon: within 1e-2, 2e-2 before torch 2.11, as its iterations
run in bf16)."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_native._compat import TORCH_VERSION

from dist_utils import assert_close, assert_same_run, full, full_params, grid, load_impl, rank_mean, ref_impl, run_distributed, run_grid
from models import BlockStack, ResidualMLP, shard_stack

STEPS = 5
SKIPS = [(), (1,), (0, 2), (), (1,)]  # the blocks skipped in each step
FP32_TOL = dict(rtol=1e-6, atol=1e-6)
# Muon's Newton-Schulz iterations run in bf16: on a sharded parameter DTensor sums their
# matmuls in another order than on the whole matrix, and the iterations amplify the rounding.
# One step of a 10x6 matrix at lr 2e-2 differs by 7.6e-4 from the unsharded one (its update is
# 2.1e-2), in torch FSDP2 and fsdp_native alike; after 5 steps the parameters by up to 5.5e-3.
# On torch 2.9 and 2.10 (the same Muon code as 2.13's) by up to 1.3e-2, in both libraries
# alike: their runs are equal bit for bit there too.
MUON_UNSHARDED_TOL = dict(rtol=0, atol=1e-2 if TORCH_VERSION >= (2, 11) else 2e-2)


class DropStack(BlockStack):
    skip: tuple = ()

    def forward(self, x):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i not in self.skip:
                h = b(h)
        return self.out(h)


class SliceOut(ResidualMLP):
    """A block whose output is a view (a slice) of its result."""

    def forward(self, x):
        return super().forward(x)[:, :]


class InplaceViewStack(BlockStack):
    """The blocks' outputs modified in place. The first block takes the input itself (no
    gradient), so no post-backward of its inputs covers it."""

    def forward(self, x):
        h = x
        for b in self.blocks:
            h = b(h)
            h += 0.25
        return self.out(h)


def _model(flow: str = "") -> DropStack:
    torch.manual_seed(0)
    if flow == "inplace_view":
        return InplaceViewStack(lambda: SliceOut(4, 10), dim=4, n=3)
    return DropStack(lambda: ResidualMLP(6, 10), dim=6, n=3)


VIEW_WARNING = (
    "fully_shard: the forward of unit 'blocks.{i}' (FSDPSliceOut) returned a view tensor that requires "
    "grad. An in-place op on it (`out += y`) drops the unit's pre-backward hook, so the unit's backward runs "
    "without its all-gather: with reshard_after_forward it fails. Use an out-of-place op (`out = out + y`) or "
    "return a `.clone()`."
)


def _optim(flow: str, model):
    if flow == "fused_adamw_groups":
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                  {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2, fused=True)
    if flow == "muon_adamw":
        hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
        rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
        return _Optimizers(torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.1), torch.optim.AdamW(rest, lr=1e-2))
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


class _Optimizers:
    """Several optimizers stepped as one."""

    def __init__(self, *optims):
        self.optims = optims

    def step(self):
        for o in self.optims:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optims:
            o.zero_grad(set_to_none=set_to_none)


def _inputs(rank: int) -> list:
    gen = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 4, generator=gen) for _ in range(STEPS)]


def _train(model, flow: str, forward_loss) -> dict:
    opt = _optim(flow, model)
    losses, grads = [], None
    for step in range(STEPS):
        if flow == "layerdrop":
            model.skip = SKIPS[step]
        loss = forward_loss(model, step)
        loss.backward()
        if step == STEPS - 1:
            grads = {n: None if p.grad is None else full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 1)
        losses.append(loss.item())
    return dict(losses=losses, params=full_params(model), grads=grads)


def _sharded_run(impl, flow: str, mp: bool) -> dict:
    kw = dict(reshard_after_forward=False) if flow == "inplace_view" else {}
    model = shard_stack(impl, _model(flow), mp=mp, **kw)
    xs = _inputs(dist.get_rank())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = _train(model, flow, lambda m, step: m(xs[step]).float().pow(2).mean())
    if impl.name == "fsdp_native":  # each forward warns of each block's view output
        got = [str(w.message) for w in seen if "returned a view" in str(w.message)]
        assert got == ([VIEW_WARNING.format(i=i) for i in range(3)] * STEPS if flow == "inplace_view" else []), got
    return out


def _unsharded_run(flow: str) -> dict:
    """The same steps on one unsharded model: the loss is the mean of every rank's loss (what
    FSDP's averaged gradients are the gradient of); `losses` holds this rank's own."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    xs = [_inputs(r) for r in range(ws)]
    own = []

    def forward_loss(m, step):
        per_rank = [m(xs[r][step]).pow(2).mean() for r in range(ws)]
        own.append(per_rank[rank].item())
        return torch.stack(per_rank).mean()

    out = _train(_model(flow), flow, forward_loss)
    out["losses"] = own
    return out


def _body(flow: str, mp: bool) -> None:
    ours, theirs = _sharded_run(load_impl(), flow, mp), _sharded_run(ref_impl(), flow, mp)
    what = f"[{flow}, mp {mp}]"
    assert_same_run(what, ours, theirs)
    assert ours["grads"].keys() == theirs["grads"].keys()
    for n, g in theirs["grads"].items():
        assert_close(f"{what} last step's gradient of {n}", ours["grads"][n], g, dict(rtol=0, atol=0))
    if flow == "layerdrop":  # block 1 is skipped in the last step, after a zero_grad(set_to_none=True)
        assert all(g is None for n, g in ours["grads"].items() if n.startswith("blocks.1.")), what
        assert all(g is not None for n, g in ours["grads"].items() if not n.startswith("blocks.1.")), what
    if not mp:
        tol = MUON_UNSHARDED_TOL if flow == "muon_adamw" else FP32_TOL
        assert_same_run(f"{what} against an unsharded model", ours, _unsharded_run(flow), tol)


def _gan_run(impl, mp: bool, sharded: bool = True) -> dict:
    torch.manual_seed(0)
    gen, disc = _model(), _model()
    if sharded:
        gen, disc = shard_stack(impl, gen, mp=mp), shard_stack(impl, disc, mp=mp)
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=1e-2), torch.optim.Adam(disc.parameters(), lr=1e-2)
    bce = torch.nn.BCEWithLogitsLoss()
    ranks = [dist.get_rank()] if sharded else range(dist.get_world_size())
    data = {r: (_inputs(r), _inputs(100 + r)) for r in ranks}  # (noise, real data) per step
    losses = []
    for step in range(STEPS):
        fake = {r: gen(data[r][0][step]).float().expand(-1, 4) for r in ranks}
        loss_d = torch.stack([bce(disc(data[r][1][step]).float(), torch.ones(4, 1))
                              + bce(disc(fake[r].detach()).float(), torch.zeros(4, 1)) for r in ranks]).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = torch.stack([bce(disc(fake[r]).float(), torch.ones(4, 1)) for r in ranks]).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        losses += [loss_d.item(), loss_g.item()]
    return dict(losses=losses, params={**{f"gen.{n}": p for n, p in full_params(gen).items()},
                                       **{f"disc.{n}": p for n, p in full_params(disc).items()}})


def _gan_body(mp: bool) -> None:
    ours = _gan_run(load_impl(), mp)
    assert_same_run(f"[gan, mp {mp}]", ours, _gan_run(ref_impl(), mp))
    if not mp:  # an unsharded pair trained on every rank's data (losses: the mean over the ranks)
        ref = _gan_run(None, mp, sharded=False)
        mean_losses = torch.tensor(ours["losses"])
        dist.all_reduce(mean_losses)
        assert_same_run("[gan] against an unsharded pair", dict(ours, losses=(mean_losses / dist.get_world_size()).tolist()), ref, FP32_TOL)


def _check() -> None:
    run_grid(grid(flow=["layerdrop", "fused_adamw_groups", "muon_adamw", "inplace_view"], mp=[False, True]), _body)
    run_grid(grid(mp=[False, True]), _gan_body)


def test_training_flows_match_torch_and_unsharded():
    run_distributed(_check, 2)


def _view_warning_once_per_unit() -> None:
    """Under Python's default filter the view-output warning shows once per unit, however the
    batch shapes vary (its text names no shape), and a filter written for torch FSDP2's warning
    ("returned a view tensor") silences it."""
    model = shard_stack(load_impl(), _model("inplace_view"), reshard_after_forward=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for rows in (4, 3, 5, 4):
            model(torch.randn(rows, 4)).pow(2).mean().backward()
    got = [str(w.message) for w in seen if "returned a view" in str(w.message)]
    assert got == [VIEW_WARNING.format(i=i) for i in range(3)], got
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        model(torch.randn(2, 4)).pow(2).mean().backward()
    assert not [w for w in seen if "returned a view" in str(w.message)], [str(w.message) for w in seen]


def test_view_output_warning_once_per_unit():
    if load_impl().name != "fsdp_native":
        pytest.skip("fsdp_native's warning text")
    run_distributed(_view_warning_once_per_unit, 2)


# --------------------------------------------------------------------------------------------
# A validation forward under no_grad after each step, the parameters read right after it
# (found by the fuzzing, tests/test_fuzz.py, on 2026-12-02). Each block unit reshards to 2 of
# the 4 ranks after forward (reshard_after_forward=2); the root keeps its parameters unsharded
# after forward, as a root does by default. After a no_grad forward no backward reshards the
# blocks fully, so they wait in their post-forward shards until the next forward. torch FSDP2
# registers those post-forward shards as the parameters meanwhile (DTensors on a 2-D
# (Replicate(), Shard(0)) mesh), and on some ranks their local tensors hold other values than
# the parameters' shards: `model.parameters()` read then (a weight-norm log, an EMA update)
# gives wrong values, while its state_dict() is right. fsdp_native keeps the
# sharded parameters registered. Checked: the losses and validation outputs bit for bit torch
# FSDP2's; the parameters read after the last validation forward, torch's state_dict() values
# and, in fp32, an unsharded model's (within FP32_TOL), with reshard_after_forward 2 and
# False for the blocks.

def _validation_run(impl, raf, mp: bool) -> dict:
    ws, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    if impl is not None:
        mesh = init_device_mesh("cpu", (ws,))
        kw = dict(mesh=mesh)
        if mp:
            kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            impl.fully_shard(b, reshard_after_forward=raf, **kw)
        impl.fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ranks = [rank] if impl is not None else range(ws)
    xs = {r: _inputs(r) for r in ranks}
    probe = torch.linspace(-1, 1, 8).view(2, 4)
    losses = []
    for step in range(STEPS):
        loss = torch.stack([model(xs[r][step]).float().pow(2).mean() for r in ranks]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            out = model(probe).float()
        losses += [loss.item(), out.sum().item()]
    read = {n: full(p) for n, p in model.named_parameters()}  # right after the no_grad forward
    # the root stays unsharded after forward (its reshard_after_forward is None), in both libraries
    registered = {n: tuple(p.placements) if isinstance(p, DTensor) else None for n, p in model.named_parameters()}
    state = {n: full(t) for n, t in model.state_dict().items()}
    return dict(losses=losses, params=read, state=state, registered=registered)


def _validation(raf, mp: bool) -> None:
    ours, theirs = _validation_run(load_impl(), raf, mp), _validation_run(ref_impl(), raf, mp)
    what = f"[validation, reshard_after_forward {raf}, mp {mp}]"
    # The losses and validation outputs, and the parameters read after the validation forward:
    # torch's where it registers the root's unsharded ones (bf16 with mp) or the sharded
    # ones, its state_dict()'s where it registers post-forward shards.
    post_forward = {n for n, pl in theirs["registered"].items() if pl is not None and len(pl) == 2}
    expected = {n: theirs["state" if n in post_forward else "params"][n] for n in theirs["params"]}
    assert_same_run(what, ours, dict(theirs, params=expected))
    assert_same_run(f"{what} state_dict()", dict(ours, params=ours["state"]), dict(theirs, params=theirs["state"]))
    if load_impl().name == "fsdp_native" and raf is not False:
        blocks = {n: pl for n, pl in ours["registered"].items() if n.startswith("blocks.")}
        assert set(blocks.values()) == {(Shard(0),)}, f"{what} registered: {blocks}"
    if not mp:
        plain = _validation_run(None, raf, mp)
        mean = rank_mean(torch.tensor(ours["losses"]))  # every rank's validation outputs are the same
        assert_same_run(f"{what} against an unsharded model", dict(ours, losses=mean), plain, FP32_TOL)


def _torch_post_forward_params() -> None:
    """What the test above guards against: torch FSDP2's parameters read after such a forward."""
    run = _validation_run(ref_impl(), 2, False)
    blocks = {n: pl for n, pl in run["registered"].items() if n.startswith("blocks.")}
    assert all(pl is not None and len(pl) == 2 for pl in blocks.values()), f"torch FSDP2 registered {blocks} (update this test's comment)"
    wrong = sorted(n for n in blocks if not torch.equal(run["params"][n], run["state"][n]))
    assert wrong, "torch FSDP2's parameters read after the forward are its state_dict()'s now (update this test's comment)"


def _validation_grid() -> None:
    if load_impl().name == "fsdp_native":
        run_grid([{}], _torch_post_forward_params, name="torch")
    run_grid(grid(raf=[2, False], mp=[False, True]), _validation, name="validation")


def test_parameters_read_after_a_validation_forward():
    run_distributed(_validation_grid, 4)


# --------------------------------------------------------------------------------------------
# A unit that first runs in a later step: a vision-language model's vision tower and projector,
# each a unit of its own, when the first batches are text only (NeMo Automodel's VLM flows),
# with two micro-batches a step and gradient sync on the last only; later steps have the image
# in one micro-batch of the two, then in none. The same on every rank. With a bf16 policy and
# fp32 reduction, torch 2.13's FSDP2 raises in its end-of-backward callback, which runs the
# post-backward of every unit, for a unit that was never unsharded: "'FSDPParam' object has no
# attribute '_unsharded_param'" (to_accumulated_grad_if_needed; NeMo Automodel patches that
# method to return there; torch 2.15 trains it). There, the reference is torch FSDP2 with the
# same guard. Checked: losses and parameters bit for bit torch FSDP2's, in fp32 also an
# unsharded model's (gradients averaged over the ranks by hand) within FP32_TOL.

VLM_PLAN = [[False, False], [True, False], [False, True], [False, False]]  # image in each micro-batch


class _VLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
        self.proj = torch.nn.Linear(6, 6)
        self.embed = torch.nn.Embedding(10, 6)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))
        self.head = torch.nn.Linear(6, 10)

    def forward(self, tokens, image=None):
        h = self.embed(tokens)
        if image is not None:
            h = h + self.proj(self.vision(image)).mean(0, keepdim=True)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.head(h)


def _vlm_run(impl, mp: bool) -> dict:
    torch.manual_seed(0)
    model = _VLM()
    if impl is not None:
        kw = dict(mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        if mp:
            kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for m in (model.vision, model.proj, *model.blocks, model):
            impl.fully_shard(m, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses = []
    for micro_batches in VLM_PLAN:
        for i, with_image in enumerate(micro_batches):
            if impl is not None:
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            tokens = torch.randint(0, 10, (4,), generator=gen)
            image = torch.randn(3, 5, generator=gen) if with_image else None
            loss = torch.nn.functional.cross_entropy(model(tokens, image).float(), torch.roll(tokens, 1))
            loss.backward()
            losses.append(loss.item())
        if impl is None:  # the unsharded model: gradients averaged by hand
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
    params = full_params(model) if impl is not None else {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, params=params)


def _torch_vlm_run(mp: bool) -> dict:
    """torch FSDP2's run; where it raises for the never-unsharded unit, again with the guard."""
    try:
        return _vlm_run(ref_impl(), mp)
    except AttributeError as e:
        if "_unsharded_param" not in str(e):
            raise
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    orig = FSDPParam.to_accumulated_grad_if_needed

    def guarded(self):
        if not hasattr(self, "_unsharded_param"):  # never unsharded: no gradient to upcast
            return None
        return orig(self)

    FSDPParam.to_accumulated_grad_if_needed = guarded
    try:
        return _vlm_run(ref_impl(), mp)
    finally:
        FSDPParam.to_accumulated_grad_if_needed = orig


def _vlm(mp: bool) -> None:
    ours = _vlm_run(load_impl(), mp)
    what = f"[vision tower first run in step 1, mp {mp}]"
    assert_same_run(what, ours, _torch_vlm_run(mp))
    if not mp:
        assert_same_run(f"{what} against an unsharded model", ours, _vlm_run(None, mp), FP32_TOL)


def _vlm_grid() -> None:
    run_grid(grid(mp=[False, True]), _vlm, name="vlm")


def test_unit_first_run_in_a_later_step():
    run_distributed(_vlm_grid, 2)
