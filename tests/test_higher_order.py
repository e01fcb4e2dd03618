"""Higher-order gradients: a backward with ``create_graph=True``, then a backward through the
graph it built.

The flows: a gradient penalty (WGAN-GP's ``torch.autograd.grad(out, x, create_graph=True)``
added to the loss), R1 regularization (the penalty alone), a physics-informed loss (a second
derivative in x: two such grads), WGAN-GP's order (the penalty first, then more forwards, then
one backward of the sum), and ``loss.backward(create_graph=True)``. Also a whole WGAN-GP: a
generator and a critic, each its own root, the critic's steps with the penalty, the generator's
backward through the critic.

The double backward reads the unsharded parameters that the first backward used. Torch FSDP2
(2.13) frees them after that backward, and the second backward fails with ``setStorage: ...
out of bounds for storage of size 0``. Its workaround (``reshard_after_forward=False``,
``set_reshard_after_backward(False)`` and a ``reshard()`` of every module after the step)
keeps every unit unsharded for the whole step. fsdp_native keeps the storage of the units that
a ``create_graph=True`` backward reached (``Unit.hold``) and frees it at the end of the next
ordinary backward, or at the next forward when that graph was dropped. Against the workaround
its runs are bit for bit torch FSDP2's; against unsharded training within 1e-6 (fp32).

The model has a linear-only unit (``head``) after the blocks. Part of its weight's gradient
comes from the double backward, at the end of a chain through the blocks' double backward,
while the forward's path to its inputs is short: its reduction must still see that part.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from dist_utils import assert_close, assert_same_run, full_params, rank_mean, grid, load_impl, ref_impl, run_distributed, run_grid
from models import TanhResidual

STEPS = 3
TOL = dict(rtol=1e-6, atol=1e-6)
TORCH_FAILURE = "setStorage:"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(TanhResidual(8) for _ in range(2))
        self.head = nn.Linear(8, 8)  # see the module docstring
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = b(h)
        return self.out(torch.tanh(self.head(h)) * h)


def _gp(m, x):
    """WGAN-GP's penalty added to a loss."""
    x = x.requires_grad_(True)
    out = m(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = out.float().pow(2).mean() + (g.float().norm(dim=1) - 1).pow(2).mean()
    loss.backward()
    return loss


def _r1(m, x):
    """R1 regularization: the penalty alone."""
    x = x.requires_grad_(True)
    (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    loss = g.float().pow(2).sum(dim=1).mean()
    loss.backward()
    return loss


def _pinn(m, x):
    """A physics-informed residual u'' + u = 0 in x[:, 0] (two create_graph grads)."""
    x = x.requires_grad_(True)
    u = m(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    (d2u,) = torch.autograd.grad(du[:, 0].sum(), x, create_graph=True)
    loss = (d2u[:, 0] + u[:, 0]).float().pow(2).mean() + u[:2].float().pow(2).mean()
    loss.backward()
    return loss


def _wgan(m, x):
    """WGAN-GP's order: the penalty on interpolates first, then the critic on real and fake
    (more forwards while the penalty's graph is alive), then one backward of the sum."""
    real, fake = x[:3], x[3:]
    eps = torch.rand(3, 1, generator=torch.Generator().manual_seed(int(x.sum().abs() * 1000)))
    interp = (eps * real + (1 - eps) * fake).requires_grad_(True)
    (g,) = torch.autograd.grad(m(interp).sum(), interp, create_graph=True)
    gp = (g.float().norm(dim=1) - 1).pow(2).mean()
    loss = m(fake).float().mean() - m(real).float().mean() + 10 * gp
    loss.backward()
    return loss


def _cg_backward(m, x):
    loss = m(x).float().pow(2).mean()
    loss.backward(create_graph=True)
    return loss


FLOWS = {"gp": _gp, "r1": _r1, "pinn": _pinn, "wgan": _wgan, "cg_backward": _cg_backward}


def _shard(impl, mp: bool, workaround: bool = False, hsdp: bool = False):
    m = Net()
    kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if mp else {}
    if hsdp:
        kw["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    if workaround:
        kw["reshard_after_forward"] = False
    for mod in (*m.blocks, m.head, m):
        impl.fully_shard(mod, **kw)
        if workaround:
            mod.set_reshard_after_backward(False)
    return m


def _batch(step: int, rank: int):
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(m, flow: str, ranks, workaround: bool = False, accum: bool = False, mesh=None) -> dict:
    """`accum`: two micro-batches a step, the first without gradient sync."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = 0
        for mb in range(2 if accum else 1):
            if accum and hasattr(m, "set_requires_gradient_sync"):
                m.set_requires_gradient_sync(mb == 1)
            # Sharded runs take their rank's batch; the unsharded one every rank's, one rank's
            # batch after the other (the flows' losses are means over a rank's batch).
            loss = loss + sum(FLOWS[flow](m, _batch(10 * step + mb, r)).detach() for r in ranks) / len(ranks)
        if len(ranks) > 1:
            for p in m.parameters():
                if p.grad is not None:  # R1: the output bias gets none
                    p.grad /= len(ranks)
        if workaround:
            for mod in m.modules():
                if isinstance(mod, load_impl("torch").FSDPModule):
                    mod.reshard()
        opt.step()
        losses.append(loss)
    if dist.is_initialized() and len(ranks) == 1:
        losses = [rank_mean(l) for l in losses]
    return dict(losses=torch.stack(losses), params=full_params(m))


def _parity(flow: str, mp: bool, accum: bool = False, hsdp: bool = False) -> None:
    impl, ref, rank = load_impl(), ref_impl(), dist.get_rank()
    got = _train(_shard(impl, mp, hsdp=hsdp), flow, [rank], accum=accum)
    if flow == "cg_backward":  # torch FSDP2 runs it as it is
        want = _train(_shard(ref, mp, hsdp=hsdp), flow, [rank], accum=accum)
    else:
        want = _train(_shard(ref, mp, workaround=True, hsdp=hsdp), flow, [rank], workaround=True, accum=accum)
    # With micro-batches, the workaround's create_graph backward already reduces the gradients
    # of the micro-batch before (its post-backward runs, with sync on), and the final backward
    # reduces its own: two sums where fsdp_native does one, some ulps apart in fp32.
    assert_same_run(f"{flow} against torch FSDP2", got, want, TOL if accum and flow != "cg_backward" else None)
    if not mp:
        unsharded = _train(Net(), flow, list(range(dist.get_world_size())), accum=accum)
        assert_same_run(f"{flow} against unsharded", got, unsharded, TOL)


def _torch_fails(flow: str) -> None:
    """What the tests above guard against: torch FSDP2 as it is fails these flows."""
    m = _shard(ref_impl(), mp=False)
    try:
        FLOWS[flow](m, _batch(0, dist.get_rank()))
    except RuntimeError as e:
        assert str(e).startswith(TORCH_FAILURE), str(e)
    else:
        raise AssertionError(f"torch FSDP2 ran {flow} without the workaround (update this test's docstring)")


def _memory() -> None:
    """The held storage: kept from the create_graph backward to the end of the next ordinary
    backward (then freed as in a plain step), and freed at the next forward when the graph
    was dropped without a backward through it."""
    impl = load_impl()
    if impl.name != "fsdp_native":
        return
    from fsdp_native import unsharded_stats

    m = _shard(impl, mp=False)
    full = {fqn: s.unsharded_bytes for fqn, s in unsharded_stats(m).units.items()}
    x = _batch(0, dist.get_rank()).requires_grad_(True)
    out = m(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    held = {fqn: s.current_bytes for fqn, s in unsharded_stats(m).units.items()}
    assert held == full, f"after the create_graph backward: {held}, expected every unit's full size {full}"
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in m.parameters()), "resharded registration"
    (out.pow(2).mean() + g.pow(2).mean()).backward()
    assert unsharded_stats(m).current_bytes == 0, unsharded_stats(m)
    # A dropped graph: no backward through it.
    x = _batch(1, dist.get_rank()).requires_grad_(True)
    out = m(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    assert unsharded_stats(m).current_bytes == sum(full.values())
    del g, out  # the graph's last references
    with torch.no_grad():
        m(x)
    # As after any forward without grad: the root keeps its parameters (it does not reshard
    # after forward), every other unit freed them.
    after = {fqn: s.current_bytes for fqn, s in unsharded_stats(m).units.items()}
    assert after == {fqn: n if fqn == "" else 0 for fqn, n in full.items()}, f"after the next forward: {after}"
    # loss.backward(create_graph=True) accumulates parameter gradients: it frees as an
    # ordinary backward does (as torch FSDP2 does), keeping nothing for its graph.
    _cg_backward(m, _batch(2, dist.get_rank()))
    assert unsharded_stats(m).current_bytes == 0, f"after backward(create_graph=True): {unsharded_stats(m)}"


class _Generator(nn.Module):
    def __init__(self, dims: tuple[int, int]):
        super().__init__()
        self.inp = nn.Linear(dims[0], 8)
        self.blocks = nn.ModuleList(TanhResidual(8) for _ in range(2))
        self.out = nn.Linear(8, dims[1])

    def forward(self, z):
        h = self.inp(z)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _gan(impl, mp: bool, ranks, workaround: bool = False) -> dict:
    """WGAN-GP with a generator and a critic, each its own root: critic steps with the penalty,
    then generator steps whose backward runs through the critic into the generator."""
    torch.manual_seed(0)
    gen, critic = _Generator((3, 4)), _Generator((4, 1))
    models = (gen, critic)
    if impl is not None:
        kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if mp else {}
        if workaround:
            kw["reshard_after_forward"] = False
        for m in models:
            for mod in (*m.blocks, m):
                impl.fully_shard(mod, **kw)
                if workaround:
                    mod.set_reshard_after_backward(False)

    def reshard():
        if workaround:
            for m in models:
                for mod in m.modules():
                    if isinstance(mod, impl.FSDPModule):
                        mod.reshard()

    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-2, betas=(0.5, 0.9))
    for step in range(3):
        opt_c.zero_grad()
        for r in ranks:
            g = torch.Generator().manual_seed(100 * step + r)
            real, z, eps = torch.randn(4, 4, generator=g) + 1, torch.randn(4, 3, generator=g), torch.rand(4, 1, generator=g)
            fake = gen(z).detach()
            interp = (eps * real + (1 - eps) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(critic(interp).sum(), interp, create_graph=True)
            penalty = (grad.float().norm(dim=1) - 1).pow(2).mean()
            ((critic(fake).float().mean() - critic(real).float().mean() + 10 * penalty) / len(ranks)).backward()
        reshard()
        opt_c.step()
        opt_g.zero_grad()
        for r in ranks:
            z = torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * step + r + 50))
            (-critic(gen(z)).float().mean() / len(ranks)).backward()
        reshard()
        opt_g.step()
    return {f"{name}.{k}": v for name, m in (("gen", gen), ("critic", critic)) for k, v in full_params(m).items()}


def _two_models(mp: bool) -> None:
    rank = dist.get_rank()
    got = _gan(load_impl(), mp, [rank])
    want = _gan(ref_impl(), mp, [rank], workaround=True)
    for n in want:
        assert_close(f"WGAN-GP {n} against torch FSDP2", got[n], want[n], dict(rtol=0, atol=0))
    if not mp:
        want = _gan(None, mp, list(range(dist.get_world_size())))
        for n in want:
            assert_close(f"WGAN-GP {n} against unsharded", got[n], want[n], TOL)


def _body() -> None:
    if load_impl().name == "fsdp_native":
        run_grid(grid(flow=["gp", "r1", "pinn", "wgan"]), _torch_fails, name="torch fails")
    run_grid(grid(flow=list(FLOWS), mp=[False, True]), _parity, name="parity")
    # Micro-batches without sync first: their gradients wait, unreduced, through the
    # create_graph backward of the next micro-batch (it reduces nothing).
    run_grid(grid(flow=list(FLOWS), mp=[False, True], accum=[True]), _parity, name="accumulation")
    run_grid(grid(mp=[False, True]), _two_models, name="generator and critic")
    _memory()


def _hsdp_body() -> None:
    run_grid(grid(flow=["gp", "pinn", "wgan"], mp=[False, True], hsdp=[True]), _parity, name="hsdp")


def test_higher_order_gradients():
    run_distributed(_body, 2, timeout=600)


def test_higher_order_gradients_one_rank():
    run_distributed(_body, 1, timeout=600)


def test_higher_order_gradients_hsdp():
    run_distributed(_hsdp_body, 4, timeout=600)
